"""Inclusive tiers below memory (issue 17, part): a promotion copies, so a
block that reached LMDB stays there when it is read; a demotion back down is
then free; a full tier gives up copies before the blocks only it holds; with
``write_through`` an acknowledged PUT is already in the persistent tier.
(Random interleavings, write_through on odd seeds: test_model.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import InsufficientStorage
from kvstore.storage import StoreSettings, TieredStore

from .helpers import Recorder, block, ref, size_of, stored_size
from .test_concurrency import accounting

SIZE = size_of()
PSIZE = stored_size()


async def settled(store: TieredStore, r: Any) -> bytes:
    """A read, and the promotion it starts (in the background) done."""
    data = await store.get(r)
    await store.settle()
    return data


def counting(tier: LmdbTier) -> list[str]:
    """The keys ``tier`` is asked to put from now on."""
    puts: list[str] = []
    real = tier.put

    def put(key: str, value: Any) -> Any:
        puts.append(key)
        return real(key, value)

    tier.put = put  # type: ignore[method-assign]
    return puts


async def test_a_block_read_after_reaching_lmdb_survives_a_crash(tmp_path: Path) -> None:
    # It was moved up on a read: memory-only again, lost by a SIGKILL.
    lmdb = LmdbTier(str(tmp_path / "lmdb"))
    store = TieredStore([(HostTier(), 2 * SIZE), (lmdb, 64 * SIZE)])
    data = {n: block() for n in (1, 2, 3)}
    for n, octets in data.items():
        await store.put(ref(n), octets)
    assert store.residency(ref(1))[0].tier == "local-storage"  # demoted by 3
    assert await settled(store, ref(1)) == data[1]
    assert store.residency(ref(1))[0].tier == "host"  # promoted on the hit ...
    assert await lmdb.get(ref(1).segment_key(0, 7)) is not None  # ... and still in LMDB
    assert store.stats.promotions == 1 and accounting(store)[0] == accounting(store)[1]
    # A crash: what memory held is gone, LMDB is reopened as it is.
    await lmdb.close()
    again = TieredStore([(HostTier(), 2 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 64 * SIZE)])
    await again.recover()
    assert await settled(again, ref(1)) == data[1]
    await again.close()


async def test_demoting_a_promoted_block_writes_nothing(tmp_path: Path) -> None:
    lmdb = LmdbTier(str(tmp_path / "lmdb"))
    store = TieredStore([(HostTier(), 2 * SIZE), (lmdb, 64 * SIZE)], StoreSettings(demote_above=0))
    data = {n: block() for n in (1, 2, 3, 4)}
    for n in (1, 2, 3):
        await store.put(ref(n), data[n])
    await settled(store, ref(1))  # promoted; 2 goes down to make room
    await settled(store, ref(3))  # 1 is now the least recently used in host
    puts = counting(lmdb)
    demotions = store.stats.demotions
    await store.put(ref(4), data[4])  # host makes room: 1 goes back to its copy
    assert puts == [] and store.stats.demotions == demotions + 1
    assert store.residency(ref(1))[0].tier == "local-storage"
    assert [await settled(store, ref(n)) for n in (1, 2, 3, 4)] == [data[n] for n in (1, 2, 3, 4)]
    assert accounting(store)[0] == accounting(store)[1]
    await store.close()


async def test_a_full_tier_gives_up_copies_before_blocks_it_alone_holds(tmp_path: Path) -> None:
    recorder = Recorder()
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 3 * PSIZE)],
        StoreSettings(demote_above=0),
        on_evict=recorder,
    )
    recorder.store = store
    data = {n: block() for n in (1, 2, 3, 4)}
    for n in (1, 2, 3, 4):
        await store.put(ref(n), data[n])  # host: 3, 4; LMDB: 1, 2
    await settled(store, ref(1))  # copied up; 3 goes down: LMDB 1 (copy), 2, 3
    await settled(store, ref(2))  # copied up; 4 must go down: the copy of 1 makes room
    assert store.stats.copies_dropped == 1 and recorder.calls == []
    assert [await settled(store, ref(n)) for n in (1, 2, 3, 4)] == [data[n] for n in (1, 2, 3, 4)]
    assert accounting(store)[0] == accounting(store)[1]
    assert store.slots[1].used <= store.slots[1].capacity
    await store.close()


async def test_write_through_acknowledges_what_lmdb_holds(tmp_path: Path) -> None:
    lmdb = LmdbTier(str(tmp_path / "lmdb"))
    store = TieredStore(
        [(HostTier(), 4 * SIZE), (lmdb, 64 * SIZE)], StoreSettings(write_through=True)
    )
    data = block()
    await store.put(ref(1), data)
    assert store.residency(ref(1))[0].tier == "host"  # served from memory ...
    assert await lmdb.get(ref(1).segment_key(0, 7)) is not None  # ... durable already
    assert accounting(store)[0] == accounting(store)[1]
    await lmdb.close()  # a crash right after the 201
    again = TieredStore([(HostTier(), 4 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 64 * SIZE)])
    assert await again.recover() == 1 and await settled(again, ref(1)) == data
    await again.close()


async def test_write_through_refuses_what_no_persistent_tier_takes(tmp_path: Path) -> None:
    # Acknowledged means durable: a PUT that only memory could take fails.
    store = TieredStore(
        [(HostTier(), 4 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), SIZE // 2)],
        StoreSettings(write_through=True),
    )
    with pytest.raises(InsufficientStorage, match="write_through"):
        await store.put(ref(1), block())
    assert ref(1) not in store and [s.used for s in store.slots] == [0, 0]
    await store.close()


async def test_no_promotion_runs_after_the_spill(tmp_path: Path) -> None:
    # One queued before a graceful stop used to run in close(), and making
    # room for it evicted a block the spill had kept in LMDB.
    evicted: list[Any] = []

    async def hook(r: Any, reason: str) -> None:
        evicted.append((r, reason))

    store = TieredStore(
        [(HostTier(), 2 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 2 * PSIZE)],
        StoreSettings(demote_above=0),
        on_evict=hook,
    )
    data = {n: block() for n in (1, 2, 3, 4)}
    for n in (1, 2, 3, 4):
        await store.put(ref(n), data[n])  # host: 3, 4; LMDB (full): 1, 2
    assert await store.get(ref(1)) == data[1]  # a promotion starts in the background
    await store.spill()
    await store.close()
    assert evicted == []
    again = TieredStore(
        [(HostTier(), 2 * SIZE), (LmdbTier(str(tmp_path / "lmdb")), 2 * PSIZE)],
        StoreSettings(demote_above=0),
    )
    await again.recover()
    assert ref(1) in again and ref(2) in again
    await again.close()


async def test_a_copy_in_a_down_tier_does_not_take_over(tmp_path: Path) -> None:
    # Demoting onto a copy whose tier is down made the block unreadable
    # (only in that tier) although LMDB below had room: it is written there.
    from .helpers import FlakyTier

    below = FlakyTier(LmdbTier(str(tmp_path / "a")))
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (below, 64 * SIZE), (LmdbTier(str(tmp_path / "b")), 64 * SIZE)],
        StoreSettings(write_through=True, retry_after_s=60),
    )
    data = block()
    await store.put(ref(1), data)  # host, and a copy in the first LMDB
    below.down = True
    store.slots[1].degraded_until = store.clock() + 60  # known to be down
    await store.put(ref(2), block())  # the copies go to the second LMDB now
    await store.put(ref(3), block())  # host pushes 1 down
    assert store.residency(ref(1))[0].tier == "local-storage"
    assert store.info(ref(1)).segments[0].slot == 2
    assert await store.get(ref(1)) == data
    await store.close()


async def test_recovery_keeps_a_copy_of_every_span(tmp_path: Path) -> None:
    # With a layer split, the second span's copy in a slower tier was deleted.
    first, second = LmdbTier(str(tmp_path / "a")), LmdbTier(str(tmp_path / "b"))
    store = TieredStore([(first, 64 * SIZE), (second, 64 * SIZE)], StoreSettings(fast_layers=4))
    await store.put(ref(1), block())
    # Both tiers hold both spans (a demotion and its write-through, say).
    for key in (ref(1).segment_key(0, 3), ref(1).segment_key(4, 7), ref(1).meta_key):
        for src, dst in ((first, second), (second, first)):
            value = await src.get(key)
            if value is not None and await dst.get(key) is None:
                await dst.put(key, value)
    await first.close()
    await second.close()
    first, second = LmdbTier(str(tmp_path / "a")), LmdbTier(str(tmp_path / "b"))
    again = TieredStore([(first, 64 * SIZE), (second, 64 * SIZE)], StoreSettings(fast_layers=4))
    await again.recover()
    info = again.info(ref(1))
    assert sorted((c.first, c.slot) for c in info.copies) == [(0, 1), (4, 1)]
    assert await second.get(ref(1).segment_key(4, 7)) is not None
    assert accounting(again)[0] == accounting(again)[1]
    await again.close()
