"""Every tier call has a deadline (issue 17, part): a hung tier below does
not hold up a PUT or a read for longer than its deadline, it is degraded so
that the next calls skip it at once, and it is used again once it answers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.storage import StoreSettings, TieredStore
from kvstore.storage.errors import TierUnavailable

from .helpers import block, ref, size_of

SIZE = size_of()


class Hanging(HostTier):
    """A persistent-looking tier that stops answering while ``hung`` is set."""

    kind = "remote-memory"
    persistent = True
    deadline_s = 0.3

    def __init__(self) -> None:
        super().__init__()
        self.hung = False
        self.calls = 0

    async def _wait(self) -> None:
        self.calls += 1
        if self.hung:
            await asyncio.Event().wait()  # never answers

    async def get(self, key: str) -> Any:
        await self._wait()
        return await super().get(key)

    async def put(self, key: str, value: Any) -> None:
        await self._wait()
        await super().put(key, value)

    async def put_many(self, items: Any) -> None:
        await self._wait()  # one call, as a backend's native batch (a pipeline)
        for key, value in items:
            await HostTier.put(self, key, value)


async def test_a_hung_tier_costs_at_most_its_deadline_then_is_skipped() -> None:
    below = Hanging()
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (below, 64 * SIZE)],
        StoreSettings(retry_after_s=60, demote_above=0),
    )
    data = {n: block() for n in range(4)}
    for n in (0, 1, 2):
        await store.put(ref(n), data[n])  # 0 goes below
    assert store.residency(ref(0))[0].tier == "remote-memory"
    below.hung = True
    started = time.monotonic()
    with pytest.raises(TierUnavailable, match="deadline"):
        await store.get(ref(0))  # only the hung tier has it: a 503, not a hang
    assert time.monotonic() - started < 5
    assert store.snapshot().tiers[1].degraded
    # A PUT that would demote into it: the tier is skipped at once (degraded),
    # the PUT goes on, and host memory reads go on.
    calls = below.calls
    async with asyncio.timeout(5):
        await store.put(ref(3), data[3])
        assert await store.get(ref(2)) == data[2]
    assert below.calls == calls  # not even tried: no request waits on it again
    below.hung = False
    store.retry_after_s = 0  # its retry time is over
    for slot in store.slots:
        slot.degraded_until = min(slot.degraded_until, store.clock())
    assert await store.get(ref(0)) == data[0]  # answered again: used again
    assert not store.snapshot().tiers[1].degraded
    await store.settle()


async def test_a_write_into_a_hung_tier_ends_within_the_deadline() -> None:
    below = Hanging()
    store = TieredStore([(HostTier(), SIZE // 2), (below, 64 * SIZE)])  # host too small
    below.hung = True
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        await store.put(ref(1), block())
    assert time.monotonic() - started < 5 and info.value.status in (503, 507)
    assert ref(1) not in store


def test_deadlines_are_configured_per_tier(tmp_path: Any) -> None:
    from kvstore.build import build_store
    from kvstore.config import check, load

    file = tmp_path / "k.toml"
    file.write_text(
        '[[storage.tiers]]\nbackend = "host"\ncapacity = 4096\n'
        '[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 1048576\npath = "lmdb"\n'
        "map_size = 2097152\ndeadline_s = 1.5\n"
    )
    store = build_store(load(file))
    assert [s.tier.deadline_s for s in store.slots] == [None, 1.5]
    file.write_text(file.read_text().replace("deadline_s = 1.5", "deadline_s = 0"))
    problems = check(load(file), ("holder",))
    assert any(p.startswith("storage.tiers[1].deadline_s:") for p in problems), problems


async def test_one_request_waits_out_a_hung_tier_once() -> None:
    # Degraded after its first missed deadline, the tier was still read and
    # deleted from (and written to) within the same PUT: four deadlines.
    below = Hanging()
    store = TieredStore(
        [(HostTier(), 2 * SIZE), (below, 3 * SIZE)],
        StoreSettings(retry_after_s=60, demote_above=0),
    )
    for n in range(5):
        await store.put(ref(n), block())  # host: 3, 4; below (full): 0, 1, 2
    below.hung = True
    calls = below.calls
    async with asyncio.timeout(5):
        await store.put(ref(5), block())  # room in host: only by evicting, below is down
    assert below.calls - calls <= 1
    assert ref(5) in store
    await store.close()
