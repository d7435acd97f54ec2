"""Leases in the store (LE1-LE4): protection from eviction, quotas, expiry."""

from __future__ import annotations

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import InsufficientStorage, LeaseQuota, NotFound, PreconditionFailed
from kvstore.storage import LeaseLimits, StoreSettings, TieredStore

from .helpers import Clock, Recorder, block, ref, size_of

SIZE = size_of()


def store(capacity_blocks: int = 2, clock: Clock | None = None, **kw: object) -> TieredStore:
    return TieredStore(
        [(HostTier(), capacity_blocks * SIZE)],
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )


async def test_leased_block_is_not_evicted_put_fails_instead() -> None:
    # LE2: when the only candidates are leased, the put fails with a clear error.
    recorder = Recorder()
    s = store(2, on_evict=recorder)
    await s.put(ref(1), block())
    await s.put(ref(2), block())
    s.lease("client-a", [ref(1).block_key, ref(2).block_key], 10_000)
    with pytest.raises(InsufficientStorage, match="full"):
        await s.put(ref(3), block())
    assert ref(1) in s and ref(2) in s and ref(3) not in s
    assert recorder.calls == []


async def test_unleased_block_goes_first() -> None:
    s = store(2)
    await s.put(ref(1), block())
    await s.put(ref(2), block())
    s.lease("client-a", [ref(1).block_key], 10_000)  # 1 is LRU but leased
    await s.put(ref(3), block())
    assert ref(1) in s and ref(2) not in s and ref(3) in s


async def test_leased_block_is_not_demoted(lmdb_path: str) -> None:
    # LE2: a leased block stays where it is; the new block goes below instead.
    clock = Clock()
    s = TieredStore(
        [(HostTier(), SIZE), (LmdbTier(lmdb_path), 4 * SIZE)],
        StoreSettings(promote=False),
        clock=clock,
    )
    await s.put(ref(1), block())
    s.lease("c", [ref(1).block_key], 5000)
    await s.put(ref(2), block())
    assert s.residency(ref(1))[0].tier == "host"
    assert s.residency(ref(2))[0].tier == "local-storage"
    await s.close()


async def test_expired_lease_stops_protecting_without_a_timer() -> None:
    clock = Clock()
    s = store(1, clock)
    await s.put(ref(1), block())
    s.lease("c", [ref(1).block_key], 2000)
    with pytest.raises(InsufficientStorage):
        await s.put(ref(2), block())
    clock.now += 2.0  # exactly at expiry: no longer valid
    await s.put(ref(2), block())
    assert ref(1) not in s and ref(2) in s
    assert len(s.leases) == 0


async def test_renew_and_release() -> None:
    clock = Clock()
    s = store(1, clock)
    await s.put(ref(1), block())
    lease = s.lease("c", [ref(1).block_key], 1000)
    clock.now += 0.9
    renewed = s.renew_lease("c", lease.id, 1000)  # LE1: PUT renews
    assert renewed.id == lease.id
    clock.now += 0.9
    assert s.leases.is_leased(ref(1))
    s.release_lease("c", lease.id)  # LE1: DELETE releases
    assert not s.leases.is_leased(ref(1))
    with pytest.raises(NotFound):
        s.release_lease("c", lease.id)


async def test_another_clients_lease_looks_unknown() -> None:
    s = store(2)
    await s.put(ref(1), block())
    lease = s.lease("alice", [ref(1).block_key], 1000)
    with pytest.raises(NotFound):
        s.renew_lease("mallory", lease.id, 1000)
    with pytest.raises(NotFound):
        s.release_lease("mallory", lease.id)
    assert s.leases.is_leased(ref(1))


async def test_renewing_an_expired_lease_fails() -> None:
    clock = Clock()
    s = store(2, clock)
    await s.put(ref(1), block())
    lease = s.lease("c", [ref(1).block_key], 1000)
    clock.now += 5
    with pytest.raises(NotFound):
        s.renew_lease("c", lease.id, 1000)


async def test_quota_on_leased_octets() -> None:
    # LE3: per-client quota on leased octets -> 429 kvsp-lease-quota.
    s = store(4, lease_limits=LeaseLimits(max_octets_per_client=2 * SIZE))
    for n in (1, 2, 3):
        await s.put(ref(n), block())
    s.lease("c", [ref(1).block_key, ref(2).block_key], 1000)
    with pytest.raises(LeaseQuota) as info:
        s.lease("c", [ref(3).block_key], 1000)
    assert info.value.status == 429
    assert info.value.suffix == "kvsp-lease-quota"
    s.lease("other-client", [ref(3).block_key], 1000)  # quotas are per client
    assert s.leases.rejections == 1


async def test_quota_on_lease_ttl() -> None:
    s = store(2, lease_limits=LeaseLimits(max_ttl_ms=1000))
    await s.put(ref(1), block())
    with pytest.raises(LeaseQuota, match="TTL"):
        s.lease("c", [ref(1).block_key], 1001)
    lease = s.lease("c", [ref(1).block_key], 1000)
    with pytest.raises(LeaseQuota):
        s.renew_lease("c", lease.id, 5000)


async def test_quota_frees_when_leases_expire() -> None:
    clock = Clock()
    s = store(4, clock, lease_limits=LeaseLimits(max_octets_per_client=SIZE))
    await s.put(ref(1), block())
    await s.put(ref(2), block())
    s.lease("c", [ref(1).block_key], 1000)
    with pytest.raises(LeaseQuota):
        s.lease("c", [ref(2).block_key], 1000)
    clock.now += 1.5
    s.lease("c", [ref(2).block_key], 1000)


async def test_lease_of_unheld_keys() -> None:
    s = store(2)
    with pytest.raises(NotFound):
        s.lease("c", [ref(9).block_key], 1000)
    await s.put(ref(1), block())
    lease = s.lease("c", [ref(1).block_key, ref(9).block_key], 1000)
    assert lease.blocks == (ref(1),)  # only held blocks are leased


async def test_leased_block_cannot_be_deleted() -> None:
    s = store(2)
    await s.put(ref(1), block())
    s.lease("c", [ref(1).block_key], 1000)
    with pytest.raises(PreconditionFailed):
        await s.delete(ref(1))
