"""Races between reads, moves, evictions and cancellations (found in review).

Each test interleaves operations on one event loop the way concurrent HTTP
requests would, and checks that no read returns a truncated or wrong body,
no healthy block is evicted, and the accounting stays exact.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import NotFound
from kvstore.storage import LeaseLimits, StoreSettings, TieredStore

from .helpers import Recorder, block, ref, size_of


def accounting(store: TieredStore) -> tuple[list[int], list[int]]:
    """(what each tier's counter says, what the attached segments and the
    persistent copies kept below them add up to), at quiescence: nothing
    is reserved and no block is being put or removed."""
    assert [slot.reserved for slot in store.slots] == [0] * len(store.slots)
    expected = [0] * len(store.slots)
    for info in store.blocks():
        for segment in [*info.segments, *info.copies]:
            expected[segment.slot] += segment.stored_octets
    assert store.accounting() == ([s.used for s in store.slots], expected)
    return [slot.used for slot in store.slots], expected


async def test_read_outlived_by_delete_and_reput_is_refused_not_truncated() -> None:
    store = TieredStore([(HostTier(), 1 << 20)])
    await store.put(ref(1), block())
    pending = store.read(ref(1))  # e.g. a handler that already sent Content-Length
    await store.delete(ref(1))
    await store.put(ref(1), block())
    # The read belongs to the block it started on, which is gone: a miss,
    # never the new block's octets under the old one's length.
    with pytest.raises(NotFound):
        await pending.read_all()


async def test_cancelled_delete_leaves_no_block_without_data(lmdb_path: str) -> None:
    store = TieredStore(
        [(HostTier(), 1 << 20), (LmdbTier(lmdb_path), 1 << 24)], StoreSettings(fast_layers=4)
    )
    data = block()
    await store.put(ref(1), data)
    task = asyncio.create_task(store.delete(ref(1)))
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await store.settle()  # a removal that began goes on, cancelled or not
    if ref(1) in store:  # the cancel came before the eviction started
        assert await store.get(ref(1)) == data
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_promotion_racing_a_second_reader_keeps_the_block(lmdb_path: str) -> None:
    recorder = Recorder()
    seg = size_of(4)
    store = TieredStore(
        [(HostTier(), 2 * seg + 100), (LmdbTier(lmdb_path), 1 << 24)],
        StoreSettings(fast_layers=4),
        on_evict=recorder,
    )
    await store.put(ref(1), block())
    await store.put(ref(2), data := block())
    first = asyncio.create_task(store.get(ref(2)))  # promotes layers 4-7 afterwards
    claim = store.info(ref(2)).claim
    while not claim.taken:  # the promotion has begun
        await asyncio.sleep(0)
    second = store.read(ref(2)).__aiter__()
    got = [bytes(await second.__anext__()) for _ in range(2)]  # header + layers 0-3
    while claim.taken:  # ... and ended, moving layers 4-7 under the read
        await asyncio.sleep(0.01)
    got += [bytes(chunk) async for chunk in second]
    assert b"".join(got) == data
    assert await first == data
    assert ref(2) in store
    assert recorder.calls == []
    assert accounting(store)[0] == accounting(store)[1]
    await store.close()


async def test_stale_reader_cannot_drop_a_newer_copy(lmdb_path: str) -> None:
    lmdb = LmdbTier(lmdb_path)
    store = TieredStore([(HostTier(), 1 << 20), (lmdb, 1 << 24)], StoreSettings(fast_layers=4))
    data = block()
    await store.put(ref(1), data)
    stale = store.read(ref(1)).__aiter__()
    for _ in range(2):  # the header, then layers 0-3 (one view per segment)
        await stale.__anext__()
    await lmdb.delete(ref(1).segment_key(4, 7))  # a fault loses layers 4-7
    with contextlib.suppress(NotFound):
        await store.get(ref(1))
    await store.put(ref(1), data)  # offloaded again
    await store.get(ref(1))  # and promoted
    with contextlib.suppress(NotFound):
        async for _ in stale:
            pass
    assert ref(1) in store
    assert await store.get(ref(1)) == data
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_lost_block_stops_counting_against_the_lease_quota() -> None:
    size = size_of()
    store = TieredStore(
        [(HostTier(), 1 << 20)], lease_limits=LeaseLimits(max_octets_per_client=size)
    )
    await store.put(ref(1), block())
    await store.put(ref(2), block())
    store.lease("c", [ref(1).block_key], 60_000)
    store.slots[0].tier._data.clear()  # type: ignore[attr-defined]  # host loses everything
    with contextlib.suppress(NotFound):
        await store.get(ref(1))
    assert store.leases.client_octets("c") == 0
    await store.put(ref(2) if ref(2) not in store else ref(3), block())
    target = ref(2) if ref(2) in store else ref(3)
    store.lease("c", [target.block_key], 60_000)  # no false LeaseQuota


async def test_eviction_hook_may_read_the_store() -> None:
    # The hook runs with no lock held: it may read other blocks (no
    # deadlock); the block it is told about is LEAVING, a miss for new reads.
    store: TieredStore | None = None
    seen: list[tuple[object, object]] = []

    async def hook(r: object, reason: str) -> None:
        assert store is not None
        others = [x for x in (ref(1), ref(2), ref(3)) if x != r and store.serves(x)]
        try:
            mine: object = len(await store.get(r))  # type: ignore[arg-type]
        except NotFound:
            mine = "miss"
        seen.append((mine, [len(await store.get(x)) for x in others]))

    seg = size_of(4)
    store = TieredStore(
        [(HostTier(), 2 * seg + 100), (HostTier(), 1 << 20)],
        StoreSettings(fast_layers=4),
        on_evict=hook,
    )
    await store.put(ref(1), block())
    await store.put(ref(2), block())
    store.slots[1].capacity = 2 * seg + 10
    await asyncio.wait_for(store.put(ref(3), block()), 10)
    assert seen and all(mine == "miss" for mine, _ in seen)
    assert all(n == size_of() for _, others in seen for n in others)


async def test_many_concurrent_reads_and_puts_keep_exact_accounting(lmdb_path: str) -> None:
    store = TieredStore(
        [(HostTier(), 3 * size_of()), (LmdbTier(lmdb_path), 6 * size_of())],
        StoreSettings(fast_layers=4),
    )
    blocks = {n: block() for n in range(12)}

    async def worker(n: int) -> None:
        with contextlib.suppress(Exception):
            await store.put(ref(n), blocks[n])
        for m in range(n - 3, n + 1):
            with contextlib.suppress(NotFound):
                body = await store.get(ref(m))
                assert body == blocks[m]  # never a wrong or truncated body

    await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(12))), 60)
    await store.settle()  # the promotions the reads started
    used, expected = accounting(store)
    assert used == expected
    assert all(u <= s.capacity for u, s in zip(used, store.slots, strict=True))
    await store.close()
