"""Promotion is background work (issue 17, part): a read is over once its
bytes are out, whatever copying it up then costs; promotions are bounded
(a hit beyond the bound is not promoted, never waited for); a block's
whole Repr-Digest is taken at PUT time, so no GET reads a segment for it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.wire import repr_digest
from kvstore.storage import StoreSettings, TieredStore

from .helpers import GatedTier, block, ref, size_of

SIZE = size_of()


async def stored_below(
    tmp_path: Path, blocks: int
) -> tuple[TieredStore, GatedTier, dict[int, bytes]]:
    host = GatedTier()
    # Promotions alone: no background drain moving what they bring up.
    store = TieredStore(
        [(host, 2 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 64 * SIZE)],
        StoreSettings(demote_above=0),
    )
    data = {n: block() for n in range(blocks)}
    for n, octets in data.items():
        await store.put(ref(n), octets)
    return store, host, data


async def test_a_read_ends_before_its_promotion(tmp_path: Path) -> None:
    store, host, data = await stored_below(tmp_path, 3)
    assert store.residency(ref(0))[0].tier == "local-storage"
    host.gate.clear()  # copying up will hang ...
    async with asyncio.timeout(5):
        assert await store.get(ref(0)) == data[0]  # ... the read does not
    async with asyncio.timeout(5):
        while not host.waiting:  # the promotion makes room, then waits on the write
            await asyncio.sleep(0.01)
    assert store.stats.promotions == 0  # under way, behind the read
    assert await store.get(ref(1)) == data[1]  # and other reads go on
    host.gate.set()
    await store.settle()
    assert store.stats.promotions >= 1 and store.residency(ref(0))[0].tier == "host"
    await store.close()


async def test_promotions_are_bounded_and_dropped_not_waited_for(tmp_path: Path) -> None:
    blocks = TieredStore.MAX_PROMOTIONS + 4
    store, host, data = await stored_below(tmp_path, blocks)
    store.slots[0].capacity = 64 * SIZE  # room for all: only the bound stops them
    host.gate.clear()
    async with asyncio.timeout(5):
        for n in range(blocks - 2):  # all below: each hit would promote
            assert await store.get(ref(n)) == data[n]
    assert store.placement.moves.running == TieredStore.MAX_PROMOTIONS
    assert store.stats.promotions_dropped == blocks - 2 - TieredStore.MAX_PROMOTIONS
    host.gate.set()
    await store.settle()
    assert not store.placement.moves.running
    assert [await store.get(ref(n)) for n in range(blocks)] == [data[n] for n in range(blocks)]
    await store.close()  # cancels what the last reads started


async def test_the_whole_digest_is_taken_at_put_and_reads_nothing(tmp_path: Path) -> None:
    store, _, data = await stored_below(tmp_path, 3)
    loads: list[object] = []
    original = store.loader.load

    async def counted(*args: Any) -> Any:
        loads.append(args)
        return await original(*args)

    store.loader.load = counted  # type: ignore[method-assign]
    for n in range(3):
        read = store.read(ref(n))
        assert read.known_repr_digest() == repr_digest(data[n])  # what a GET sends
    assert loads == []
    # A range not served before: digest and octets from one read of its segment.
    digest, chunks = await store.read(ref(0), 2, 5).buffered()
    assert len(loads) == 1 and digest == repr_digest(*chunks)
    assert store.read(ref(0), 2, 5).known_repr_digest() == digest
    await store.close()


async def test_a_full_tier_drains_in_the_background(tmp_path: Path) -> None:
    # demote_above: past half full, host moves its least recently used blocks
    # down by itself; the PUTs meanwhile find room and wait for none of it.
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore(
        [(HostTier(), 10 * SIZE), (below, 64 * SIZE)], StoreSettings(demote_above=0.5)
    )
    below.gate.clear()  # the demotions hang below ...
    for n in range(6):
        await store.put(ref(n), block())  # past half full: a drain starts
    async with asyncio.timeout(5):
        while not below.waiting:  # it has begun, and waits below
            await asyncio.sleep(0.005)
    async with asyncio.timeout(2):
        for n in range(6, 9):
            await store.put(ref(n), block())  # ... the PUTs do not
    # One drain at a time: one segment and its layer table (a batch) wait.
    assert below.waiting == 2 and store.stats.demotions == 0
    below.gate.set()
    await store.settle()
    assert store.slots[0].used <= 0.45 * store.slots[0].capacity  # drained to 0.9 of 0.5
    assert store.stats.demotions == 5 and len(store) == 9
    assert [r.tier for r in store.residency(ref(0))] == ["local-storage"]  # LRU first
    await store.close()


def test_demote_above_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="demote_above"):
        TieredStore([(HostTier(), SIZE)], StoreSettings(demote_above=1.5))
