"""A real Redis Cluster on loopback, for the benchmarks and the tests: 3
masters with a replica each, from ``redis-server --cluster-enabled yes`` and
``redis-cli --cluster create`` (the Debian packages redis-server and
redis-tools; nothing else). A short ``cluster-node-timeout`` makes a killed
master's replica take over in about two seconds."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: How long a master may be silent before its replica takes over (ms).
NODE_TIMEOUT_MS = 1000


class NoRedis(RuntimeError):
    """redis-server or redis-cli is not installed."""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise NoRedis(f"{name} is not installed (Debian: redis-server, redis-tools)")
    return found


def available() -> bool:
    return all(shutil.which(name) for name in ("redis-server", "redis-cli"))


@dataclass
class RedisCluster:
    ports: list[int]
    bus_ports: list[int]
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvstore-cluster-")))
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A node of the cluster: the clients discover the rest from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        server = _binary("redis-server")
        for port, bus in zip(self.ports, self.bus_ports, strict=True):
            self.processes[port] = subprocess.Popen(
                [
                    server,
                    "--port",
                    str(port),
                    "--cluster-port",
                    str(bus),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.root),
                    # A replica can take over only once it has synced: at once.
                    "--repl-diskless-sync-delay",
                    "0",
                    "--loglevel",
                    "warning",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for port in self.ports:
            self._wait(functools.partial(self._answers, port), f"node {port}")
        subprocess.run(
            [
                _binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_healthy()

    def _answers(self, port: int) -> bool:
        return self.cli(port, "PING") == "PONG"

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            [_binary("redis-cli"), "-p", str(port), *args], capture_output=True, timeout=10
        )
        return done.stdout.decode().strip()

    def _wait(self, ok: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"redis cluster: {what} not ready after {timeout:.0f} s")

    def masters(self) -> list[int]:
        """The ports of the nodes serving as masters now."""
        return [p for p in self.live() if "role:master" in self.cli(p, "INFO", "replication")]

    def live(self) -> list[int]:
        return [p for p, proc in self.processes.items() if proc.poll() is None]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every live node sees every slot served (``cluster_state:ok``),
        three masters, and every replica synced with its master."""

        def ok() -> bool:
            live = self.live()
            if not all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in live):
                return False
            roles = [self.cli(p, "INFO", "replication") for p in live]
            masters = sum("role:master" in r for r in roles)
            return masters == 3 and all(
                "master_link_status:up" in r for r in roles if "role:slave" in r
            )

        self._wait(ok, "cluster_state:ok", timeout)

    def master_of(self, key: str) -> int:
        slot = self.cli(self.live()[0], "CLUSTER", "KEYSLOT", key)
        for line in self.cli(self.live()[0], "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            for span in parts[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= int(slot) <= int(high or low):
                    return int(parts[1].split(":")[1].split("@")[0])
        raise RuntimeError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        process = self.processes[port]
        process.kill()
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _unique_ports(count: int) -> list[int]:
    import socket

    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.add(int(sock.getsockname()[1]))
    return sorted(ports)


def start_cluster(free_port: Callable[[], int] | None = None) -> RedisCluster:
    """A cluster on ports from ``free_port`` (clients' and cluster bus'; by
    default twelve distinct free ones); :class:`NoRedis` when the binaries
    are missing."""
    picked = [free_port() for _ in range(12)] if free_port else _unique_ports(12)
    ports, bus_ports = picked[:6], picked[6:]
    cluster = RedisCluster(ports, bus_ports)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


__all__ = ["NODE_TIMEOUT_MS", "NoRedis", "RedisCluster", "available", "start_cluster"]
