"""The retention limit (SEC4): blocks older than ``storage.retention_s`` leave
every tier, their records withdrawn first (the store's eviction hook)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..background import Background
from .types import BlockRef

if TYPE_CHECKING:
    from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


class RetentionSweeper(Background):
    task_name = "kvstore-retention"

    def __init__(self, store: TieredStore, interval_s: float | None = None) -> None:
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


async def expire(store: TieredStore, batch: int = 32) -> int:
    """Remove every block stored more than ``retention_s`` ago, from every
    tier, withdrawing it first (the eviction hook, P3); a leased one goes
    once its lease ends (LE2). Returns how many went.

    Each block is removed on its own (its claim, not a store-wide lock),
    so a sweep of many blocks, each withdrawn from the IS, holds up no PUT
    or GET; ``batch`` blocks go between two yields to the event loop."""
    if not store.retention_s:
        return 0
    cutoff = store.wall_clock() - store.retention_s
    due = [i for i in store.blocks() if i.stored_at < cutoff]
    gone = 0
    for start in range(0, len(due), batch):
        for info in due[start : start + batch]:
            # Re-checked once claimed: replaced, deleted or leased since.
            if await store.placement.evict(info, "retention", unless_pinned=True):
                gone += 1
        await asyncio.sleep(0)
    if gone:
        log.info("retention: %d blocks older than %.0f s removed", gone, store.retention_s)
    return gone


def retention_ttl(store: TieredStore, ttl_ms: int, refs: Iterable[BlockRef]) -> int:
    """A lease never keeps a block past the retention limit (SEC4): the
    granted TTL (LE1) ends when the oldest leased block must go. Once
    that is now, the lease is granted for 0 ms: it protects nothing."""
    if not store.retention_s:
        return ttl_ms
    infos = [store.table.entry(r) for r in refs]
    stored = [i.stored_at for i in infos if i is not None]
    if not stored:
        return ttl_ms
    left_ms = int((min(stored) + store.retention_s - store.wall_clock()) * 1000)
    return max(0, min(ttl_ms, left_ms))


def lease_terms(
    store: TieredStore, held: list[tuple[BlockRef, int]], ttl_ms: int
) -> tuple[list[tuple[BlockRef, int]], int]:
    """What a new lease covers, and for how long (LE1 under SEC4): the
    blocks whose retention outlasts the TTL asked, for that TTL; a block
    nearer its limit is left out (the grant's ``block_keys`` say so) rather
    than cut every other block's protection short. If none outlasts it,
    all of them, until the oldest must go."""
    if not store.retention_s:
        return held, ttl_ms
    end = store.wall_clock() + ttl_ms / 1000
    lasting = [(r, size) for r, size in held if store.info(r).stored_at + store.retention_s >= end]
    if lasting:
        return lasting, ttl_ms
    return held, retention_ttl(store, ttl_ms, [r for r, _ in held])
