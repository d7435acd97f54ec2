"""What the store tells others about its blocks, and what it shows of itself.

Two events, so that nothing outside the store has to hook into it (STYLE 15):

* **stored**: a block was stored (a PUT was acknowledged, or a prefetch or a
  session put one in). A listener must not block the PUT: it is a plain call,
  made once the block serves; the holder's publisher queues a record (P1).
* **evicting**: a block is leaving (capacity, retention, a tier fault). It is
  awaited before the block's data goes, so a listener may withdraw it from
  the Index Service first (P3, LE4); a listener that raises is logged and the
  block still goes.

:class:`StoreSnapshot` is the typed view of the store that ``/metrics`` and
``/readyz`` read, rather than its internals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .types import BlockRef

log = logging.getLogger("kvstore.storage")


class StoreListener(Protocol):
    """Hears of blocks stored and leaving (subscribe with :meth:`StoreEvents.subscribe`)."""

    def stored(self, ref: BlockRef) -> None:
        """``ref`` was stored and serves."""

    async def evicting(self, ref: BlockRef, reason: str) -> None:
        """``ref`` is about to leave (its data is still there): ``capacity``,
        ``retention`` or a tier fault."""


EvictHook = Callable[[BlockRef, str], Awaitable[None]]


class OnEvict:
    """A listener from one eviction hook (``TieredStore(on_evict=...)``)."""

    __slots__ = ("hook",)

    def __init__(self, hook: EvictHook) -> None:
        self.hook = hook

    def stored(self, ref: BlockRef) -> None:
        pass

    async def evicting(self, ref: BlockRef, reason: str) -> None:
        await self.hook(ref, reason)


class StoreEvents:
    """The store's listeners, told in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[StoreListener] = []

    def subscribe(self, listener: StoreListener) -> Callable[[], None]:
        """Add ``listener``; returns the call that removes it again."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def stored(self, ref: BlockRef) -> None:
        for listener in tuple(self._listeners):
            try:
                listener.stored(ref)
            except Exception:
                # The block is stored and acknowledged whatever a listener does.
                log.exception("a listener failed on stored %s", ref.block_key)

    async def evicting(self, ref: BlockRef, reason: str) -> None:
        for listener in tuple(self._listeners):
            try:
                await listener.evicting(ref, reason)  # P3: withdrawn before it goes
            except Exception:
                log.exception("a listener failed on evicting %s", ref.block_key)


@dataclass(frozen=True, slots=True)
class RecoveryProgress:
    """How far a recovery is (``/readyz``, metrics, logs)."""

    phase: str
    #: Under way (listing, scanning, retrying): requests find blocks first.
    active: bool
    #: Blocks the listing found (a layer table or a segment), once listed.
    listed: int
    #: Of those, blocks looked at (adopted or given up).
    scanned: int
    #: Blocks adopted (they serve).
    adopted: int
    elapsed_s: float
    #: The last failure of a retried scan.
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": self.phase,
            "listed": self.listed,
            "scanned": self.scanned,
            "adopted": self.adopted,
            "elapsed_s": round(self.elapsed_s, 3),
        }
        if self.error:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One tier as ``/metrics`` and ``/readyz`` show it."""

    kind: str
    used: int
    capacity: int
    #: Octets taken by writes under way (included in ``used``).
    reserved: int
    degraded: bool
    failures: int
    last_error: str | None
    #: A memory tier's arena (mapped octets, octets in extents, blocks kept
    #: outside it for want of an extent); None without one.
    arena: tuple[int, int, int] | None = None
    #: Its calls' latency by operation (read, write, delete): the cumulative
    #: buckets (upper bound, calls) and the total seconds (.latency).
    latency: dict[str, tuple[list[tuple[str, int]], float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """The store at one moment: its tiers, blocks by state, counters, leases."""

    tiers: tuple[TierSnapshot, ...]
    #: Blocks by state name (writing, resident, leaving).
    blocks: dict[str, int]
    hits: int
    misses: int
    evictions: int
    fault_evictions: int
    expired: int
    demotions: int
    promotions: int
    promotions_dropped: int
    puts_fell_through: int
    copies_dropped: int
    integrity_failures: int
    lease_rejections: int
    leases: int
    #: How far the restart's recovery is (done once it serves whole).
    recovery: RecoveryProgress | None = None
    #: Each scope's blocks and KV octets held (scope id -> (blocks, octets)).
    scopes: dict[str, tuple[int, int]] = field(default_factory=dict)
