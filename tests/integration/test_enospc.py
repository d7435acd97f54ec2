"""A real ENOSPC (issue 9): a holder process whose LMDB lies on a 4 MiB
tmpfs, mounted in a mount namespace of its own (``unshare -rm``), with a map
far larger than the file system. PUTs past the room fail with 507
problem+json naming the file system, others go on being served, a lease
still works; the holder is then SIGKILLed on its full disk and restarted
(a shell in the namespace starts it again over the same tmpfs), and every
acknowledged block is served intact.

Before this test, LMDB's ``EIO`` from a short page write was a 503 "tier
unavailable", and a layer table refused for lack of room was only logged:
the PUT was acknowledged and its block lost at the next restart."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.protocol.problems import KvspError
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..storage.helpers import COMPAT, SCOPE, ref
from .test_index import SERVER

# In the new namespace: mount the tmpfs, then run the holder again each time
# it dies, until the test removes the "run" file.
SUPERVISOR = (
    'mount -t tmpfs -o size=4m kvstore-test "$0" && while [ -e run ]; do "$@"; sleep 0.1; done'
)


def body_of(n: int) -> bytes:
    rng = random.Random(n)
    return bytes(
        kc.encode(
            [(rng.randbytes(32 << 10), rng.randbytes(32 << 10)) for _ in range(4)], token_count=4
        )
    )


def holder_pid(shell: int) -> int | None:
    children = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"kvstore" in cmdline:
            return int(pid)
    return None


async def test_a_full_file_system_refuses_puts_and_loses_nothing(tmp_path: Path) -> None:
    # The test needs a mount namespace (root, or unprivileged user
    # namespaces): said plainly if the machine refuses one, not a timeout.
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m probe "{tmp_path}"'],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, f"unshare -rm with a tmpfs mount refused: {probe.stderr}"
    create_dev_certificates(tmp_path / "certs", ["alice"])
    port = free_port()
    uri = f"https://127.0.0.1:{port}/kvsp/"
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {"principals": {"urn:kvstore:alice": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
        )
    )
    (tmp_path / "lmdb").mkdir()
    (tmp_path / "holder.toml").write_text(
        SERVER.format(port=port) + f'[holder]\nuri = "{uri}"\npolicy = "policy.json"\n'
        '[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 268435456\npath = "lmdb"\n'
        "map_size = 536870912\n"  # 512 MiB of map on 4 MiB of file system
    )
    (tmp_path / "run").touch()
    log = (tmp_path / "holder.log").open("ab")
    shell = subprocess.Popen(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            SUPERVISOR,
            str(tmp_path / "lmdb"),
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--roles",
            "holder",
            "--config",
            str(tmp_path / "holder.toml"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    certs = tmp_path / "certs"
    context = client_context(
        str(certs / "ca.pem"), str(certs / "client-alice.pem"), str(certs / "client-alice.key")
    )
    try:
        try:
            wait_for_port(port, timeout=30)
        except RuntimeError:
            raise RuntimeError((tmp_path / "holder.log").read_text()) from None
        acknowledged: list[int] = []
        refused: KvspError | None = None
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(200):  # 4 MiB hold fewer than 64 blocks of 256 KiB
                try:
                    await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, body_of(n))
                except KvspError as exc:
                    refused = exc
                    break
                acknowledged.append(n)
            assert refused is not None and len(acknowledged) >= 4, (refused, len(acknowledged))
            assert refused.status == 507, refused
            assert "file system" in (refused.detail or ""), refused.detail
            # Still full: a second try is refused the same way, not a 5xx of another kind.
            try:
                await client.put_block(uri, COMPAT, SCOPE, ref(500).block_key, body_of(500))
                raise AssertionError("a put went in on a full file system")
            except KvspError as exc:
                assert exc.status == 507, exc
            for n in acknowledged:
                assert await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key) == body_of(n)
            grant = await client.lease(uri, [ref(acknowledged[0]).block_key], 1000)
            assert 0 < grant.ttl_ms <= 1000
        # SIGKILL on the full disk; the shell starts the holder again.
        pid = holder_pid(shell.pid)
        assert pid is not None
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        deadline = time.monotonic() + 30
        while (again := holder_pid(shell.pid)) in (None, pid):
            assert time.monotonic() < deadline, (tmp_path / "holder.log").read_text()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        wait_for_port(port, timeout=30)
        async with HolderClient(context, timeout_s=10) as client:
            for n in acknowledged:
                assert await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key) == body_of(n)
            for n in (acknowledged[-1] + 1, 500):  # the refused ones left nothing behind
                try:
                    await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                    raise AssertionError(f"refused block {n} is served")
                except KvspError as exc:
                    assert exc.status == 404, exc
        assert again is not None
    finally:
        (tmp_path / "run").unlink(missing_ok=True)
        pid = holder_pid(shell.pid) if shell.poll() is None else None
        if pid is not None:
            subprocess.run(["kill", "-TERM", str(pid)], check=False)
        try:
            shell.wait(timeout=20)
        except subprocess.TimeoutExpired:
            shell.send_signal(signal.SIGKILL)
            shell.wait(timeout=5)
