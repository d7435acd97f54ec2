"""``host`` tier: process memory. Reads return the stored octets, no copy.

Blocks live in an :class:`~kvstore.storage.arena.Arena` sized to the tier's
capacity plus headroom for bodies still arriving: memory the process touched
once and reuses, so storing a block does not wait on the kernel faulting in
fresh pages (docs/holder.md). ``prefault = true`` touches it all at start
(``MAP_POPULATE``: about 0.25 s a GiB here, and the tier's whole capacity is
resident from then on); by default pages fault in on first use and stay. A
block that finds no room in the arena (fragmentation, or extents still held
by GETs of blocks since evicted) is kept in ordinary memory instead.
``arena = false``: always ordinary memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

from kvstore.protocol._bytes import BytesLike
from kvstore.storage.arena import Arena
from kvstore.storage.tier import Tier

log = logging.getLogger("kvstore.storage")

#: Arena beyond the tier's capacity: bodies being received into extents
#: before they are placed, and extents of evicted blocks a GET still streams.
HEADROOM_FRACTION = 8
HEADROOM_MIN = 32 << 20


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # not known: not a reason to refuse


class HostTier(Tier):
    kind = "host"

    def __init__(
        self,
        read_mbit_per_s: float | None = None,
        arena: bool = True,
        prefault: bool = False,
        workers: int = 1,
    ) -> None:
        """``workers``: how many holder processes of this machine each hold
        such a tier (``[server] workers`` sets it on each worker's share):
        the prefault guard weighs all their arenas, not one."""
        if not isinstance(arena, bool) or not isinstance(prefault, bool):
            raise ValueError("host tier: arena and prefault are true or false")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError("host tier: workers is a positive integer")
        self._data: dict[str, BytesLike] = {}
        self.read_mbit_per_s = read_mbit_per_s
        self._use_arena, self._prefault, self._workers = arena, prefault, workers
        self.arena: Arena | None = None
        #: Blocks kept in ordinary memory for want of an extent (metrics).
        self.fallbacks = 0

    def provision(self, capacity: int) -> None:
        if not self._use_arena or self.arena is not None or capacity <= 0:
            return
        size = capacity + max(capacity // HEADROOM_FRACTION, HEADROOM_MIN)
        prefault = self._prefault
        if prefault and size * self._workers > 0.9 * _physical_memory():
            # Touching all of it would page out everything else, or bring
            # the OOM killer: pages fault in as they are used instead. With
            # workers, every one prefaults an arena of this size.
            log.warning(
                "host tier: not prefaulting %d arena(s) of %d octets, more than 0.9 of "
                "this machine's memory; lower the tier's capacity",
                self._workers,
                size,
            )
            prefault = False
        try:
            self.arena = Arena(size, prefault=prefault)
        except (OSError, OverflowError, ValueError) as exc:
            log.warning("host tier: no arena of %d octets (%s); using ordinary memory", size, exc)

    def arena_figures(self) -> tuple[int, int, int] | None:
        arena = self.arena
        return None if arena is None else (arena.size, arena.used, self.fallbacks)

    def buffer(self, size: int) -> memoryview | None:
        return None if self.arena is None else self.arena.alloc(size)

    async def get(self, key: str) -> BytesLike | None:
        return self._data.get(key)

    async def put(self, key: str, value: BytesLike) -> None:
        arena = self.arena
        if arena is None or isinstance(value, bytes):
            # Bytes are immutable and in memory already: kept as they are (a
            # copy into the arena would cost more). A mutable buffer is copied.
            self._data[key] = value if isinstance(value, bytes) else bytes(value)
            return
        view = memoryview(value)
        if arena.owns(view):  # received into an extent of ours: kept as it is
            self._data[key] = view.toreadonly()
            return
        if not view.nbytes or not view.c_contiguous:
            self._data[key] = view.tobytes()  # nothing to place, or not one run of octets
            return
        extent = arena.alloc(view.nbytes)
        if extent is None:
            self.fallbacks += 1
            self._data[key] = value if isinstance(value, bytes) else bytes(value)
            return
        extent[:] = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._data[key] = extent.toreadonly()

    async def delete(self, key: str) -> None:
        # The extent returns to the arena once no GET still streams a view of it.
        self._data.pop(key, None)

    async def keys(self) -> AsyncIterator[str]:
        for key in list(self._data):
            yield key
