"""A holder restarted over a full LMDB tier serves at once (issue 36): a real
process, its store recovering in the background; a GET of a block the scan
has not reached is served whole, and ``/readyz`` tells how far the scan is
until it is done."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvstore.backends.lmdb import LmdbTier
from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.storage import BlockRef, TieredStore

from ..storage.helpers import COMPAT, SCOPE
from .test_holder_crash import LMDB, holder_over

BLOCKS = 3000


def key(n: int) -> str:
    return hashlib.sha256(b"restart %d" % n).hexdigest()


def body(n: int) -> bytes:
    sections = [(hashlib.sha256(b"k%d.%d" % (n, i)).digest() * 32,) * 2 for i in range(4)]
    return bytes(kc.encode(sections, token_count=4))


async def readyz(port: int, context: Any) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"https://127.0.0.1:{port}/readyz", ssl=context) as response,
    ):
        assert response.status == 200  # recovering, it serves: ready
        found: dict[str, Any] = await response.json()
        return found


async def test_a_restarted_holder_serves_blocks_the_scan_has_not_reached(tmp_path: Path) -> None:
    holder, port, uri, context, _ = holder_over(tmp_path, LMDB)
    # What a holder left in its LMDB directory (no key: checksummed segments).
    store = TieredStore([(LmdbTier(str(tmp_path / "lmdb"), map_size=512 << 20), 256 << 20)])
    await store.open()
    for n in range(BLOCKS):
        await store.put(BlockRef(COMPAT, SCOPE, key(n)), body(n))
    await store.close()
    last = max(range(BLOCKS), key=key)  # the block the scan reaches last

    holder.start(port)
    try:
        async with HolderClient(context, timeout_s=10) as client:
            # Served whole (the client checks Repr-Digest) from its first
            # answer on, found on demand if the scan is not there yet.
            assert await client.get_block(uri, COMPAT, SCOPE, key(last)) == body(last)
            assert await client.get_block(uri, COMPAT, SCOPE, key(7)) == body(7)
            deadline = time.monotonic() + 60
            while (ready := await readyz(port, context))["recovery"]["phase"] != "done":
                assert ready["recovery"]["phase"] in ("listing", "scanning"), ready
                assert time.monotonic() < deadline, ready
                await asyncio.sleep(0.05)
            recovery = ready["recovery"]
            assert (recovery["listed"], recovery["adopted"]) == (BLOCKS, BLOCKS), recovery
            for n in (0, BLOCKS // 2, BLOCKS - 1):
                assert await client.get_block(uri, COMPAT, SCOPE, key(n)) == body(n)
    finally:
        holder.stop()
