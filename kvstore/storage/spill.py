"""A graceful stop: what only memory tiers hold goes down to a persistent
tier (LMDB, Redis, S3) so that it outlives the process, as far as free room
and the shutdown deadline allow (``server.shutdown_grace_s``)."""

from __future__ import annotations

import asyncio
import logging

from .core import StoreCore
from .placement import Demotion, Placement
from .records import BlockInfo
from .types import BlockRef

log = logging.getLogger("kvstore.storage")


async def spill(core: StoreCore, placement: Placement, timeout_s: float = 10.0) -> int:
    """At a graceful shutdown: move what only memory tiers hold down to
    the first persistent tier below (LMDB, Redis, S3), so that it
    outlives the process, as far as room and ``timeout_s`` allow.
    Returns the number of segments moved."""
    if not any(s.tier.persistent for s in core.slots):
        return 0
    moved = 0
    try:
        async with asyncio.timeout(timeout_s):
            # The most recently used first; into free room only: nothing
            # a persistent tier holds is evicted for them.
            order: list[tuple[BlockRef, int]] = []
            for slot in core.slots:
                if not slot.tier.persistent:
                    order += reversed(list(slot.policy.candidates()))  # type: ignore[arg-type]
            for ref, first in order:
                info = core.table.serving(ref)
                if info is None:
                    continue
                await info.claim.take()
                try:
                    moved += await _down(core, placement, info, first)
                finally:
                    info.claim.give()
    except TimeoutError:
        log.warning("shutdown: %d segments moved to persistent tiers before the deadline", moved)
    return moved


async def _down(core: StoreCore, placement: Placement, info: BlockInfo, first: int) -> int:
    """Demote the segment of ``info`` at layer ``first`` until a persistent
    tier has it (the caller holds the block's claim); the steps taken."""
    steps = 0
    if not core.table.current(info):
        return 0  # gone while we waited for it
    current = next((x for x in info.segments if x.first == first), None)
    while current is not None and not core.slots[current.slot].tier.persistent:
        moved = await placement.demote(info, current, make_room=False, pinned_ok=True)
        if moved is not Demotion.LEFT:
            break
        current = next((x for x in info.segments if x.first == first), None)
        steps += 1
    return steps
