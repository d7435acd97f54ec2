"""What /metrics reads of a store: each scope's usage (kept as blocks come
and go, found again at a restart) and each tier's call latency by operation."""

from __future__ import annotations

import hashlib

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.storage import BlockRef, TieredStore

from .helpers import COMPAT, block, size_of

TENANTS = [hashlib.sha256(name).hexdigest()[:32] for name in (b"a", b"b")]
KV = 8 * 2 * 256  # block(): 8 layers of K and V, 256 octets each


def ref_in(scope: str, n: int) -> BlockRef:
    return BlockRef(COMPAT, scope, hashlib.sha256(f"{scope} {n}".encode()).hexdigest())


async def test_scope_usage_follows_blocks_and_survives_a_restart(lmdb_path: str) -> None:
    a, b = TENANTS
    store = TieredStore([(HostTier(), 3 * size_of()), (LmdbTier(lmdb_path), 100 * size_of())])
    await store.open()
    for n in range(3):
        await store.put(ref_in(a, n), block())
    for n in range(2):
        await store.put(ref_in(b, n), block())
    assert store.snapshot().scopes == {a: (3, 3 * KV), b: (2, 2 * KV)}
    await store.delete(ref_in(a, 0))
    assert store.snapshot().scopes == {a: (2, 2 * KV), b: (2, 2 * KV)}
    # Demotions to LMDB (host holds 3) move blocks, they do not count twice.
    assert sum(t.used > 0 for t in store.snapshot().tiers) == 2
    lmdb = store.snapshot().tiers[1].latency
    assert lmdb["write"][0][-1][1] > 0  # calls made, the +Inf bucket counts them
    await store.close()
    again = TieredStore([(HostTier(), 3 * size_of()), (LmdbTier(lmdb_path), 100 * size_of())])
    await again.open()  # adopted from LMDB: the same usage
    assert again.snapshot().scopes == {a: (2, 2 * KV), b: (2, 2 * KV)}
    reads = again.snapshot().tiers[1].latency["read"]
    await again.get(ref_in(b, 1))
    after = again.snapshot().tiers[1].latency["read"]
    assert after[0][-1][1] == reads[0][-1][1] + 1 and after[1] > reads[1]
    await again.close()
