"""Persistent tiers: encryption at rest, tamper detection, restart recovery, faults."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.backends.redis import RedisTier
from kvstore.backends.s3 import S3Tier
from kvstore.protocol import container as kc
from kvstore.protocol.problems import (
    DigestMismatch,
    InsufficientStorage,
    LayersUnavailable,
    NotFound,
)
from kvstore.protocol.records import ReplicaRecord
from kvstore.storage import SegmentSealer, StoreSettings, TieredStore
from kvstore.storage.errors import CorruptData, TierUnavailable
from kvstore.storage.records import BlockInfo
from kvstore.storage.tier import Tier

from ..conftest import S3_CREDENTIALS, RedisServer, free_port
from .helpers import FlakyTier, Recorder, block, ref, size_of, stored_size
from .tiers import make_tier

SIZE = size_of()
KEY = bytes(range(32))
PERSISTENT = ["local-storage", "remote-memory", "remote-memory-cluster", "remote-storage"]


async def flip_stored_byte(tier: Tier, key: str, offset: int = -5) -> None:
    """Corrupt one octet of a stored segment behind the store's back."""
    stored = await tier.get(key)
    assert stored is not None
    data = bytearray(stored)
    data[offset] ^= 0x01
    await tier.put(key, bytes(data))


@pytest.mark.parametrize("kind", PERSISTENT)
@pytest.mark.parametrize("encrypted", [True, False], ids=["aes-gcm", "plain"])
async def test_tampering_is_detected_not_served(
    kind: str, encrypted: bool, request: pytest.FixtureRequest
) -> None:
    # SEC4/BL8: a flipped byte fails as a decrypt or digest error, never garbage;
    # LE4: the block is withdrawn (hook first) although it is leased.
    tier = make_tier(kind, request)
    recorder = Recorder()
    store = TieredStore(
        [(tier, 10 * SIZE)],
        sealer=SegmentSealer(KEY if encrypted else None),
        on_evict=recorder,
    )
    recorder.store = store
    await store.put(ref(1), block())
    store.lease("c", [ref(1).block_key], 10_000)
    [segment] = store.info(ref(1)).segments
    await flip_stored_byte(tier, segment.key)
    with pytest.raises(DigestMismatch) as info:
        await store.get(ref(1))
    assert isinstance(info.value, CorruptData)
    assert info.value.status == 422
    assert ref(1) not in store
    assert recorder.calls and recorder.calls[0][0] == ref(1) and recorder.calls[0][2]
    assert store.stats.integrity_failures == 1
    await store.close()


async def test_encrypted_segments_hide_the_plaintext(lmdb_path: str) -> None:
    tier = LmdbTier(lmdb_path)
    store = TieredStore([(tier, 10 * SIZE)], sealer=SegmentSealer(KEY))
    data = block()
    await store.put(ref(1), data)
    [segment] = store.info(ref(1)).segments
    stored = await tier.get(segment.key)
    assert stored is not None
    layer = kc.decode(data).layer(0)
    assert bytes(layer.k)[:64] not in bytes(stored)
    assert await store.get(ref(1)) == data
    await store.close()


async def test_segment_copied_under_another_name_fails(lmdb_path: str) -> None:
    # SEC4: the block resource name is the associated data of AES-GCM.
    tier = LmdbTier(lmdb_path)
    store = TieredStore([(tier, 10 * SIZE)], sealer=SegmentSealer(KEY))
    await store.put(ref(1), block())
    await store.put(ref(2), block())
    a, b = store.info(ref(1)).segments[0], store.info(ref(2)).segments[0]
    stolen = await tier.get(a.key)
    assert stolen is not None
    await tier.put(b.key, stolen)
    with pytest.raises(CorruptData, match="authentication"):
        await store.get(ref(2))
    await store.close()


@pytest.mark.parametrize("compress", [False, True])
async def test_compression_round_trip(lmdb_path: str, compress: bool) -> None:
    tier = LmdbTier(lmdb_path)
    store = TieredStore([(tier, 10 * SIZE)], sealer=SegmentSealer(KEY, compress=compress))
    secs = [(bytes(256), bytes(256)) for _ in range(8)]  # compressible
    data = bytes(kc.encode(secs, token_count=4))
    await store.put(ref(1), data)
    [segment] = store.info(ref(1)).segments
    assert (segment.stored_octets < len(data)) == compress
    assert await store.get(ref(1)) == data
    await store.close()


@pytest.mark.parametrize("kind", PERSISTENT)
async def test_restart_finds_segments_again(kind: str, request: pytest.FixtureRequest) -> None:
    tier = make_tier(kind, request)
    store = TieredStore([(tier, 10 * SIZE)], sealer=SegmentSealer(KEY, compress=True))
    blocks = {n: block() for n in (1, 2, 3)}
    for n, data in blocks.items():
        await store.put(ref(n), data)
    records = {n: store.replica_record(ref(n), "https://h/", 1000) for n in blocks}
    options = {}
    if kind.startswith("remote-memory"):
        options["prefix"] = tier.prefix  # type: ignore[attr-defined]
    if kind == "remote-storage":
        options["bucket"] = tier.bucket  # type: ignore[attr-defined]
    await store.close()

    reopened = TieredStore(
        [(make_tier(kind, request, **options), 10 * SIZE)],
        sealer=SegmentSealer(KEY, compress=True),
    )
    assert await reopened.recover() == 3
    for n, data in blocks.items():
        assert reopened.replica_record(ref(n), "https://h/", 1000) == records[n]
        assert await reopened.get(ref(n)) == data
    assert reopened.slots[0].used == store.slots[0].used
    await reopened.close()


async def test_restart_with_a_split_block(lmdb_path: str, tmp_path: object) -> None:
    path2 = lmdb_path + "-2"
    store = TieredStore(
        [(LmdbTier(lmdb_path), 10 * SIZE), (LmdbTier(path2), 10 * SIZE)],
        StoreSettings(fast_layers=3),
        sealer=SegmentSealer(KEY),
    )
    data = block()
    await store.put(ref(1), data)
    await store.close()
    again = TieredStore(
        [(LmdbTier(lmdb_path), 10 * SIZE), (LmdbTier(path2), 10 * SIZE)], sealer=SegmentSealer(KEY)
    )
    assert await again.recover() == 1
    segments = again.info(ref(1)).segments
    assert [(s.first, s.last, s.slot) for s in segments] == [(0, 2, 0), (3, 7, 1)]
    assert await again.get(ref(1)) == data
    await again.close()


async def test_wrong_key_at_restart_keeps_the_data(lmdb_path: str) -> None:
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], sealer=SegmentSealer(KEY))
    data = block()
    await store.put(ref(1), data)
    await store.close()
    wrong = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], sealer=SegmentSealer(bytes(32)))
    assert await wrong.recover() == 0
    # The block's layer table fails; its segment, with nothing to be checked
    # against, is not even opened: both stay on disk.
    assert wrong.stats.integrity_failures == 1
    await wrong.close()
    right = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], sealer=SegmentSealer(KEY))
    assert await right.recover() == 1
    assert await right.get(ref(1)) == data
    await right.close()


async def test_redis_killed_mid_run_degrades_and_recovers(own_redis: RedisServer) -> None:
    # A real redis-server is killed and restarted (it keeps nothing on disk).
    recorder = Recorder()
    redis = RedisTier(url=own_redis.url, prefix="kill:", timeout_s=2.0)
    store = TieredStore(
        [(HostTier(), SIZE), (redis, 10 * SIZE)],
        StoreSettings(promote=False, retry_after_s=0.0, demote_above=0),
        on_evict=recorder,
    )
    recorder.store = store
    one, two = block(), block()
    await store.put(ref(1), one)
    await store.put(ref(2), two)  # 1 is demoted into Redis
    assert store.residency(ref(1))[0].tier == "remote-memory"

    own_redis.kill()
    with pytest.raises(TierUnavailable):
        await store.get(ref(1))
    assert store.snapshot().tiers[1].failures == 1
    assert await store.get(ref(2)) == two  # the host tier still serves
    assert ref(1) in store  # an unreachable tier is not data loss

    own_redis.start()  # back, but empty
    with pytest.raises(NotFound):
        await store.get(ref(1))
    assert ref(1) not in store
    assert recorder.calls[-1][0] == ref(1) and recorder.calls[-1][2]
    await store.put(ref(3), block())  # demotes 2 into the new Redis
    assert store.residency(ref(2))[0].tier == "remote-memory"
    assert await store.get(ref(2)) == two
    assert store.snapshot().tiers[1].degraded is False
    await store.close()


async def test_degraded_tier_is_skipped_for_writes_until_retry() -> None:
    lower = FlakyTier(HostTier())
    lower.persistent = False
    store = TieredStore(
        [(HostTier(), SIZE), (lower, 10 * SIZE)],
        StoreSettings(retry_after_s=3600, demote_above=0),
    )
    await store.put(ref(1), block())
    lower.down = True
    await store.put(ref(2), block())  # demoting 1 fails: 1 is evicted, 2 is placed
    assert ref(1) not in store and ref(2) in store
    assert store.snapshot().tiers[1].degraded is True
    lower.down = False  # still skipped until the retry time
    await store.put(ref(3), block())
    assert ref(2) not in store
    assert store.stats.tier_errors == 1


async def test_s3_unreachable_is_tier_unavailable() -> None:
    tier = S3Tier(
        bucket="nowhere",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        timeout_s=2.0,
        **S3_CREDENTIALS,
    )
    with pytest.raises(TierUnavailable):
        await tier.put("k" * 64 + "/x", b"data")
    store = TieredStore([(HostTier(), SIZE), (tier, 10 * SIZE)], StoreSettings(demote_above=0))
    await store.put(ref(1), block())
    await store.put(ref(2), block())  # demotion fails, 1 is evicted, no crash
    assert ref(2) in store
    assert store.snapshot().tiers[1].degraded is True
    await store.close()


async def test_lmdb_full_is_reported(lmdb_path: str) -> None:
    from kvstore.storage.errors import TierFull

    tier = LmdbTier(lmdb_path, map_size=64 * 1024)
    with pytest.raises(TierFull):
        await tier.put("f" * 64 + "/x", os.urandom(256 * 1024))
    await tier.close()


async def test_verify_reads_checks_layer_digests(lmdb_path: str) -> None:
    # verify_reads=True re-checks every layer digest, beyond the CRC/AES tag.
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], StoreSettings(verify_reads=True))
    data = block()
    await store.put(ref(1), data)
    assert await store.get(ref(1)) == data
    info = store.info(ref(1))
    [segment] = info.segments
    forged = bytearray(data)
    forged[-1] ^= 1
    with pytest.raises(CorruptData, match="layer 7"):
        info.verify_segment(segment, bytes(forged))
    await store.close()


async def test_partial_block_after_restart_keeps_every_layer_digest(lmdb_path: str) -> None:
    # Layers 0-3 lived in host memory and are gone after a restart; 4-7 come
    # back from LMDB, and the record still lists all eight layer digests (R2).
    store = TieredStore(
        [(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)],
        StoreSettings(fast_layers=4),
        sealer=SegmentSealer(KEY),
    )
    data = block()
    await store.put(ref(1), data)
    before = store.replica_record(ref(1), "https://h/", 1000)
    await store.close(spill=False)  # a crash: what host memory held is gone

    again = TieredStore(
        [(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)], sealer=SegmentSealer(KEY)
    )
    assert await again.recover() == 1
    record = ReplicaRecord.from_json(again.replica_record(ref(1), "https://h/", 1000).to_json())
    assert record.layer_digests == before.layer_digests
    assert record.digest == before.digest
    assert [(r.tier, r.first, r.last) for r in record.residency] == [("local-storage", 4, 7)]
    part = kc.decode(await again.get(ref(1)))  # what is held: layers 4-7
    part.verify([bytes.fromhex(d) for d in record.layer_digests])
    assert (part.first_layer, part.last_layer) == (4, 7)
    with pytest.raises(LayersUnavailable):
        again.read(ref(1), 0, 7)
    await again.close()


async def test_layer_tables_leave_with_their_block(lmdb_path: str) -> None:
    tier = LmdbTier(lmdb_path)
    store = TieredStore([(tier, 10 * SIZE)])
    await store.put(ref(1), block())
    assert sorted([k.rsplit("/", 1)[1] async for k in tier.keys()]) == ["0-7", "meta"]
    await store.delete(ref(1))
    assert [k async for k in tier.keys()] == []
    await store.close()


async def test_spill_moves_memory_only_blocks_down_before_a_restart(lmdb_path: str) -> None:
    # Graceful shutdown: what only host memory holds goes to LMDB, so a
    # restart serves it; nothing is lost on the way.
    store = TieredStore([(HostTier(), 10 * size_of()), (LmdbTier(lmdb_path), 10 * size_of())])
    bodies = {n: block() for n in range(3)}
    for n, body in bodies.items():
        await store.put(ref(n), body)
    assert {r.tier for n in bodies for r in store.residency(ref(n))} == {"host"}
    assert await store.spill() == 3
    assert {r.tier for n in bodies for r in store.residency(ref(n))} == {"local-storage"}
    await store.close()
    again = TieredStore([(HostTier(), 10 * size_of()), (LmdbTier(lmdb_path), 10 * size_of())])
    assert await again.recover() == 3
    for n, body in bodies.items():
        assert await again.get(ref(n)) == body
    await again.close()
    only_memory = TieredStore([(HostTier(), 10 * size_of())])
    await only_memory.put(ref(9), block())
    assert await only_memory.spill() == 0  # nowhere to go


async def test_s3_tier_can_make_its_bucket(s3_endpoint: str) -> None:
    # create_bucket (a development store: moto, MinIO): the first use makes
    # a missing bucket; an existing one is used as it is.
    import uuid

    name = f"kvstore-new-{uuid.uuid4().hex[:12]}"
    for _ in range(2):  # made, then found
        tier = S3Tier(name, endpoint_url=s3_endpoint, create_bucket=True, **S3_CREDENTIALS)
        await tier.put("k", b"v")
        assert await tier.get("k") == b"v"
        await tier.close()
    missing = S3Tier(
        f"kvstore-absent-{uuid.uuid4().hex[:12]}", endpoint_url=s3_endpoint, **S3_CREDENTIALS
    )
    with pytest.raises(TierUnavailable):
        await missing.put("k", b"v")
    await missing.close()


async def test_spill_uses_free_room_only_and_the_most_recent_first(lmdb_path: str) -> None:
    # Nothing already durable is evicted for memory-only blocks; when room is
    # short, the most recently used memory-only blocks are the ones kept.
    store = TieredStore(
        [(HostTier(), 4 * size_of()), (LmdbTier(lmdb_path), 5 * stored_size())],
        StoreSettings(demote_above=0),
    )
    for n in range(8):  # 0-3 pushed down to LMDB by 4-7
        await store.put(ref(n), block())
    durable = {n for n in range(8) if store.residency(ref(n))[0].tier == "local-storage"}
    assert durable == {0, 1, 2, 3}
    await store.get(ref(4))  # 4 is now the most recently used in host memory
    assert await store.spill() == 1  # room for one more in LMDB
    tiers = {n: store.residency(ref(n))[0].tier for n in range(8)}
    assert {n for n, t in tiers.items() if t == "local-storage"} == {0, 1, 2, 3, 4}
    assert store.stats.evictions == 0 and len(store) == 8
    await store.close()


async def test_retention_removes_old_blocks_from_every_tier_even_after_a_restart(
    lmdb_path: str,
) -> None:
    # SEC4: a retention limit removes blocks older than it from every tier,
    # withdrawing them first (the eviction hook); the age survives a restart.
    now = [1_000_000.0]
    recorder = Recorder()

    def make() -> TieredStore:
        return TieredStore(
            [(HostTier(), size_of()), (LmdbTier(lmdb_path), 10 * size_of())],
            StoreSettings(retention_s=60, demote_above=0),
            wall_clock=lambda: now[0],
            on_evict=recorder,
        )

    store = make()
    recorder.store = store
    await store.put(ref(1), block())  # in host, then pushed down to LMDB by ref(2)
    now[0] += 30
    await store.put(ref(2), block())
    now[0] += 40  # ref(1) is 70 s old, ref(2) 40 s
    assert await store.expire() == 1
    assert ref(1) not in store and ref(2) in store
    assert [(r, why) for r, why, _ in recorder.calls] == [(ref(1), "retention")]
    assert recorder.calls[0][2]  # withdrawn while still held (P3)
    # Nothing of it is left in LMDB, not even its layer table.
    assert [k async for k in store.slots[1].tier.keys()] == []  # nor its layer table
    await store.spill()
    await store.close()
    now[0] += 30  # ref(2) is now 70 s old: a restart still knows it
    again = make()
    recorder.store = again
    assert await again.recover() == 1
    assert await again.expire() == 1 and len(again) == 0
    assert again.stats.expired == 1
    await again.close()


async def test_the_retention_sweeper_runs_on_its_own() -> None:
    import asyncio

    from kvstore.storage.retention import RetentionSweeper

    now = [0.0]
    store = TieredStore(
        [(HostTier(), 4 * size_of())], StoreSettings(retention_s=10), wall_clock=lambda: now[0]
    )
    await store.put(ref(1), block())
    now[0] = 11.0
    sweeper = RetentionSweeper(store, interval_s=0.01)
    sweeper.start()
    for _ in range(100):
        if ref(1) not in store:
            break
        await asyncio.sleep(0.01)
    await sweeper.stop()
    assert ref(1) not in store and store.stats.expired == 1


def _same(tier: Tier) -> dict[str, Any]:
    """The options that open the same data again."""
    if isinstance(tier, LmdbTier):
        return {"path": tier.path}
    if isinstance(tier, RedisTier):
        return {"prefix": tier.prefix}
    assert isinstance(tier, S3Tier)
    return {"bucket": tier.bucket, "prefix": tier.prefix}


@pytest.mark.parametrize("kind", PERSISTENT)
async def test_every_persistent_tier_holds_only_ciphertext(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # Issue 9: what LMDB, Redis and S3 hold (segments and layer tables, read
    # raw from the tier) shows none of the block's octets, and the store reads
    # it back only with the key.
    tier = make_tier(kind, request)
    store = TieredStore([(tier, 10 * SIZE)], sealer=SegmentSealer(KEY))
    data = block()
    await store.put(ref(1), data)
    container = kc.decode(data)
    keys = [k async for k in tier.keys()]
    assert len(keys) >= 2  # the segment and its layer table
    for key in keys:
        stored = await tier.get(key)
        assert stored is not None
        for layer in container:
            assert bytes(layer.k)[:32] not in bytes(stored)
            assert bytes(layer.v)[:32] not in bytes(stored)
        assert b'"layers"' not in bytes(stored)  # the table is sealed too
    assert await store.get(ref(1)) == data
    await store.close()
    # Without the key, a restart finds nothing it can read (none served),
    # though the reopened tier still lists what it holds.
    reopened = make_tier(kind, request, **_same(tier))
    assert sorted([k async for k in reopened.keys()]) == sorted(keys)
    keyless = TieredStore([(reopened, 10 * SIZE)])
    assert await keyless.recover() == 0
    await keyless.close()


async def test_retention_is_not_fooled_by_the_sweep_or_a_clock_ahead(lmdb_path: str) -> None:
    # A block past the limit is not served even before a sweep; a stored time
    # from a clock ahead of ours (a restored backup) counts from our now, and
    # the rewritten table keeps that across the next restart.
    now = [1_000_000.0]

    def make() -> TieredStore:
        return TieredStore(
            [(LmdbTier(lmdb_path), 10 * size_of())],
            StoreSettings(retention_s=60),
            wall_clock=lambda: now[0],
        )

    store = make()
    await store.put(ref(1), block())
    now[0] += 61
    with pytest.raises(NotFound):
        await store.get(ref(1))  # expired, not yet swept
    await store.close()
    now[0] -= 3600 + 61  # this machine's clock is an hour behind the writer's
    again = make()
    assert await again.recover() == 1
    assert again.info(ref(1)).stored_at == now[0]  # clamped to our now
    await again.close()
    now[0] += 30
    third = make()
    await third.recover()
    assert third.info(ref(1)).stored_at == now[0] - 30  # kept, not reset again
    now[0] += 31
    assert await third.expire() == 1
    await third.close()


async def test_a_lease_never_keeps_a_block_past_the_retention_limit() -> None:
    # SEC4 over LE1: a lease never outlasts a block's retention: blocks
    # nearer their limit than the TTL asked are left out, or, if all are,
    # the TTL ends when the oldest must go (renewals too); a block already
    # past the limit is not leased.
    now = [1_000.0]
    store = TieredStore(
        [(HostTier(), 4 * size_of())], StoreSettings(retention_s=60), wall_clock=lambda: now[0]
    )
    await store.put(ref(1), block())
    now[0] += 20
    await store.put(ref(2), block())
    now[0] += 10  # ref(1) has 30 s left, ref(2) 50 s
    # Asked for longer than ref(1) has left, but not ref(2): ref(2) alone.
    partial = store.lease("c", [ref(1).block_key, ref(2).block_key], 40_000)
    assert partial.ttl_ms == 40_000 and partial.blocks == (ref(2),)
    lease = store.lease("c", [ref(1).block_key, ref(2).block_key], 60_000)
    assert lease.ttl_ms == 30_000  # neither lasts that long: both, until ref(1) goes
    assert store.lease("c", [ref(2).block_key], 10_000).ttl_ms == 10_000  # shorter: as asked
    now[0] += 25
    assert store.renew_lease("c", lease.id, 60_000).ttl_ms == 5_000
    now[0] += 6  # ref(1) is past the limit now
    with pytest.raises(NotFound):
        store.lease("c", [ref(1).block_key], 1_000)
    assert store.lease("c", [ref(1).block_key, ref(2).block_key], 60_000).ttl_ms == 19_000
    await store.close()


async def test_a_retention_sweep_lets_other_requests_in_between_batches() -> None:
    # The store lock is held for one batch at a time: a PUT that arrives while
    # a long sweep withdraws blocks (slowly, as over a network) is served
    # before the sweep ends, not after.
    import asyncio

    now = [0.0]
    done: list[str] = []

    async def slow_withdrawal(r: Any, reason: str) -> None:
        await asyncio.sleep(0.02)

    store = TieredStore(
        [(HostTier(), 12 * size_of())],
        StoreSettings(retention_s=10),
        wall_clock=lambda: now[0],
        on_evict=slow_withdrawal,
    )
    for n in range(8):
        await store.put(ref(n), block())
    now[0] = 11.0

    async def sweep() -> None:
        assert await store.expire(batch=2) == 8
        done.append("sweep")

    async def put() -> None:
        await asyncio.sleep(0.01)  # the sweep has the lock by now
        await store.put(ref(100), block())
        done.append("put")

    await asyncio.gather(sweep(), put())
    assert done == ["put", "sweep"]
    assert len(store) == 1 and store.stats.expired == 8
    await store.close()


async def test_a_put_whose_layer_table_cannot_be_stored_is_not_acknowledged(
    lmdb_path: str,
) -> None:
    # The segment goes in, then the disk has no room for the layer table: a
    # restart could not recover the block, so the PUT fails (507) and
    # leaves nothing behind, rather than being acknowledged and then lost.
    from kvstore.storage.errors import TierFull

    class NoRoomForTables(FlakyTier):
        async def put(self, key: str, value: Any) -> None:
            if key == ref(2).meta_key:
                raise TierFull("no space left on device")
            await self.inner.put(key, value)

    tier = NoRoomForTables(LmdbTier(lmdb_path))
    store = TieredStore([(tier, 10 * size_of())])
    await store.put(ref(1), block())
    with pytest.raises(InsufficientStorage, match="layer table"):
        await store.put(ref(2), block())
    assert ref(2) not in store and ref(1) in store
    await store.close()
    again = TieredStore([(LmdbTier(lmdb_path), 10 * size_of())])
    assert await again.recover() == 1 and ref(1) in again
    assert [k async for k in again.slots[0].tier.keys() if ref(2).block_key in k] == []
    await again.close()


async def test_restart_checks_segments_against_what_their_put_stored(lmdb_path: str) -> None:
    # Issue 33: recovery used to take a layer's digest from what it read. A
    # segment rewritten with a valid checksum (a copy of other data, a stale
    # version) still fails: its layers are checked against the digests the
    # block's PUT took, kept in its layer table. The restart adopts it
    # unchecked (it reads no segment); its first read checks it whole and
    # it leaves, never served.
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    await store.put(ref(1), block())
    await store.put(ref(2), two := block())
    await store.close()
    tier = LmdbTier(lmdb_path)
    other = SegmentSealer().seal(ref(1).segment_name(0, 7), block())
    await tier.put(ref(1).segment_key(0, 7), other)
    await tier.close()

    again = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    assert await again.recover() == 2
    assert again.stats.integrity_failures == 0
    with pytest.raises(CorruptData, match="fails its digest"):
        await again.get(ref(1))
    assert ref(1) not in again and await again.get(ref(2)) == two
    assert again.stats.integrity_failures == 1
    assert await again.slots[0].tier.get(ref(1).segment_key(0, 7)) is None  # dropped
    with pytest.raises(NotFound):
        await again.get(ref(1))
    await again.close()


async def test_a_restart_reads_no_segment_and_a_first_read_checks_each_once(
    lmdb_path: str,
) -> None:
    store = TieredStore([(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)])
    data = {n: block() for n in range(3)}
    for n, octets in data.items():
        await store.put(ref(n), octets)
    await store.close()  # spilled: all three in LMDB
    again = TieredStore(
        [(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)], StoreSettings(promote=False)
    )
    reads: list[str] = []
    lmdb = again.slots[1].tier
    get, get_many = lmdb.get, lmdb.get_many

    async def counted_get(key: str) -> Any:
        reads.append(key)
        return await get(key)

    async def counted_get_many(keys: Any) -> Any:
        reads.extend(keys)
        return await get_many(keys)

    lmdb.get, lmdb.get_many = counted_get, counted_get_many  # type: ignore[method-assign]
    assert await again.recover() == 3
    assert all(key.endswith("/meta") for key in reads)  # layer tables only
    assert {info.ref: info.unchecked for info in again.blocks()} == {
        ref(n): {(1, 0)} for n in range(3)
    }
    verified: list[object] = []
    check = BlockInfo.verify_segment

    def counted(info: BlockInfo, *args: Any) -> None:
        verified.append(info.ref)
        check(info, *args)

    BlockInfo.verify_segment = counted  # type: ignore[method-assign]
    try:
        for _ in range(2):
            assert {n: await again.get(ref(n)) for n in data} == data
    finally:
        BlockInfo.verify_segment = check  # type: ignore[method-assign]
    assert sorted(verified, key=str) == sorted((ref(n) for n in data), key=str)  # once each
    assert all(not info.unchecked for info in again.blocks())
    await again.close()


async def test_restart_serves_the_repr_digest_its_put_took(lmdb_path: str) -> None:
    # BL4 after a restart: the Repr-Digest comes from the layer table, as the
    # PUT took it, not from the octets read after the restart.
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    data = block()
    await store.put(ref(1), data)
    taken = store.info(ref(1)).whole_repr_digest
    await store.close()
    again = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    assert await again.recover() == 1
    assert again.read(ref(1)).known_repr_digest() == taken is not None
    await again.close()


async def test_a_segment_stored_without_its_checksum_is_not_adopted(lmdb_path: str) -> None:
    # The plain container an older kvstore stored has no checksum written
    # with it: nothing to check it against, so it is not served (dropped
    # at its first read).
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    data = block()
    await store.put(ref(1), data)
    await store.close()
    tier = LmdbTier(lmdb_path)
    await tier.put(ref(1).segment_key(0, 7), data)
    await tier.close()
    again = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)])
    assert await again.recover() == 1
    with pytest.raises(CorruptData):
        await again.get(ref(1))
    assert ref(1) not in again and again.stats.integrity_failures == 1
    await again.close()


@pytest.mark.parametrize("encrypted", [True, False], ids=["aes-gcm", "plain"])
async def test_a_flipped_layer_table_is_not_trusted(lmdb_path: str, encrypted: bool) -> None:
    sealer = SegmentSealer(KEY if encrypted else None)
    store = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], sealer=sealer)
    await store.put(ref(1), block())
    await store.close()
    tier = LmdbTier(lmdb_path)
    await flip_stored_byte(tier, ref(1).meta_key, 30)
    await tier.close()
    again = TieredStore([(LmdbTier(lmdb_path), 10 * SIZE)], sealer=sealer)
    assert await again.recover() == 0
    assert again.stats.integrity_failures == 1
    await again.close()


async def test_a_library_store_keeps_what_it_holds_across_a_restart(lmdb_path: str) -> None:
    # Issue 33: put, close(), a new store on the same directory, get -> NotFound.
    # close() now spills what only host memory holds; `async with` recovers.
    data = {n: block() for n in (1, 2)}
    async with TieredStore([(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)]) as store:
        for n, body in data.items():
            await store.put(ref(n), body)
        assert {store.residency(ref(n))[0].tier for n in data} == {"host"}
    async with TieredStore([(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)]) as again:
        assert len(again) == 2
        for n, body in data.items():
            assert await again.get(ref(n)) == body
        await again.put(ref(3), block())
        await again.close(spill=False)  # as a crash leaves it: host memory is gone
    third = TieredStore([(HostTier(), 10 * SIZE), (LmdbTier(lmdb_path), 10 * SIZE)])
    assert await third.open() == 2 and ref(3) not in third
    await third.close()


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("key", [None, KEY], ids=["crc", "aes-gcm"])
def test_every_flipped_octet_of_a_stored_segment_fails_to_open(
    key: bytes | None, compress: bool
) -> None:
    # Integrity at rest, octet by octet: the header (magic, flags, CRC or
    # nonce), the body and the tag. Never other octets, never a crash.
    sealer = SegmentSealer(key, compress=compress)
    name = ref(1).segment_name(0, 7)
    plain = block(section=16)
    stored = bytes(sealer.seal(name, plain))
    assert bytes(sealer.open(name, stored)) == plain
    for offset in range(len(stored)):
        altered = bytearray(stored)
        altered[offset] ^= 0x01
        with pytest.raises(CorruptData):
            sealer.open(name, bytes(altered))
    with pytest.raises(CorruptData):
        sealer.open(ref(2).segment_name(0, 7), stored)  # copied under another name
