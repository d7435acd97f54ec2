"""The retention limit (SEC4): blocks older than ``storage.retention_s`` leave
every tier, their records withdrawn first (the store's eviction hook)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from ..background import Background
from .core import StoreCore
from .placement import Placement
from .types import BlockRef

log = logging.getLogger("kvstore.storage")


class Expiring(Protocol):
    """What a sweep sweeps (a :class:`.TieredStore`)."""

    @property
    def retention_s(self) -> float | None: ...

    async def expire(self) -> int: ...


class RetentionSweeper(Background):
    task_name = "kvstore-retention"

    def __init__(self, store: Expiring, interval_s: float | None = None) -> None:
        """Sweeps at once (what a restart recovered may be past the limit),
        then every tenth of the limit, between 1 s and a minute."""
        self.store = store
        limit = store.retention_s or 60.0
        self.interval_s = interval_s or max(1.0, min(60.0, limit / 10))

    async def run(self) -> None:
        while True:
            try:
                await self.store.expire()
            except Exception:
                log.exception("retention sweep failed; retrying")
            await asyncio.sleep(self.interval_s)


async def expire(core: StoreCore, placement: Placement, batch: int = 32) -> int:
    """Remove every block stored more than ``retention_s`` ago, from every
    tier, withdrawing it first (the eviction hook, P3); a leased one goes
    once its lease ends (LE2). Returns how many went.

    Each block is removed on its own (its claim, not a store-wide lock),
    so a sweep of many blocks, each withdrawn from the IS, holds up no PUT
    or GET; ``batch`` blocks go between two yields to the event loop."""
    limit = core.settings.retention_s
    if not limit:
        return 0
    cutoff = core.wall_clock() - limit
    due = [i for i in core.table if i.stored_at < cutoff]
    gone = 0
    for start in range(0, len(due), batch):
        for info in due[start : start + batch]:
            # Re-checked once claimed: replaced, deleted or leased since.
            if await placement.evict(info, "retention", unless_pinned=True):
                gone += 1
        await asyncio.sleep(0)
    if gone:
        log.info("retention: %d blocks older than %.0f s removed", gone, limit)
    return gone


def retention_ttl(core: StoreCore, ttl_ms: int, refs: Iterable[BlockRef]) -> int:
    """A lease never keeps a block past the retention limit (SEC4): the
    granted TTL (LE1) ends when the oldest leased block must go. Once
    that is now, the lease is granted for 0 ms: it protects nothing."""
    limit = core.settings.retention_s
    if not limit:
        return ttl_ms
    infos = [core.table.entry(r) for r in refs]
    stored = [i.stored_at for i in infos if i is not None]
    if not stored:
        return ttl_ms
    left_ms = int((min(stored) + limit - core.wall_clock()) * 1000)
    return max(0, min(ttl_ms, left_ms))


def lease_terms(
    core: StoreCore, held: list[tuple[BlockRef, int]], ttl_ms: int
) -> tuple[list[tuple[BlockRef, int]], int]:
    """What a new lease covers, and for how long (LE1 under SEC4): the
    blocks whose retention outlasts the TTL asked, for that TTL; a block
    nearer its limit is left out (the grant's ``block_keys`` say so) rather
    than cut every other block's protection short. If none outlasts it,
    all of them, until the oldest must go."""
    limit = core.settings.retention_s
    if not limit:
        return held, ttl_ms
    end = core.wall_clock() + ttl_ms / 1000
    stored = {r: info.stored_at for r, _ in held if (info := core.table.entry(r)) is not None}
    lasting = [(r, size) for r, size in held if stored.get(r, 0.0) + limit >= end]
    if lasting:
        return lasting, ttl_ms
    return held, retention_ttl(core, ttl_ms, [r for r, _ in held])
