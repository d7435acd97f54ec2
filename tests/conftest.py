"""Shared fixtures: real services on loopback (Redis, moto's S3 server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.bench.redis_cluster import NoRedis, RedisCluster, start_cluster

_GIVEN: set[int] = set()

#: The torch device of the device-tier and paged-cache tests: ``cpu`` here
#: and in CI, ``cuda`` on a machine with a GPU (scripts/device-check.sh).
TEST_DEVICE = os.environ.get("KVSTORE_TEST_DEVICE", "cpu")


def free_port() -> int:
    """A port free now and never handed out before in this process: two
    servers whose ports are picked before either binds (a cluster fixture)
    cannot be given the same one (CI saw that once: EADDRINUSE)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class RedisServer:
    """A redis-server process of our own, so a test may kill and restart it."""

    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            # CI installs it (.ci/run); a missing Redis is a failure, not a skip.
            pytest.fail("redis-server is not installed")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of 3 masters with a replica each (tests/redis_cluster.py),
    shared by the tests that only use it; a test that kills a node takes
    ``own_redis_cluster``."""
    cluster = _cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_redis_cluster() -> Iterator[RedisCluster]:
    cluster = _cluster()
    yield cluster
    cluster.stop()


def _cluster() -> RedisCluster:
    try:
        return start_cluster(free_port)
    except NoRedis as exc:
        # CI installs them (.ci/run); a missing Redis is a failure, not a skip.
        pytest.fail(str(exc))


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server for tests that kill it."""
    server = RedisServer(free_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto in server mode: a real HTTP S3 endpoint on loopback."""
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for_port(port, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=10)


S3_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket (made with boto3, moto's own dependency; tiers use aiobotocore)."""
    import boto3

    name = f"kvstore-{uuid.uuid4().hex[:16]}"
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=name)
    return name


@pytest.fixture
def lmdb_path(tmp_path: Path) -> str:
    return str(tmp_path / "lmdb")
