"""The tiered store: placement, reads by layer range, demotion, promotion, eviction."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol import container as kc
from kvstore.protocol.problems import (
    InsufficientStorage,
    LayersUnavailable,
    MalformedContainer,
    NotFound,
    PreconditionFailed,
)
from kvstore.protocol.records import ReplicaRecord
from kvstore.protocol.wire import parse_repr_digest
from kvstore.storage import StoreSettings, TieredStore
from kvstore.storage.policy import FIFO

from ..conftest import TEST_DEVICE
from .helpers import Recorder, block, ref, size_of, stored_size

SIZE = size_of()


def host_store(capacity_blocks: float = 10, **kw: object) -> TieredStore:
    return TieredStore([(HostTier(), int(capacity_blocks * SIZE))], **kw)  # type: ignore[arg-type]


async def test_put_then_get_whole_and_layer_ranges() -> None:
    # BL1, BL2: the whole block, and a layer range assembled from segments.
    store = host_store()
    data = block()
    await store.put(ref(1), data)
    assert await store.get(ref(1)) == data
    part = kc.decode(await store.get(ref(1), 4, 7))
    whole = kc.decode(data)
    assert (part.first_layer, part.last_layer) == (4, 7)
    assert [bytes(x.k) for x in part] == [bytes(whole.layer(i).k) for i in range(4, 8)]


async def test_unknown_block_and_unheld_layers() -> None:
    store = host_store()
    await store.put(ref(1), block(layers=4))
    with pytest.raises(NotFound):
        store.read(ref(2))
    with pytest.raises(LayersUnavailable) as info:
        store.read(ref(1), 2, 9)  # BL2: 404 kvsp-layers-unavailable
    assert info.value.status == 404


async def test_existing_replica_is_kept(tmp_path: object) -> None:
    # BL7: a second PUT of a held key is refused (412) and the old copy stays.
    store = host_store()
    first = block()
    await store.put(ref(1), first)
    with pytest.raises(PreconditionFailed):
        await store.put(ref(1), block())
    assert await store.get(ref(1)) == first


async def test_malformed_put_stores_nothing() -> None:
    store = host_store()
    data = block()
    with pytest.raises(MalformedContainer):
        await store.put(ref(1), data[:-1])
    with pytest.raises(MalformedContainer):
        await store.put(ref(1), bytes(kc.encode([], token_count=4)))
    assert ref(1) not in store
    assert store.slots[0].used == 0


async def test_replica_record_describes_the_block() -> None:
    # R2, B3: layer digests and replica digest of what is held; residency per tier.
    store = host_store()
    data = block()
    await store.put(ref(1), data)
    record = store.replica_record(ref(1), "https://h1.example/kvsp/", 60000)
    again = ReplicaRecord.from_json(record.to_json())  # validates digest vs layer_digests
    digests = kc.decode(data).layer_digests()
    assert again.layer_digests == tuple(d.hex() for d in digests)
    assert again.size == len(data)
    assert [(r.tier, r.first, r.last) for r in again.residency] == [("host", 0, 7)]


async def test_repr_digest_of_whole_and_partial_reads() -> None:
    # BL4: the digest of exactly the octets sent; whole reads keep theirs.
    store = host_store()
    data = block()
    await store.put(ref(1), data)
    read = store.read(ref(1))
    assert parse_repr_digest(await read.repr_digest()) == hashlib.sha256(data).digest()
    assert store.info(ref(1)).whole_repr_digest is not None
    partial = store.read(ref(1), 2, 3)
    body = await partial.read_all()
    assert parse_repr_digest(await partial.repr_digest()) == hashlib.sha256(body).digest()
    assert len(partial) == len(body)


async def test_split_keeps_first_layers_in_the_faster_tier(lmdb_path: str) -> None:
    # The draft's device 0-15 / host 16-31 split, here host 0-3 / LMDB 4-7.
    store = TieredStore(
        [(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)],
        StoreSettings(fast_layers=4, promote=False),
    )
    data = block()
    await store.put(ref(1), data)
    assert [(r.tier, r.first, r.last) for r in store.residency(ref(1))] == [
        ("host", 0, 3),
        ("local-storage", 4, 7),
    ]
    assert await store.get(ref(1)) == data  # assembled across two tiers
    assert await store.get(ref(1), 3, 4) == (await store.read(ref(1), 3, 4).read_all())
    await store.close()


async def test_lru_demotes_least_recently_used(lmdb_path: str) -> None:
    recorder = Recorder()
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)],
        StoreSettings(promote=False, demote_above=0),
        on_evict=recorder,
    )
    for n in (1, 2):
        await store.put(ref(n), block())
    await store.get(ref(1))  # 2 is now least recently used
    await store.put(ref(3), block())
    tiers = {n: store.residency(ref(n))[0].tier for n in (1, 2, 3)}
    assert tiers == {1: "host", 2: "local-storage", 3: "host"}
    assert recorder.calls == []  # demotion keeps the block at the holder
    assert store.stats.demotions == 1
    await store.close()


async def test_fifo_policy_ignores_reads(lmdb_path: str) -> None:
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)],
        StoreSettings(promote=False),
        policy=FIFO,
    )
    for n in (1, 2):
        await store.put(ref(n), block())
    await store.get(ref(1))
    await store.put(ref(3), block())
    assert store.residency(ref(1))[0].tier == "local-storage"
    await store.close()


async def test_last_tier_evicts_and_notifies_first() -> None:
    # P3: the hook runs while the block is still held.
    recorder = Recorder()
    store = host_store(2, on_evict=recorder)
    recorder.store = store
    for n in (1, 2, 3):
        await store.put(ref(n), block())
    assert ref(1) not in store
    assert recorder.calls == [(ref(1), "capacity", True)]
    assert store.stats.evictions == 1
    assert store.slots[0].used == 2 * SIZE


async def test_demotion_chain_skips_to_the_end(lmdb_path: str, redis_server: object) -> None:
    from kvstore.backends.redis import RedisTier

    redis = RedisTier(url=redis_server.url, prefix="chain:")  # type: ignore[attr-defined]
    store = TieredStore(
        [(HostTier(), SIZE), (LmdbTier(lmdb_path), 2 * stored_size()), (redis, 10 * SIZE)],
        StoreSettings(promote=False, demote_above=0),
    )
    for n in range(1, 5):
        await store.put(ref(n), block())
    tiers = [store.residency(ref(n))[0].tier for n in range(1, 5)]
    assert tiers == ["remote-memory", "local-storage", "local-storage", "host"]
    for n in range(1, 5):
        assert kc.decode(await store.get(ref(n))).token_count == 4
    await redis.delete_many([s.key for i in store.blocks() for s in i.segments])
    await store.close()


async def test_promotion_on_hit(lmdb_path: str) -> None:
    store = TieredStore([(HostTier(), 2 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)])
    for n in (1, 2, 3):
        await store.put(ref(n), block())
    assert store.residency(ref(1))[0].tier == "local-storage"
    data = await store.get(ref(1))
    assert kc.decode(data).layer_digests() == store.info(ref(1)).layer_digests
    await store.settle()  # promotions run in the background, after the read
    assert store.residency(ref(1))[0].tier == "host"
    assert store.stats.promotions == 1
    assert store.slots[0].used <= store.slots[0].capacity
    await store.close()


async def test_block_larger_than_a_tier_goes_below(lmdb_path: str) -> None:
    store = TieredStore([(HostTier(), SIZE // 2), (LmdbTier(lmdb_path), 10 * SIZE)])
    await store.put(ref(1), block())
    assert store.residency(ref(1))[0].tier == "local-storage"
    await store.close()


async def test_write_that_fits_nowhere_fails_loudly() -> None:
    store = host_store(0.5)
    with pytest.raises(InsufficientStorage) as info:
        await store.put(ref(1), block())
    assert info.value.status == 507
    assert ref(1) not in store


async def test_delete() -> None:
    recorder = Recorder()
    store = host_store(on_evict=recorder)
    await store.put(ref(1), block())
    await store.delete(ref(1))
    assert ref(1) not in store
    assert recorder.calls[0][1] == "deleted"
    with pytest.raises(NotFound):
        await store.delete(ref(1))


async def test_health_reports_usage() -> None:
    store = host_store(4)
    await store.put(ref(1), block())
    [tier] = store.snapshot().tiers
    assert tier.kind == "host"
    assert tier.used == SIZE
    assert tier.degraded is False


async def test_device_tier_in_the_store() -> None:
    # The draft's split: first layers in accelerator memory (KVSTORE_TEST_DEVICE,
    # cpu by default), the rest in host.
    from kvstore.backends.device import DeviceTier

    device = DeviceTier(TEST_DEVICE)
    store = TieredStore(
        [(device, 10 * SIZE), (HostTier(), 10 * SIZE)],
        StoreSettings(fast_layers=4, promote=False),
    )
    data = block()
    await store.put(ref(1), data)
    assert [(r.tier, r.first, r.last) for r in store.residency(ref(1))] == [
        ("device", 0, 3),
        ("host", 4, 7),
    ]
    [first, _] = store.info(ref(1)).segments
    tensor = device.tensor(first.key)
    assert tensor is not None and tensor.device.type == device.device.type
    assert device.device.type == TEST_DEVICE.split(":")[0]
    assert await store.get(ref(1)) == data


async def test_read_rates_are_measured_when_not_configured(lmdb_path: str) -> None:
    # PL1 inputs: each tier reports the rate it can be read at.
    host, lmdb = HostTier(read_mbit_per_s=400000.0), LmdbTier(lmdb_path)
    store = TieredStore(
        [(host, 10 * SIZE), (lmdb, 10 * SIZE)], StoreSettings(fast_layers=4, promote=False)
    )
    await store.measure_read_rates(probe_octets=256 * 1024, rounds=2)
    assert host.read_mbit_per_s == 400000.0  # configured: kept
    assert lmdb.read_mbit_per_s is not None and lmdb.read_mbit_per_s > 0
    assert [k async for k in lmdb.keys()] == []  # the probe is gone
    await store.put(ref(1), block())
    rates = [r.read_mbit_per_s for r in store.residency(ref(1))]
    assert rates == [400000.0, lmdb.read_mbit_per_s]
    await store.close()
