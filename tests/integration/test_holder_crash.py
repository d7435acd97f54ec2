"""A holder killed with SIGKILL in the middle of PUTs (issue 9): after the
restart, every block whose PUT was acknowledged is served and verifies, and
no half-written block is served. The holder lists LMDB first (synchronous
writes: an acknowledged PUT is on disk), as docs/operations.md advises for
holders whose PUTs must survive a crash."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import ssl
import time
from pathlib import Path

from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.protocol.problems import KvspError
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..storage.helpers import COMPAT, SCOPE, ref
from .test_index import SERVER, Process

LMDB = '[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 268435456\npath = "lmdb"\n'


def holder_over(tmp_path: Path, tiers: str) -> tuple[Process, int, str, ssl.SSLContext, str]:
    """A holder process (not started) over ``tiers``; alice may read and write.
    Returns it, its port, its URI, alice's TLS context and its configuration."""
    create_dev_certificates(tmp_path / "certs", ["alice"])
    port = free_port()
    uri = f"https://127.0.0.1:{port}/kvsp/"
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {"principals": {"urn:kvstore:alice": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
        )
    )
    config = (
        SERVER.format(port=port)
        + f'[holder]\nuri = "{uri}"\npolicy = "policy.json"\n'
        + tiers
        + "map_size = 536870912\n"
    )
    certs = tmp_path / "certs"
    context = client_context(
        str(certs / "ca.pem"), str(certs / "client-alice.pem"), str(certs / "client-alice.key")
    )
    return Process(tmp_path, "holder", config, "holder"), port, uri, context, config


def body_of(n: int) -> bytes:
    """Block n, 1 MiB: regenerated from its seed, not kept (400 would weigh)."""
    rng = random.Random(n)
    return bytes(
        kc.encode(
            [(rng.randbytes(64 << 10), rng.randbytes(64 << 10)) for _ in range(8)], token_count=4
        )
    )


async def test_acknowledged_puts_survive_sigkill(tmp_path: Path) -> None:
    holder, port, uri, context, _ = holder_over(tmp_path, LMDB)
    holder.start(port)
    acknowledged: set[int] = set()
    try:
        async with HolderClient(context, timeout_s=10) as client:

            async def put(n: int) -> None:
                await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, body_of(n))
                acknowledged.add(n)

            async def writer(ns: list[int]) -> None:
                for n in ns:
                    try:
                        await put(n)
                    except Exception:
                        return  # the holder is gone

            tasks = [asyncio.create_task(writer(list(range(i, 400, 8)))) for i in range(8)]
            deadline = time.monotonic() + 30
            while len(acknowledged) < 40:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            assert holder.process is not None
            holder.process.send_signal(signal.SIGKILL)  # in the middle of PUTs
            holder.process.wait(timeout=10)
            await asyncio.gather(*tasks)
        assert 40 <= len(acknowledged) < 400
        holder.start(port)  # the same LMDB: recovered
        async with HolderClient(context, timeout_s=10) as client:
            served = 0
            for n in range(400):
                try:
                    body = await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                except KvspError as exc:
                    # Not stored: only a PUT that was never acknowledged.
                    assert n not in acknowledged, f"acknowledged block {n} lost: {exc!r}"
                    continue
                # Served means whole: Repr-Digest checked by the client, and
                # the octets are exactly what was sent.
                assert body == body_of(n), f"block {n} served altered"
                served += 1
            assert served >= len(acknowledged)
    finally:
        holder.stop()


async def test_blocks_read_after_reaching_lmdb_and_write_through_puts_survive_sigkill(
    tmp_path: Path,
) -> None:
    # Host memory (room for 3 blocks) over LMDB. A hit used to move a block
    # out of LMDB into memory, where a SIGKILL lost it; and a PUT acknowledged
    # from memory was lost too. Now LMDB keeps its copy when a block is read,
    # and with storage.write_through a 201 means "in LMDB".
    host = '[[storage.tiers]]\nbackend = "host"\ncapacity = 3500000\n'
    holder, port, uri, context, config = holder_over(tmp_path, host + LMDB)

    async def kill_and_restart() -> None:
        assert holder.process is not None
        holder.process.send_signal(signal.SIGKILL)
        holder.process.wait(timeout=10)
        holder.start(port)

    try:
        holder.start(port)
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(12):
                await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, body_of(n))
            # 0-8 reached LMDB (3 blocks of room above); read them: each
            # is copied up, and pushes others down.
            for n in range(9):
                assert await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key) == body_of(n)
        await kill_and_restart()
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(9):
                body = await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                assert body == body_of(n), f"block {n} altered"
        # write_through: every acknowledged PUT is in LMDB, however recent.
        holder.stop()
        (tmp_path / "holder.toml").write_text(
            config.replace("[holder]", "[storage]\nwrite_through = true\n[holder]")
        )
        holder.start(port)
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(100, 104):
                await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, body_of(n))
        await kill_and_restart()
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(100, 104):
                body = await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                assert body == body_of(n), f"acknowledged block {n} lost or altered"
    finally:
        holder.stop()
