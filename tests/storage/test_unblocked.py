"""No store-wide lock across tier I/O (issue 17): what one request waits on
below (a tier that hangs, an IS withdrawal that hangs) holds up no unrelated
PUT or GET; two PUTs of one key are one 201 and one 412, whatever their
timing; eviction is LEAVING (no new reads, withdrawn first), then GONE.

Each scenario would hang on a store that keeps one lock across its tier calls;
``asyncio.timeout`` bounds them so that such a store fails, not hangs."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from kvstore.backends import create_tier
from kvstore.backends.host import HostTier
from kvstore.protocol.problems import (
    InsufficientStorage,
    NotFound,
    PreconditionFailed,
)
from kvstore.storage import BlockRef, StoreSettings, TieredStore

from ..conftest import RedisServer
from .helpers import GatedTier, block, cancelled, ref, size_of, until
from .test_concurrency import accounting

SIZE = size_of()


class Withdrawals:
    """An on_evict hook whose withdrawal of ``hang`` blocks never answers
    until ``release``d (an IS that accepts and stalls)."""

    def __init__(self, store: TieredStore | None = None) -> None:
        self.store = store
        self.hang: set[BlockRef] = set()
        self.release = asyncio.Event()
        self.calls: list[tuple[BlockRef, str, bool]] = []

    async def __call__(self, r: BlockRef, reason: str) -> None:
        assert self.store is not None
        self.calls.append((r, reason, r in self.store))  # P3: the data is still there
        if r in self.hang:
            await self.release.wait()


async def test_a_put_and_a_read_go_on_while_a_withdrawal_hangs() -> None:
    hook = Withdrawals()
    store = TieredStore([(HostTier(), 2 * SIZE)], on_evict=hook)
    hook.store = store
    data = {n: block() for n in (1, 2, 3, 4)}
    await store.put(ref(1), data[1])
    await store.put(ref(2), data[2])
    hook.hang.add(ref(1))
    evicting = asyncio.create_task(store.put(ref(3), data[3]))  # evicts 1: hangs
    await until(lambda: hook.calls)
    async with asyncio.timeout(2):
        assert await store.get(ref(2)) == data[2]
        await store.put(ref(4), data[4])  # evicts 2 (1 is leaving): not held up
    assert [(r, reason) for r, reason, _ in hook.calls] == [
        (ref(1), "capacity"),
        (ref(2), "capacity"),
    ]
    # LEAVING: still held (the data is there until the withdrawal is over),
    # but neither served nor leasable.
    assert ref(1) in store and not store.serves(ref(1))
    with pytest.raises(NotFound):
        await store.get(ref(1))
    with pytest.raises(NotFound):
        store.lease("c", [ref(1).block_key], 1000)
    assert not evicting.done()
    hook.release.set()
    await asyncio.wait_for(evicting, 2)
    assert ref(1) not in store and await store.get(ref(3)) == data[3]
    assert all(held for _, _, held in hook.calls)  # P3: withdrawn before it left
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_a_delete_and_a_retention_sweep_hang_alone() -> None:
    now = [1000.0]
    hook = Withdrawals()
    store = TieredStore(
        [(HostTier(), 8 * SIZE)],
        StoreSettings(retention_s=60),
        on_evict=hook,
        wall_clock=lambda: now[0],
    )
    hook.store = store
    for n in (1, 2):
        await store.put(ref(n), block())
    now[0] += 30
    await store.put(ref(3), block())
    hook.hang.add(ref(1))
    deleting = asyncio.create_task(store.delete(ref(1)))
    await until(lambda: hook.calls)
    now[0] += 40  # 2 is past the limit now, 3 is not
    async with asyncio.timeout(2):
        assert await store.expire() == 1  # 2 goes; 1 is leaving already
        await store.put(ref(4), block())
        assert await store.get(ref(3))
    assert ref(2) not in store and not deleting.done()
    hook.release.set()
    await asyncio.wait_for(deleting, 2)
    assert ref(1) not in store and len(store) == 2
    await store.close()


async def test_a_put_and_a_hot_get_go_on_while_the_tier_below_hangs() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 2 * SIZE), (below, 64 * SIZE)])
    data = {n: block() for n in (1, 2, 3, 4)}
    await store.put(ref(1), data[1])
    await store.put(ref(2), data[2])
    below.gate.clear()
    demoting = asyncio.create_task(store.put(ref(3), data[3]))  # demotes 1: hangs below
    await until(lambda: below.waiting)
    store.slots[0].capacity = 4 * SIZE  # room for 4 without touching the tier below
    async with asyncio.timeout(2):
        assert await store.get(ref(2)) == data[2]
        await store.put(ref(4), data[4])
        assert await store.get(ref(1)) == data[1]  # still served from host meanwhile
    assert not demoting.done()
    below.gate.set()
    await asyncio.wait_for(demoting, 2)
    assert {n: await store.get(ref(n)) for n in data} == data
    await store.settle()
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_redis_stopped_below_holds_up_nothing_in_host(own_redis: RedisServer) -> None:
    # A real Redis, SIGSTOPped: a demotion into it waits out its deadline,
    # unrelated work in host goes on meanwhile.
    redis = create_tier("redis", url=own_redis.url, prefix="stop:")
    redis.deadline_s = 3
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (redis, 64 * SIZE)],
        StoreSettings(retry_after_s=60, demote_above=0),
    )
    data = {n: block() for n in (1, 2, 3, 4)}
    await store.put(ref(1), data[1])
    await store.put(ref(2), data[2])
    assert own_redis.process is not None
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    try:
        demoting = asyncio.create_task(store.put(ref(3), data[3]))  # 1 goes to Redis
        await asyncio.sleep(0.2)
        store.slots[0].capacity = 4 * SIZE
        async with asyncio.timeout(2):  # less than Redis's deadline
            assert await store.get(ref(2)) == data[2]
            await store.put(ref(4), data[4])
        assert not demoting.done()
        # Past the deadline Redis is degraded and 1 stays in host: the
        # room the PUT wanted came free meanwhile (nothing is evicted for it).
        await asyncio.wait_for(demoting, 10)
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    assert store.snapshot().tiers[1].degraded and store.stats.evictions == 0
    assert {n: await store.get(ref(n)) for n in data} == data
    await store.close()


async def test_two_puts_of_one_key_are_one_201_and_one_412() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(below, 64 * SIZE)])
    below.gate.clear()  # the first PUT is still writing when the second comes
    first = asyncio.create_task(store.put(ref(1), a := block()))
    await until(lambda: below.waiting)
    others = [asyncio.create_task(store.put(ref(1), block())) for _ in range(7)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in others)  # waiting for the first to settle
    below.gate.set()
    results = await asyncio.gather(first, *others, return_exceptions=True)
    assert not isinstance(results[0], BaseException)
    assert all(isinstance(r, PreconditionFailed) for r in results[1:])
    assert await store.get(ref(1)) == a
    await store.close()


async def test_a_put_waiting_on_a_failed_one_stores_its_own() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(below, 64 * SIZE)], StoreSettings(retry_after_s=0))
    below.gate.clear()
    below.failures = 1  # the first is refused; the second's write goes in
    first = asyncio.create_task(store.put(ref(1), block()))
    await until(lambda: below.waiting)
    second = asyncio.create_task(store.put(ref(1), b := block()))
    await asyncio.sleep(0.01)
    below.gate.set()
    with pytest.raises(InsufficientStorage):
        await first
    await asyncio.wait_for(second, 2)
    assert await store.get(ref(1)) == b
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_a_cancelled_put_leaves_nothing_reserved() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 2 * SIZE), (below, 64 * SIZE)], StoreSettings(demote_above=0))
    for n in (1, 2):
        await store.put(ref(n), block())
    below.gate.clear()
    task = asyncio.create_task(store.put(ref(3), block()))  # demoting 1, waits below
    await until(lambda: below.waiting)
    await cancelled(task)
    below.gate.set()
    assert ref(3) not in store and ref(1) in store and ref(2) in store
    assert [s.reserved for s in store.slots] == [0, 0]
    used, expected = accounting(store)
    assert used == expected
    await store.close()


async def test_a_removal_deletes_each_tiers_keys_in_one_batch(lmdb_path: str) -> None:
    from kvstore.backends.lmdb import LmdbTier

    lmdb = LmdbTier(lmdb_path)
    batches: list[list[str]] = []
    real = lmdb.delete_many

    async def delete_many(keys: Any) -> None:
        batches.append(sorted(keys))
        await real(keys)

    lmdb.delete_many = delete_many  # type: ignore[method-assign]
    store = TieredStore([(HostTier(), 64 * SIZE), (lmdb, 64 * SIZE)], StoreSettings(fast_layers=4))
    await store.put(ref(1), block())  # layers 0-3 in host; 4-7 and the table in LMDB
    await store.delete(ref(1))
    r = ref(1)
    assert batches == [sorted([r.segment_key(4, 7), r.meta_key])]
    assert await lmdb.get(r.segment_key(4, 7)) is None and await lmdb.get(r.meta_key) is None
    await store.close()
