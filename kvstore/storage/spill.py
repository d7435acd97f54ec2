"""A graceful stop: what only memory tiers hold goes down to a persistent
tier (LMDB, Redis, S3) so that it outlives the process, as far as free room
and the shutdown deadline allow (``server.shutdown_grace_s``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .types import BlockRef

if TYPE_CHECKING:
    from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


async def spill(store: TieredStore, timeout_s: float = 10.0) -> int:
    """At a graceful shutdown: move what only memory tiers hold down to
    the first persistent tier below (LMDB, Redis, S3), so that it
    outlives the process, as far as room and ``timeout_s`` allow.
    Returns the number of segments moved."""
    if not any(s.tier.persistent for s in store.slots):
        return 0
    moved = 0
    try:
        async with asyncio.timeout(timeout_s), store._locked():
            # The most recently used first; into free room only: nothing
            # a persistent tier holds is evicted for them.
            order: list[tuple[BlockRef, int]] = []
            for slot in store.slots:
                if not slot.tier.persistent:
                    order += reversed(list(slot.policy.candidates()))  # type: ignore[arg-type]
            for ref, first in order:
                info = store._blocks.get(ref)
                segment = (
                    None
                    if info is None
                    else next((x for x in info.segments if x.first == first), None)
                )
                if info is None or segment is None:
                    continue
                current = segment
                while not store.slots[current.slot].tier.persistent:
                    if not await store._demote(info, current, make_room=False):
                        break
                    found = next((x for x in info.segments if x.first == current.first),
                                 None)  # fmt: skip
                    if found is None:
                        break
                    current = found
                    moved += 1
    except TimeoutError:
        log.warning("shutdown: %d segments moved to persistent tiers before the deadline",
                    moved)  # fmt: skip
    return moved
