"""One owner per storage (issue 33), with real processes: a second holder on
the configuration of a running one (another port through
KVSTORE_SERVER__PORT) exits 2 with one line naming the owner, and the first
keeps serving every block; after a SIGKILL of the owner, a restart takes
over at once (LMDB's lock goes with the process; a Redis or S3 owner record
of a process of this host that is gone is stale). A start that fails (a missing certificate, a
port in use) touches no storage: no owner record, no recovery."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvstore.client import HolderClient

from ..conftest import RedisServer, free_port
from ..storage.helpers import COMPAT, SCOPE, ref
from .test_holder_crash import body_of, holder_over

TTL_S = 2.0


def tiers(
    kind: str, tmp_path: Path, redis_url: str, bucket: str, endpoint: str, prefix: str
) -> str:
    head = f"[storage]\nowner_ttl_s = {TTL_S}\n[[storage.tiers]]\ncapacity = 67108864\n"
    if kind == "lmdb":
        return head + f'backend = "lmdb"\npath = "{tmp_path / "lmdb"}"\n'
    if kind == "redis":
        return head + f'backend = "redis"\nurl = "{redis_url}"\nprefix = "{prefix}:"\n'
    return head + (
        f'backend = "s3"\nbucket = "{bucket}"\nprefix = "{prefix}/"\n'
        f'endpoint_url = "{endpoint}"\nregion = "us-east-1"\n'
        'access_key_id = "testing"\nsecret_access_key = "testing"\n'
    )


def second_start(
    tmp_path: Path, port: int, config: str = "holder.toml"
) -> subprocess.CompletedProcess[str]:
    """``kvstore serve`` of the same configuration on another port; it must end by itself."""
    env = dict(os.environ, KVSTORE_SERVER__PORT=str(port))
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(tmp_path / config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("kind", ["lmdb", "redis", "s3"])
async def test_a_second_holder_on_the_same_storage_is_refused(
    kind: str, tmp_path: Path, redis_server: RedisServer, s3_bucket: str, s3_endpoint: str
) -> None:
    prefix = f"owner-{uuid.uuid4().hex[:8]}"
    holder, port, uri, context, config = holder_over(
        tmp_path, tiers(kind, tmp_path, redis_server.url, s3_bucket, s3_endpoint, prefix)
    )
    (tmp_path / "holder.toml").write_text(config.replace("map_size = 536870912\n", ""))
    try:
        holder.start(port)
        assert holder.process is not None
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(6):
                await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, body_of(n))

            second = second_start(tmp_path, free_port())
            assert second.returncode == 2, second.stderr
            [line] = second.stderr.strip().splitlines()
            assert line.startswith("kvstore: error: ") and "is in use by" in line, line
            assert f"pid {holder.process.pid}" in line, line

            for n in range(6):  # the first keeps every block
                assert await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key) == body_of(n)

        holder.stop(signal.SIGKILL)  # a crash: no release
        # Restarted at once: LMDB's lock went with the process; a Redis or S3
        # owner record names a pid of this host that is gone, so it is taken
        # over before its TTL (one from another host waits it out: test_owner).
        holder.start(port)  # takes over, and recovers every block
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(6):
                assert await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key) == body_of(n)
        holder.stop()  # SIGTERM: the claim is given back ...
        assert holder.process is not None and holder.process.returncode == 0
        holder.start(port)  # ... so a start right after is not refused
    finally:
        holder.stop()


async def test_a_failed_start_touches_no_storage(tmp_path: Path, redis_server: RedisServer) -> None:
    import redis

    prefix = f"untouched-{uuid.uuid4().hex[:8]}"
    holder, port, _, _, config = holder_over(
        tmp_path, tiers("redis", tmp_path, redis_server.url, "", "", prefix)
    )
    config = config.replace("map_size = 536870912\n", "")
    (tmp_path / "holder.toml").write_text(config)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        # A stray segment key: a recovery would read it (and drop it, unreadable).
        stray = f"{prefix}:{{{'ab' * 32}}}/{COMPAT}/{SCOPE}/0-7"
        direct.set(stray, b"not a segment")

        (tmp_path / "broken.toml").write_text(config.replace("certs/server.pem", "certs/nope.pem"))
        failed = second_start(tmp_path, port, "broken.toml")
        assert failed.returncode == 2, failed.stderr
        [line] = failed.stderr.strip().splitlines()
        assert "server.certfile" in line and "nope.pem" in line, line

        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        try:
            failed = second_start(tmp_path, busy)
        finally:
            taken.close()
        assert failed.returncode == 2, failed.stderr
        [line] = failed.stderr.strip().splitlines()
        assert f"cannot listen on 127.0.0.1:{busy}" in line, line
        assert "serving" not in failed.stderr

        assert direct.get(f"{prefix}:owner") is None  # never claimed
        assert direct.get(stray) == b"not a segment"  # never recovered

        holder.start(port)  # the good one claims
        assert direct.get(f"{prefix}:owner") is not None
    finally:
        holder.stop()
        direct.delete(f"{prefix}:owner", stray)
        direct.close()
