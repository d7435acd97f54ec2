"""Publishing to an Index Service (P1-P3), against a stand-in IS over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.client import IndexClient
from kvstore.holder.publisher import IndexPublisher, next_backoff
from kvstore.storage import StoreSettings, TieredStore

from ..storage.helpers import block, ref, size_of
from .stand_in_index import StandInIndex

HOLDER = "https://holder.test/kvsp/"


@pytest.fixture
async def index() -> AsyncIterator[StandInIndex]:
    stand_in = StandInIndex()
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


@pytest.fixture
async def client(index: StandInIndex) -> AsyncIterator[IndexClient]:
    async with IndexClient(index.uri, timeout_s=2) as c:
        yield c


def wire(store: TieredStore, client: IndexClient, ttl_ms: int = 60_000) -> IndexPublisher:
    # It subscribes to the store's events: stored blocks are queued, evicting
    # ones withdrawn first (P1, P3).
    return IndexPublisher(client, store, HOLDER, ttl_ms, withdraw_timeout_s=1)


async def test_new_replica_is_published(index: StandInIndex, client: IndexClient) -> None:
    # P1: PUT replicas/{holder-id}/{block_key} with the store's record.
    store = TieredStore([(HostTier(), 10 * size_of())])
    publisher = wire(store, client)
    await store.put(ref(1), block())
    assert await publisher.flush()
    assert index.records[ref(1).block_key] == store.replica_record(ref(1), HOLDER, 60_000)


async def test_records_are_refreshed_every_third_of_the_ttl(
    index: StandInIndex, client: IndexClient
) -> None:
    # P2: the same idempotent PUT, about every ttl/3.
    store = TieredStore([(HostTier(), 10 * size_of())])
    publisher = wire(store, client, ttl_ms=300)
    await store.put(ref(1), block())
    publisher.start()
    await asyncio.sleep(0.55)
    await publisher.stop()
    puts = [k for op, k in index.log if op == "PUT"]
    assert 4 <= len(puts) <= 8  # at 0, 0.1, 0.2, ... s


async def test_withdrawn_before_the_replica_leaves(
    index: StandInIndex, client: IndexClient
) -> None:
    # P3: the DELETE reaches the IS while the holder still has the block.
    store = TieredStore([(HostTier(), 2 * size_of())])
    publisher = wire(store, client)
    held_at_delete: list[bool] = []
    index.on_delete = lambda key: held_at_delete.append(ref(1) in store)
    for n in (1, 2):
        await store.put(ref(n), block())
    await publisher.flush()
    await store.put(ref(3), block())  # evicts 1
    assert held_at_delete == [True]
    assert ref(1).block_key not in index.records
    assert ref(1) not in store


async def test_index_down_then_caught_up(index: StandInIndex, client: IndexClient) -> None:
    store = TieredStore([(HostTier(), 2 * size_of())])
    publisher = wire(store, client)
    for n in (1, 2):
        await store.put(ref(n), block())
    await publisher.flush()
    await index.stop()
    await store.put(ref(3), block())  # evicts 1: its withdrawal cannot reach the IS
    assert ref(1) not in store  # serving goes on
    assert not await publisher.flush()
    assert publisher.pending == 2
    assert not publisher.index_reachable  # /readyz says so
    await index.start()
    assert await publisher.flush()
    assert publisher.index_reachable
    assert sorted(index.records) == sorted([ref(2).block_key, ref(3).block_key])
    assert publisher.stats.errors >= 2


async def test_restart_republishes_recovered_replicas(
    index: StandInIndex, client: IndexClient, lmdb_path: str
) -> None:
    store = TieredStore([(LmdbTier(lmdb_path), 10 * size_of())])
    for n in (1, 2):
        await store.put(ref(n), block())
    await store.close()
    again = TieredStore([(LmdbTier(lmdb_path), 10 * size_of())])
    await again.recover()
    publisher = wire(again, client, ttl_ms=60_000)
    publisher.start()
    for _ in range(50):
        if len(index.records) == 2:
            break
        await asyncio.sleep(0.02)
    await publisher.stop()
    assert sorted(index.records) == sorted([ref(1).block_key, ref(2).block_key])
    await again.close()


async def test_a_hanging_index_delays_evictions_once(index: StandInIndex) -> None:
    # An IS that accepts connections but never answers: the first withdrawal
    # waits out the timeout, later ones are queued at once (the store is not
    # held for seconds per eviction). Counted in calls, not in wall time.
    hang = asyncio.Event()
    asked: list[str] = []

    class Hanging(IndexClient):
        async def withdraw(self, holder: str, block_key: str) -> None:
            asked.append(block_key)
            await hang.wait()

    store = TieredStore([(HostTier(), 2 * size_of())])
    async with Hanging(index.uri, timeout_s=2) as client:
        publisher = IndexPublisher(client, store, HOLDER, 60_000, withdraw_timeout_s=0.3)
        for n in (1, 2):
            await store.put(ref(n), block())
        for n in (3, 4, 5):
            await store.put(ref(n), block())  # each evicts one
        assert asked == [ref(1).block_key]  # one timeout waited out, not three
        queued = [r for r, action in publisher._pending.items() if action == "delete"]
        assert queued == [ref(1), ref(2), ref(3)]
        assert not publisher.index_reachable
        hang.set()


async def test_shutdown_withdraws_only_what_does_not_survive(
    index: StandInIndex, client: IndexClient, lmdb_path: str
) -> None:
    # Graceful shutdown: a replica only in host memory is gone with the
    # process, so its record goes first; one in LMDB stays published (a
    # restart serves it and republishes it).
    store = TieredStore(
        [(HostTier(), size_of()), (LmdbTier(lmdb_path), 10 * size_of())],
        StoreSettings(demote_above=0),
    )
    publisher = wire(store, client)
    for n in (1, 2):  # the second pushes the first down to LMDB
        await store.put(ref(n), block())
    assert await publisher.flush() and len(index.records) == 2
    assert [r.tier for r in store.residency(ref(1))] == ["local-storage"]
    assert await publisher.withdraw_volatile() == 1
    assert sorted(index.records) == [ref(1).block_key]
    # Withdrawals queued while the IS was away are sent at shutdown too.
    await publisher.evicting(ref(1))  # (the IS answered: sent at once)
    publisher._pending[ref(2)] = "delete"
    assert await publisher.drain(2.0) and publisher.pending == 0
    await store.close()


def test_backoff_doubles_and_is_capped_at_a_third_of_the_ttl() -> None:
    # P2: after the IS failed, rounds are retried doubling from 0.5 s, but
    # never further apart than a refresh, so that records come back within
    # one once it answers; a round that went through starts over.
    waits, backoff = [], 0.5
    for _ in range(6):
        backoff = next_backoff(False, backoff, granted_ttl_ms=9000)
        waits.append(backoff)
    assert waits == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert next_backoff(True, 3.0, granted_ttl_ms=9000) == 0.5
