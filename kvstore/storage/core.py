"""The store's core: the parts every other part of the store shares.

The storage package reads one way (STYLE 17), from the bottom up:

1. records (:mod:`.records`, :mod:`.state`, :mod:`.types`, :mod:`.settings`):
   plain data, no I/O;
2. the core (this module): the tiers' slots, the block table, the tier I/O,
   the leases, the event listeners, the counters, the clocks and the
   settings, built once and shared;
3. the segment loader (:mod:`.loader`): a segment's octets, opened and
   checked; it reports a lost segment and lets its caller decide;
4. placement (:mod:`.placement`): where segments go and how they move;
5. what builds on placement: reads (:mod:`.reads`), recovery
   (:mod:`.startup`), retention (:mod:`.retention`), the spill
   (:mod:`.spill`);
6. the facade, :class:`.TieredStore` (:mod:`.manager`): the only public face,
   the only module that builds the others, imported by nobody inside.

Each part is given the core (and the parts below it that it needs), never
the facade.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .crypto import SegmentSealer
from .events import StoreEvents
from .leases import LeaseLimits, LeaseTable
from .policy import EvictionPolicy
from .records import BlockInfo, StoreStats, TierSlot
from .settings import StoreSettings
from .table import BlockTable
from .tier import Tier
from .tierio import TierIO
from .types import BlockRef


class StoreCore:
    """The shared parts of one store (see the module's docstring)."""

    def __init__(
        self,
        tiers: Sequence[tuple[Tier, int]],
        settings: StoreSettings,
        *,
        sealer: SegmentSealer,
        lease_limits: LeaseLimits,
        policy: Callable[[], EvictionPolicy],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.slots = [TierSlot(tier, capacity, policy()) for tier, capacity in tiers]
        for tier, capacity in tiers:
            tier.provision(capacity)
        self.clock, self.wall_clock = clock, wall_clock
        self.stats = StoreStats()
        self.io = TierIO(self.slots, sealer, self.stats, settings.retry_after_s, clock)
        self.table = BlockTable(self.slots)
        self.leases = LeaseTable(lease_limits, clock)
        #: Who hears of blocks stored and leaving (the holder's publisher, P1-P3).
        self.events = StoreEvents()
        #: ``write_through`` where it means something: a persistent tier exists.
        self.write_through = settings.write_through and any(s.tier.persistent for s in self.slots)

    @property
    def sealer(self) -> SegmentSealer:
        return self.io.sealer

    def pinned(self, ref: BlockRef) -> bool:
        """Leased, or being read: never picked to make room (LE2)."""
        info = self.table.entry(ref)
        return (info is not None and info.readers > 0) or self.leases.is_leased(ref)

    def expired(self, info: BlockInfo) -> bool:
        """Past the retention limit: not served any more, even before a sweep (SEC4)."""
        limit = self.settings.retention_s
        return bool(limit) and info.stored_at < self.wall_clock() - limit
