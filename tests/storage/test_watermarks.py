"""Upper tiers keep headroom on their own (issue 36, tails): high and low
watermarks, drained in the background, on by default; a PUT that still
finds its tier full is written to the tier below instead of waiting for a
demotion's tier I/O."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.backends.host import HostTier
from kvstore.storage import StoreSettings, TieredStore

from .helpers import GatedTier, block, ref, size_of, until

SIZE = size_of()


def where(store: TieredStore, n: int) -> list[str]:
    return [r.tier for r in store.residency(ref(n))]


async def test_watermarks_are_on_by_default_and_drain_to_the_low_one() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 10 * SIZE), (below, 64 * SIZE)])
    assert (store.settings.high_watermark, store.settings.low_watermark) == (
        0.9,
        pytest.approx(0.81),
    )
    for n in range(9):  # 9 of 10: not above 0.9, nothing moves
        await store.put(ref(n), block())
    await store.settle()
    assert store.stats.demotions == 0
    await store.put(ref(9), block())  # full: the drain starts
    await store.settle()
    host = store.slots[0]
    assert host.used <= 0.81 * host.capacity < host.used + SIZE  # no further than that
    assert store.stats.demotions == 2 and store.stats.puts_fell_through == 0
    assert where(store, 0) == where(store, 1) == ["local-storage"]  # LRU first
    assert where(store, 2) == ["host"]
    await store.close()


async def test_a_put_goes_below_instead_of_waiting_for_a_slow_drain() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 4 * SIZE), (below, 64 * SIZE)], StoreSettings(promote=False))
    # The drain's write of block 0 (the LRU) hangs below; others go in.
    below.gated = lambda key: key.startswith(ref(0).block_key)
    below.gate.clear()
    for n in range(4):
        await store.put(ref(n), block())
    await until(lambda: below.waiting)  # host full, its drain under way
    async with asyncio.timeout(2):  # not the drain's time (it never ends here)
        await store.put(ref(4), late := block())
    assert where(store, 4) == ["local-storage"]  # acknowledged as that tier's copy
    assert store.stats.puts_fell_through == 1 and store.stats.demotions == 0
    assert await store.get(ref(4)) == late
    below.gate.set()
    await store.settle()
    assert store.stats.demotions == 1 and where(store, 0) == ["local-storage"]
    used, expected = store.accounting()
    assert used == expected
    await store.close()


async def test_a_put_goes_below_when_the_drain_can_move_nothing() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 2 * SIZE + SIZE // 4), (below, 64 * SIZE)])
    data = {n: block() for n in range(4)}
    for n in range(2):  # under the high watermark: no drain
        await store.put(ref(n), data[n])
    store.lease("engine", [ref(n).block_key for n in range(2)], 60_000)
    for n in (2, 3):
        await store.put(ref(n), data[n])
    await store.settle()
    # Leased blocks never move (LE2): host keeps what it had, the PUTs below.
    assert where(store, 0) == where(store, 1) == ["host"]
    assert where(store, 2) == where(store, 3) == ["local-storage"]
    assert store.stats.puts_fell_through == 2 and store.stats.demotions == 0
    assert {n: await store.get(ref(n)) for n in range(4)} == data
    await store.close()


async def test_off_a_put_moves_a_victim_down_itself() -> None:
    below = GatedTier("local-storage", persistent=True)
    store = TieredStore([(HostTier(), 2 * SIZE), (below, 64 * SIZE)], StoreSettings(demote_above=0))
    for n in range(3):
        await store.put(ref(n), block())
    assert where(store, 0) == ["local-storage"] and where(store, 2) == ["host"]
    assert store.stats.demotions == 1 and store.stats.puts_fell_through == 0
    await store.close()


async def test_the_last_tier_has_no_drain_a_put_evicts_there() -> None:
    store = TieredStore([(HostTier(), 2 * SIZE)])
    for n in range(4):
        await store.put(ref(n), block())
    assert len(store) == 2 and store.stats.evictions == 2
    assert store.stats.puts_fell_through == 0
    await store.close()


@pytest.mark.parametrize(("above", "to"), [(0.9, 0.95), (0.9, 0.9), (None, 0.5), (0.9, -0.1)])
def test_the_low_watermark_is_below_the_high_one(above: float | None, to: float) -> None:
    with pytest.raises(ValueError, match="demote_to"):
        TieredStore([(HostTier(), SIZE)], StoreSettings(demote_above=above or 0, demote_to=to))
