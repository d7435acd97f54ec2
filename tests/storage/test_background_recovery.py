"""A restart that serves at once (issue 36): the store recovers in the
background and a request about a block the scan has not reached finds it
first (storage/startup.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import NotFound, PreconditionFailed
from kvstore.storage import SegmentSealer, StoreSettings, TieredStore
from kvstore.storage import startup as startup_module
from kvstore.storage.errors import StillRecovering
from kvstore.storage.tier import Tier

from .helpers import FlakyTier, block, ref, size_of, until

SIZE = size_of()
KEY = bytes(range(32))


class ScanGate(FlakyTier):
    """An LMDB tier whose batch reads from the background scan wait while
    ``gate`` is closed, and its listing while ``listing`` is (a request's
    own reads go through); ``down`` fails every call like a dead server."""

    def __init__(self, path: str) -> None:
        super().__init__(LmdbTier(path))
        self.gate = asyncio.Event()
        self.listing = asyncio.Event()
        self.listing.set()
        self.held = 0

    async def get_many(self, keys: Sequence[str]) -> list[Any]:
        self._check()
        task = asyncio.current_task()
        if task is not None and task.get_name() == "kvstore recovery":
            self.held += 1
            try:
                await self.gate.wait()
            finally:
                self.held -= 1
        return await self.inner.get_many(keys)

    async def sized_keys(self) -> AsyncIterator[tuple[str, int | None]]:
        self._check()
        await self.listing.wait()
        async for item in self.inner.sized_keys():
            yield item


async def stored(path: str, n: int) -> dict[int, bytes]:
    """``n`` blocks stored in an LMDB tier at ``path`` by a store now closed."""
    blocks = {i: block() for i in range(1, n + 1)}
    store = TieredStore([(LmdbTier(path), 20 * SIZE)], sealer=SegmentSealer(KEY))
    await store.open()
    for i, data in blocks.items():
        await store.put(ref(i), data)
    await store.close()
    return blocks


def reopened(tier: Tier, settings: StoreSettings | None = None) -> TieredStore:
    settings = settings or StoreSettings()
    return TieredStore(
        [(HostTier(), 20 * SIZE), (tier, 20 * SIZE)], settings, sealer=SegmentSealer(KEY)
    )


@pytest.fixture
def one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan reads one block a batch, so that a held scan holds one."""
    monkeypatch.setattr(startup_module, "META_BATCH", 1)


def first_listed(numbers: Iterable[int]) -> int:
    """The block the scan reaches first (LMDB lists keys in order)."""
    return min(numbers, key=lambda i: ref(i).block_key)


@pytest.mark.usefixtures("one_at_a_time")
async def test_open_in_background_serves_blocks_the_scan_has_not_reached(lmdb_path: str) -> None:
    blocks = await stored(lmdb_path, 4)
    tier = ScanGate(lmdb_path)
    store = reopened(tier)
    assert await store.open(background=True) == 0  # back before the scan
    await until(lambda: tier.held == 1)
    assert store.recovering
    progress = store.recovery_progress()
    assert (progress.phase, progress.listed, progress.adopted) == ("scanning", 4, 0)
    held_back = first_listed(blocks)  # the scan waits on this one
    others = [i for i in blocks if i != held_back]

    # A GET of a block not reached yet finds it on demand, whole and checked.
    assert await store.get(ref(others[0])) == blocks[others[0]]
    assert ref(others[0]) in store and ref(others[1]) not in store
    # A lease names block keys: it finds them too.
    await store.find_keys([ref(others[1]).block_key])
    lease = store.lease("client", [ref(others[1]).block_key], 1000)
    assert lease.blocks == (ref(others[1]),)
    # BL7: a PUT of a stored block not reached yet is a 412, the old copy
    # stays; a new block's PUT does not wait for the scan.
    with pytest.raises(PreconditionFailed):
        await store.put(ref(others[2]), block())
    assert await store.get(ref(others[2])) == blocks[others[2]]
    new = block()
    await store.put(ref(99), new)
    # A request about the block whose batch the scan is reading waits for it.
    waiting = asyncio.ensure_future(store.get(ref(held_back)))
    await asyncio.sleep(0)
    assert not waiting.done() and tier.held == 1

    tier.gate.set()
    await store.recovered()
    assert await waiting == blocks[held_back]
    assert not store.recovering
    progress = store.recovery_progress()
    assert (progress.phase, progress.listed, progress.adopted) == ("done", 4, 4)
    assert len(store) == 5 and await store.get(ref(99)) == new
    used, expected = store.accounting()
    assert used == expected
    await store.close()


@pytest.mark.usefixtures("one_at_a_time")
async def test_each_recovered_block_is_told_once_it_serves(lmdb_path: str) -> None:
    # P1: the holder's publisher republishes what the scan adopts, as it goes.
    blocks = await stored(lmdb_path, 3)
    tier = ScanGate(lmdb_path)
    store = reopened(tier)
    told: list[Any] = []

    class Listener:
        def stored(self, r: Any) -> None:
            told.append((r, store.serves(r)))

        async def evicting(self, r: Any, reason: str) -> None:
            pass

    store.events.subscribe(Listener())
    tier.gate.set()
    await store.open(background=True)
    await store.recovered()
    assert sorted(told, key=str) == sorted(((ref(i), True) for i in blocks), key=str)
    await store.close()


async def test_a_tier_down_at_start_is_retried_and_requests_are_told(lmdb_path: str) -> None:
    blocks = await stored(lmdb_path, 2)
    tier = ScanGate(lmdb_path)
    tier.gate.set()
    tier.down = True
    store = reopened(tier, StoreSettings(retry_after_s=0.0))
    await store.open(background=True)
    await until(lambda: store.recovery_progress().phase == "retrying")
    assert "injected failure" in (store.recovery_progress().error or "")
    # Whether the block is stored cannot be told: a miss for a GET (P4), a
    # 503 for a PUT (BL7 needs to know), and no purge that would leave some.
    with pytest.raises(NotFound):
        await store.get(ref(1))
    with pytest.raises(StillRecovering):
        await store.put(ref(1), block())
    with pytest.raises(StillRecovering):
        await store.purge(ref(1).scope_id)
    tier.down = False
    await asyncio.wait_for(store.recovered(), 5)
    assert {i: await store.get(ref(i)) for i in blocks} == blocks
    await store.close()


async def test_the_library_default_recovers_before_open_returns(lmdb_path: str) -> None:
    blocks = await stored(lmdb_path, 3)
    store = reopened(LmdbTier(lmdb_path))
    assert await store.open() == 3
    assert not store.recovering and store.recovery_progress().phase == "done"
    assert {i: await store.get(ref(i)) for i in blocks} == blocks
    await store.close()


@pytest.mark.usefixtures("one_at_a_time")
async def test_close_during_the_scan_stops_it(lmdb_path: str) -> None:
    await stored(lmdb_path, 2)
    tier = ScanGate(lmdb_path)
    store = reopened(tier)
    await store.open(background=True)
    await until(lambda: tier.held == 1)
    await asyncio.wait_for(store.close(), 5)
    assert tier.held == 0
    # What the scan did not reach is still on disk for the next start.
    again = reopened(LmdbTier(lmdb_path))
    assert await again.open() == 2
    await again.close()


async def test_before_the_listing_a_block_is_found_where_a_put_puts_it(
    lmdb_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A large tier's listing takes seconds: a request does not wait for it
    # when the block's segments are under the layer ranges a PUT gives them.
    lower = lmdb_path + "-2"
    split = StoreSettings(fast_layers=3)
    blocks = {n: block() for n in (1, 2, 3)}
    first = TieredStore(
        [(LmdbTier(lmdb_path), 20 * SIZE), (LmdbTier(lower), 20 * SIZE)],
        split,
        sealer=SegmentSealer(KEY),
    )
    await first.open()
    await first.put(ref(1), blocks[1])  # layers 0-2 above, 3-7 below
    await first.close()
    for n, settings in ((2, StoreSettings()), (3, StoreSettings(fast_layers=5))):
        other = TieredStore(
            [(LmdbTier(lmdb_path), 20 * SIZE), (LmdbTier(lower), 20 * SIZE)],
            settings,
            sealer=SegmentSealer(KEY),
        )
        await other.open()
        await other.put(ref(n), blocks[n])
        await other.close()

    tier = ScanGate(lmdb_path)
    tier.listing.clear()
    tier.gate.set()
    store = TieredStore(
        [(tier, 20 * SIZE), (LmdbTier(lower), 20 * SIZE)], split, sealer=SegmentSealer(KEY)
    )
    await store.open(background=True)
    assert store.recovery_progress().phase == "listing"
    assert await store.get(ref(1)) == blocks[1]  # split as this store puts it
    segments = store.info(ref(1)).segments
    assert [(s.first, s.last, s.slot) for s in segments] == [(0, 2, 0), (3, 7, 1)]
    assert await store.get(ref(2)) == blocks[2]  # whole
    # Split at 5 by an earlier configuration: found once the listing is.
    waiting = asyncio.ensure_future(store.get(ref(3)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    tier.listing.set()
    assert await asyncio.wait_for(waiting, 5) == blocks[3]
    await store.recovered()
    assert len(store) == 3 and store.recovery_progress().adopted == 3
    used, expected = store.accounting()
    assert used == expected
    await store.close()


async def test_a_listing_that_takes_too_long_is_a_miss_not_a_wait(
    lmdb_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup_module, "FIND_WAIT_S", 0.05)
    lower = lmdb_path + "-2"
    blocks = {n: block() for n in (1, 2)}
    earlier = TieredStore(
        [(LmdbTier(lmdb_path), 20 * SIZE), (LmdbTier(lower), 20 * SIZE)],
        StoreSettings(fast_layers=5),
        sealer=SegmentSealer(KEY),
    )
    await earlier.open()
    for n, data in blocks.items():
        await earlier.put(ref(n), data)
    await earlier.close()
    tier = ScanGate(lmdb_path)
    tier.listing.clear()
    tier.gate.set()
    # No split now: the probe cannot find them.
    store = TieredStore(
        [(tier, 20 * SIZE), (LmdbTier(lower), 20 * SIZE)], sealer=SegmentSealer(KEY)
    )
    await store.open(background=True)
    with pytest.raises(NotFound):
        await store.get(ref(1))
    with pytest.raises(StillRecovering):
        await store.put(ref(2), block())
    tier.listing.set()
    await store.recovered()
    assert {n: await store.get(ref(n)) for n in blocks} == blocks
    await store.close()
