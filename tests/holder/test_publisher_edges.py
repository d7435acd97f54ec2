"""The publisher at its edges: a record the IS refuses for good, a withdrawal
racing a PUT in flight, a failing round, one key held under two scopes."""

import asyncio

from kvstore.backends.host import HostTier
from kvstore.holder.publisher import IndexPublisher
from kvstore.protocol.problems import Forbidden
from kvstore.storage import BlockRef, TieredStore
from tests.storage.helpers import block, ref, size_of

HOLDER = "https://holder.test/kvsp/"


class FakeIS:
    def __init__(self):
        self.records = {}
        self.reject = set()
        self.gate = None
        self.in_put = asyncio.Event()
        self.boom = False

    async def publish(self, record):
        if self.boom:
            raise RuntimeError("unexpected")
        if record.block_key in self.reject:
            raise Forbidden("holder not trusted for this scope")  # 403: permanent
        if self.gate is not None:
            self.in_put.set()
            await self.gate.wait()
        self.records[record.block_key] = record

    async def withdraw(self, holder, key):
        self.records.pop(key, None)


def wire(store, idx, ttl_ms=60_000):
    p = IndexPublisher(idx, store, HOLDER, ttl_ms, withdraw_timeout_s=1)
    return p


async def test_one_rejected_record_blocks_all_later_updates():
    store = TieredStore([(HostTier(), 10 * size_of())])
    idx = FakeIS()
    p = wire(store, idx)
    idx.reject.add(ref(1).block_key)
    for n in (1, 2, 3):
        await store.put(ref(n), block())
    for _ in range(5):
        await p.flush()
    assert ref(2).block_key in idx.records, f"pending={p.pending}, IS has {len(idx.records)}"


async def test_withdraw_racing_inflight_publish_leaves_stale_record():
    store = TieredStore([(HostTier(), 2 * size_of())])
    idx = FakeIS()
    p = wire(store, idx)
    for n in (1, 2):
        await store.put(ref(n), block())
    idx.gate = asyncio.Event()
    flushing = asyncio.create_task(p.flush())
    await idx.in_put.wait()  # PUT of ref(1) is in flight
    await store.put(ref(3), block())  # evicts ref(1): DELETE goes out now
    assert ref(1) not in store
    idx.gate.set()  # the PUT lands after the DELETE
    await flushing
    assert await p.flush()
    assert ref(1).block_key not in idx.records, "IS still advertises an evicted replica"


async def test_background_task_dies_on_unexpected_error():
    store = TieredStore([(HostTier(), 10 * size_of())])
    idx = FakeIS()
    p = wire(store, idx, ttl_ms=300)
    idx.boom = True
    await store.put(ref(1), block())
    p.start()
    await asyncio.sleep(0.05)
    idx.boom = False
    await asyncio.sleep(0.3)
    assert not p._task.done(), f"publisher task died: {p._task.exception()!r}"
    assert ref(1).block_key in idx.records


async def test_withdraw_of_one_scope_drops_record_of_other_scope_same_key():
    store = TieredStore([(HostTier(), 2 * size_of())])
    idx = FakeIS()
    p = wire(store, idx)
    a = ref(1)
    b = BlockRef(a.compat_id, "e" * 32, a.block_key)
    await store.put(a, block())
    await store.put(b, block())
    assert await p.flush()
    await store.put(ref(9), block())  # evicts a (LRU); b still held
    assert b in store and a not in store
    assert await p.flush()
    assert a.block_key in idx.records, "holder still serves b, but its IS record is gone"
