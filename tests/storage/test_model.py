"""A randomized test against a simple model (issue 17): puts, whole and
layer-range gets (which promote), leases, deletes, retention sweeps and
capacity evictions, many at once over three tiers whose calls take random
times, so that moves, evictions and reads interleave. The model: a block is
what its last acknowledged PUT stored until the eviction hook says it left.

Checked all along: no read returns anything but an acknowledged (or
being-acknowledged) body; no leased block is evicted for room (LE2); the hook
runs while the data is still there (P3). At quiescence: every block the
model holds is in the store and reads back exactly, the store holds nothing
else, every block is RESIDENT, nothing is reserved, and each tier's used
octets equal the sum of its segments. MODEL_SEEDS=N runs N seeds (6 by default)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import InsufficientStorage, NotFound, PreconditionFailed
from kvstore.storage import BlockRef, StoreSettings, TieredStore
from kvstore.storage.state import BlockState
from kvstore.storage.tier import Tier

from .helpers import block, ref, size_of
from .test_concurrency import accounting

SIZE = size_of()
KEYS = 16


class Jitter(Tier):
    """Wraps a tier; every call first sleeps a random 0-2 ms."""

    def __init__(self, inner: Tier, rng: random.Random, kind: str | None = None) -> None:
        self.inner, self.rng = inner, rng
        self.kind = kind or inner.kind
        self.persistent = inner.persistent or kind is not None

    async def _pause(self) -> None:
        await asyncio.sleep(self.rng.random() * 0.002)

    async def get(self, key: str) -> Any:
        await self._pause()
        return await self.inner.get(key)

    async def put(self, key: str, value: Any) -> None:
        await self._pause()
        await self.inner.put(key, value)

    async def delete(self, key: str) -> None:
        await self._pause()
        await self.inner.delete(key)

    async def keys(self) -> Any:
        async for key in self.inner.keys():
            yield key

    async def close(self) -> None:
        await self.inner.close()


SEEDS = int(os.environ.get("MODEL_SEEDS", "6"))


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_random_interleavings_against_a_model(tmp_path: Path, seed: int) -> None:
    await against_the_model(tmp_path, seed, cancel=False)


@pytest.mark.parametrize("seed", range(max(1, SEEDS * 2 // 3)))
async def test_random_cancellations_leave_nothing_behind(tmp_path: Path, seed: int) -> None:
    # Clients going away: a third of the operations are cancelled at a random
    # moment. Nothing acknowledged is lost, nothing is left reserved, and no
    # tier keeps a key the store does not count (an orphan a restart adopts).
    await against_the_model(tmp_path, 100 + seed, cancel=True)


async def against_the_model(tmp_path: Path, seed: int, cancel: bool) -> None:
    rng = random.Random(seed)
    now = [1000.0]
    acked: dict[int, bytes] = {}
    writing: dict[int, list[bytes]] = {}
    problems: list[str] = []
    store: TieredStore | None = None
    by_ref = {ref(n): n for n in range(KEYS)}

    async def hook(r: BlockRef, reason: str) -> None:
        assert store is not None
        if r not in store:
            problems.append(f"hook for {r.block_key[:8]} after its data left (P3)")
        if reason not in ("capacity", "retention", "deleted"):
            problems.append(f"block {r.block_key[:8]} lost: {reason}")  # no fault here
        if reason == "capacity" and store.leases.is_leased(r):
            problems.append(f"leased block {r.block_key[:8]} evicted for room (LE2)")
        acked.pop(by_ref[r], None)
        await asyncio.sleep(rng.random() * 0.003)  # a withdrawal takes a while

    tiers = [
        (Jitter(HostTier(), rng), 3 * SIZE),
        (Jitter(LmdbTier(str(tmp_path / "lmdb")), rng), 4 * SIZE),
        (Jitter(HostTier(), rng, kind="remote-memory"), 5 * SIZE),
    ]
    store = TieredStore(
        tiers,
        StoreSettings(
            retention_s=300, fast_layers=4 if seed % 3 == 0 else 0, write_through=seed % 2 == 1
        ),
        on_evict=hook,
        wall_clock=lambda: now[0],
    )

    async def one() -> None:
        assert store is not None
        n = rng.randrange(KEYS)
        op = rng.random()
        try:
            if op < 0.35:
                octets = block()
                writing.setdefault(n, []).append(octets)
                try:
                    await store.put(ref(n), octets)
                    acked[n] = octets
                finally:
                    writing[n].remove(octets)
            elif op < 0.65:
                before = (acked.get(n), *writing.get(n, ()))
                got = await store.get(ref(n))
                if got not in (*before, acked.get(n), *writing.get(n, ())):
                    problems.append(f"block {n} read altered")
            elif op < 0.75:
                got = await store.get(ref(n), 2, 5)
                if len(got) != 20 + 16 * 4 + 2 * 256 * 4:
                    problems.append(f"block {n} layers 2-5 truncated")
            elif op < 0.87:
                lease = store.lease("c", [ref(n).block_key], 60_000)
                try:
                    await asyncio.sleep(rng.random() * 0.004)  # held while others run
                    await store.get(ref(n))  # LE2: a leased block is still here
                finally:
                    store.release_lease("c", lease.id)
            elif op < 0.95:
                await store.delete(ref(n))
            else:
                now[0] += rng.choice((1.0, 50.0))
                await store.expire()
        except (NotFound, InsufficientStorage, PreconditionFailed):
            pass

    for _ in range(25):
        tasks = [asyncio.ensure_future(one()) for _ in range(8)]
        for task in tasks:
            if cancel and rng.random() < 0.3:
                asyncio.get_running_loop().call_later(rng.random() * 0.004, task.cancel)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
        assert not errors, errors
    await store.settle()
    await store.expire()  # what a sweep skipped while it was leased or read
    assert problems == []
    # At quiescence: nothing moves any more.
    store.core.settings = dataclasses.replace(store.settings, promote=False)
    held = {by_ref[info.ref] for info in store.blocks()}
    assert held == set(acked), "the store and the model disagree on what is held"
    for n in sorted(acked):
        assert await store.get(ref(n)) == acked[n], f"block {n} altered"
    assert all(i.state is BlockState.RESIDENT for i in store.blocks())
    assert len(store.table._entries) == len(held)  # nothing left WRITING or LEAVING
    used, expected = accounting(store)
    assert used == expected
    assert all(s.used <= s.capacity for s in store.slots)
    for index, slot in enumerate(store.slots):
        counted = {
            x.key for i in store.blocks() for x in [*i.segments, *i.copies] if x.slot == index
        }
        counted |= {i.ref.meta_key for i in store.blocks() if index in i.meta_slots}
        kept = {key async for key in slot.tier.keys()}
        assert kept == counted, f"tier {index}: orphans {kept - counted}, missing {counted - kept}"
    await store.close()
