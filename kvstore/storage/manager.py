"""The tiered store: segments of blocks across tiers, under one eviction manager.

Everything that is not "store these octets under this key" lives in the
storage package, once (STYLE 5, 8): placement, capacity, ordering, demotion
and promotion, leases, sealing of persistent tiers, integrity checks, tier
health, eviction notifications. A **segment** is a layer range of one block
stored as a KV Block Container; a block's segments and their tiers are its
``residency``. The store is a facade over the parts that own each idea
(:mod:`.core` draws the package's floors), and the only module that builds
them:

* :class:`.StoreCore` (``core``): the shared parts, among them the
  :class:`.BlockTable` (``table``: which blocks exist, in which state, and
  each tier's room), the :class:`.TierIO` (``io``: every tier call, with its
  deadline and the tier's health; a degraded tier is skipped until its retry
  time, reads there are misses, P4) and the :class:`.LeaseTable`
  (``leases``: LE1-LE4);
* :class:`.SegmentLoader` (``loader``): a segment's octets, opened and checked;
* :class:`.Placement` (``placement``): where segments go and how they move
  (place, make room, demote, promote, evict), with no store-wide lock held
  across tier I/O;
* :class:`.BlockRead`: a read in progress.

What the store itself does: PUT (BL7: one 201 and one 412 for two PUTs of a
key, whatever their timing), reads (BL1-BL4), leases, and the lifecycle
(recovery, the retention sweep, the spill at a graceful stop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.compat import CompatibilityDescriptor
from ..protocol.problems import LayersUnavailable, MalformedContainer, NotFound, PreconditionFailed
from ..protocol.records import ReplicaRecord, Residency
from .core import StoreCore
from .crypto import SegmentSealer
from .errors import StillRecovering
from .events import (
    EvictHook,
    OnEvict,
    RecoveryProgress,
    StoreEvents,
    StoreSnapshot,
    TierSnapshot,
)
from .leases import Lease, LeaseLimits, LeaseTable
from .loader import SegmentLoader
from .owner import Ownership, owner_name
from .placement import Placement
from .policy import LRU, EvictionPolicy
from .reads import BlockRead
from .records import BlockInfo, StoreStats, TierSlot, layer_table, repr_digest_of
from .retention import expire, lease_terms, retention_ttl
from .settings import StoreSettings
from .spill import spill
from .startup import Recovery, measure_read_rates
from .state import SERVING, SETTLING
from .table import BlockTable
from .tier import ArenaTier, Tier
from .tierio import OFFLOAD_OCTETS, TierIO
from .types import BlockRef

log = logging.getLogger("kvstore.storage")

#: A store's settings when none are given.
DEFAULTS = StoreSettings()

T = TypeVar("T")


def _done(value: T) -> asyncio.Future[T]:
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _off_loop(data: BytesLike, fn: Callable[[Any], T], arg: Any) -> asyncio.Future[T]:
    """``fn(arg)`` in a worker thread when ``data`` is large, else now."""
    if len(memoryview(data)) >= OFFLOAD_OCTETS:
        return asyncio.ensure_future(asyncio.to_thread(fn, arg))
    return _done(fn(arg))


class TieredStore:
    """Blocks in segments over an ordered list of tiers, fastest first."""

    #: Background promotions at once (see :class:`.Placement`).
    MAX_PROMOTIONS = Placement.MAX_PROMOTIONS

    def __init__(
        self,
        tiers: Sequence[tuple[Tier, int]],
        settings: StoreSettings = DEFAULTS,
        *,
        sealer: SegmentSealer | None = None,
        lease_limits: LeaseLimits | None = None,
        policy: Callable[[], EvictionPolicy] = LRU,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """
        ``tiers``: (tier, capacity in octets), fastest first (device -> remote-storage).
        ``settings``: how the store behaves, taken whole (:class:`.StoreSettings`:
        the layer split, promotion, write-through, the watermarks of
        background demotion, lease limits, retention, a failed tier's retry
        time), the configuration's ``[storage]`` keys.
        ``sealer``: encryption/compression for persistent tiers (SEC4).
        ``lease_limits``: the lease quotas whole (LE3), when more than the
        settings' two are to be set (the leases per client).
        ``on_evict``: a listener of evictions only (see :attr:`events`).
        ``clock``: a monotonic clock (leases, tier retry times);
        ``wall_clock``: Unix time (when a block was stored, for retention).
        """
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if problems := settings.problems():
            raise ValueError(problems[0])
        self.core = StoreCore(
            tiers,
            settings,
            sealer=sealer or SegmentSealer(),
            lease_limits=lease_limits or settings.lease_limits,
            policy=policy,
            clock=clock,
            wall_clock=wall_clock,
        )
        self.loader = SegmentLoader(self.core)
        self.placement = Placement(self.core, self.loader)
        self.recovery = Recovery(self.core, self.placement)
        core = self.core
        # The shared parts, by name (the holder, metrics and tests read them).
        self.slots: list[TierSlot] = core.slots
        self.table: BlockTable = core.table
        self.io: TierIO = core.io
        self.leases: LeaseTable = core.leases
        #: Who hears of blocks stored and leaving (the holder's publisher, P1-P3).
        self.events: StoreEvents = core.events
        self.stats: StoreStats = core.stats
        self.clock, self.wall_clock = clock, wall_clock
        if on_evict is not None:
            self.events.subscribe(OnEvict(on_evict))
        #: The tiers with an arena to receive blocks into (the host tier's).
        self._arenas = [tier for tier, _ in tiers if isinstance(tier, ArenaTier)]
        self._spilled = False
        #: The claims of the persistent tiers while open (see :meth:`open`).
        self._ownership: Ownership | None = None
        self._closed = False

    @property
    def settings(self) -> StoreSettings:
        return self.core.settings

    @property
    def write_through(self) -> bool:
        """A PUT is acknowledged once in a persistent tier (a store with one)."""
        return self.core.write_through

    @property
    def retention_s(self) -> float | None:
        """The retention limit in seconds (SEC4); None when blocks are kept."""
        return self.core.settings.retention_s or None

    @property
    def sealer(self) -> SegmentSealer:
        return self.io.sealer

    @property
    def retry_after_s(self) -> float:
        """How long a tier that failed is skipped before it is asked again."""
        return self.io.retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, value: float) -> None:
        self.io.retry_after_s = value

    # --- queries -------------------------------------------------------

    def __contains__(self, ref: object) -> bool:
        """The holder has the block's data: resident, or leaving (being
        withdrawn, P3) and not yet deleted."""
        return isinstance(ref, BlockRef) and self.table.held(ref)

    def serves(self, ref: BlockRef) -> bool:
        """The block is resident: read, leased and advertised."""
        return self.table.serving(ref) is not None

    def __len__(self) -> int:
        return len(self.table)

    def blocks(self) -> Iterator[BlockInfo]:
        """The resident blocks (a snapshot)."""
        return iter(self.table)

    def info(self, ref: BlockRef) -> BlockInfo:
        info = self.table.entry(ref)
        if info is None or not self.table.held(ref):
            raise NotFound(f"block {ref.block_key} is not held")
        return info

    def refs_for_key(self, block_key: str) -> set[BlockRef]:
        return self.table.refs_for_key(block_key)

    def pinned(self, ref: BlockRef) -> bool:
        """Leased, or being read: never picked to make room (LE2)."""
        return self.core.pinned(ref)

    def accounting(self) -> tuple[list[int], list[int]]:
        """(each tier's used octets, the sum of its segments, copies and
        reservations): equal whenever no await is under way (tests)."""
        return self.table.accounting()

    def residency(self, ref: BlockRef) -> tuple[Residency, ...]:
        """The ``residency`` array of the block's Replica Record (R2)."""
        return self.info(ref).residency(self.slots)

    def replica_record(self, ref: BlockRef, holder: str, ttl_ms: int) -> ReplicaRecord:
        return self.info(ref).replica_record(self.slots, holder, ttl_ms)

    async def measure_read_rates(self, probe_octets: int = 2 << 20, rounds: int = 3) -> None:
        """Measure ``read_mbit_per_s`` of tiers that have none configured (PL1 inputs)."""
        await measure_read_rates(self.core, probe_octets, rounds)

    def tier_snapshots(self) -> tuple[TierSnapshot, ...]:
        """Each tier now (readiness, status reports): no walk of the blocks."""
        now = self.clock()
        return tuple(
            TierSnapshot(
                s.kind,
                s.used,
                s.capacity,
                s.reserved,
                s.degraded_until > now,
                s.failures,
                s.last_error,
                s.tier.arena_figures() if isinstance(s.tier, ArenaTier) else None,
                {op: (x.cumulative(), x.total_s) for op, x in s.latency.items()},
            )
            for s in self.slots
        )

    def snapshot(self) -> StoreSnapshot:
        """The store now, for metrics (OPS1); counts the blocks by state."""
        stats = self.stats
        return StoreSnapshot(
            tiers=self.tier_snapshots(),
            blocks={state.value: n for state, n in self.table.states().items()},
            hits=stats.hits,
            misses=stats.misses,
            evictions=stats.evictions,
            fault_evictions=stats.fault_evictions,
            expired=stats.expired,
            demotions=stats.demotions,
            promotions=stats.promotions,
            promotions_dropped=stats.promotions_dropped,
            puts_fell_through=stats.puts_fell_through,
            copies_dropped=stats.copies_dropped,
            integrity_failures=stats.integrity_failures,
            lease_rejections=self.leases.rejections,
            leases=len(self.leases),
            recovery=self.recovery.progress(),
            scopes=self.table.scope_usage(),
        )

    # --- writes --------------------------------------------------------

    def buffer(self, size: int) -> memoryview | None:
        """Memory to receive a block of ``size`` octets into, which a tier
        keeps without a copy if the block is placed there (the host tier's
        arena), or None. Released by dropping it."""
        for tier in self._arenas:  # found once: a runtime protocol check is slow per PUT
            if (found := tier.buffer(size)) is not None:
                return found
        return None

    async def put(
        self,
        ref: BlockRef,
        data: BytesLike,
        *,
        descriptor: CompatibilityDescriptor | None = None,
        layer_digests: Sequence[bytes] | None = None,
    ) -> BlockInfo:
        """Store a block from its container octets (BL7).

        ``layer_digests``: the layer digests when the caller already took them
        from these very octets (trusted, not re-checked). Raises
        :class:`PreconditionFailed` if the block is held (the old copy stays),
        :class:`MalformedContainer` for a bad container, and
        :class:`InsufficientStorage` when no tier can take it.
        """
        container = kc.decode(data, descriptor=descriptor)
        if len(container) == 0 or container.first_layer != 0:
            # A block is stored whole: its record lists every layer's digest (R2).
            raise MalformedContainer("a block must carry its layers from layer 0 on")
        if self.recovery.active and not await self.recovery.find(ref):
            # BL7: whether it is held (a 412) cannot be told yet.
            raise StillRecovering(
                f"block {ref.block_key}: the holder is still finding its stored blocks"
            )
        # B3: the layer digests are computed in a worker thread while the
        # segments are written; hashlib releases the GIL, so the two overlap.
        # BL4: so is the Repr-Digest of the whole block, in a second thread,
        # so that no GET reads a segment twice for it. A small block is
        # hashed at once: a thread hop would cost more than its hashing.
        if layer_digests is not None and len(layer_digests) == len(container):
            # Already taken by the caller from these octets (trusted).
            table = {
                layer.index: (len(layer.k), len(layer.v), digest)
                for layer, digest in zip(container, layer_digests, strict=True)
            }
            hashing = _done(table)
        else:
            hashing = _off_loop(data, layer_table, container)
        whole = _off_loop(data, repr_digest_of, data)
        try:
            # BL7: one PUT of a reference at a time. A second one waits for the
            # first to settle: 412 if it was stored, else it stores its own.
            while (existing := self.table.entry(ref)) is not None:
                if existing.state in SERVING:
                    raise PreconditionFailed(f"block {ref.block_key} is already held")
                assert existing.state in SETTLING
                await self.table.settled(existing)
            info = BlockInfo(
                ref, container.codec, container.token_count, {}, [], stored_at=self.wall_clock()
            )
            self.table.begin(info)
            try:
                for first, last, slot in self._split(container):
                    if (first, last) == (container.first_layer, container.last_layer):
                        part: BytesLike = data  # the whole container: no copy
                    else:
                        part = container.slice(first, last).tobytes()
                    segment = await self.placement.place(info, first, last, part, slot)
                    if self.core.write_through and not self.slots[segment.slot].tier.persistent:
                        await self.placement.place_copy(info, segment, part)
                self.table.hashed(info, await hashing, await whole)
                await self.placement.sync_meta(info, strict=True)
            except BaseException:
                await self.placement.discard(info)
                raise
            self.table.stored(info)
            self.stats.puts += 1
            self.events.stored(ref)  # P1: the publisher queues its record
            return info
        finally:
            if not (hashing.done() and whole.done()):
                # A failed PUT does not leave its hashing threads behind. (A
                # stored one has awaited both: it returns with no await after
                # it was acknowledged.)
                await asyncio.gather(hashing, whole, return_exceptions=True)

    def _split(self, container: kc.Container) -> list[tuple[int, int, int]]:
        first, last = container.first_layer, container.last_layer
        n = self.core.settings.fast_layers
        if not n or len(self.slots) < 2 or first >= n or last < n:
            return [(first, last, 0)]
        return [(first, n - 1, 0), (n, last, 1)]

    async def expire(self, batch: int = 32) -> int:
        """Remove every block stored more than ``retention_s`` ago (SEC4);
        see :func:`.retention.expire`. Returns how many went."""
        return await expire(self.core, self.placement, batch)

    async def spill(self, timeout_s: float = 10.0) -> int:
        """At a graceful shutdown, move what only memory tiers hold into the
        persistent tiers' free room; see :func:`.spill.spill`."""
        # Once per process: the holder's stop spills before it withdraws what
        # did not go down, and the store's own stop finds nothing left to do.
        if self._spilled:
            return 0
        self._spilled = True
        # Promotions are optional work: none may run after the spill, where
        # making room for one would evict what the spill kept.
        await self.placement.stop()
        return await spill(self.core, self.placement, timeout_s)

    async def delete(self, ref: BlockRef, *, force: bool = False) -> None:
        """Remove a block (an operator action), withdrawn first (P3); a
        leased one is refused (LE2) unless ``force`` (then it goes as data
        lost to a fault would, LE4)."""
        if self.recovery.active and not await self.recovery.find(ref):
            raise StillRecovering(
                f"block {ref.block_key}: the holder is still finding its stored blocks"
            )
        info = self.table.serving(ref)
        if info is None:
            raise NotFound(f"block {ref.block_key} is not held")
        await info.claim.take()
        try:
            if self.pinned(ref) and not force:
                raise PreconditionFailed(
                    f"block {ref.block_key} is leased or being read (force=true removes it even so)"
                )
            if not await self.placement.evict(info, "deleted"):
                raise NotFound(f"block {ref.block_key} is not held")
        finally:
            info.claim.give()

    async def purge(self, scope_id: str, *, force: bool = False) -> tuple[int, int]:
        """Remove every block of a scope (a tenant leaving, a poisoned cache),
        each withdrawn first (P3), one at a time; leased ones stay unless
        ``force``. Returns (removed, leased and kept). Refused while
        recovering (:class:`.StillRecovering`): the scope's blocks not found
        yet would stay."""
        if self.recovery.active:
            progress = self.recovery.progress()
            raise StillRecovering(
                f"the holder is still finding its stored blocks ({progress.scanned} of "
                f"{progress.listed} looked at): a purge now would leave the rest"
            )
        removed = kept = 0
        for ref in [info.ref for info in self.table if info.ref.scope_id == scope_id]:
            try:
                await self.delete(ref, force=force)
                removed += 1
            except PreconditionFailed:
                kept += 1
            except NotFound:
                pass  # gone meanwhile
        return removed, kept

    # --- reads ---------------------------------------------------------

    def read(
        self,
        ref: BlockRef,
        first: int | None = None,
        last: int | None = None,
        *,
        count: bool = True,
    ) -> BlockRead:
        """Start a read of layers ``first..last`` (default: all held), BL1-BL2.
        ``count=False``: a probe (HEAD), neither a hit nor a use of the block."""
        info = self.table.serving(ref)
        if info is None or self.core.expired(info):
            if count:
                self.stats.misses += 1
            raise NotFound(f"block {ref.block_key} is not held")
        a = info.first_layer if first is None else first
        b = info.last_layer if last is None else last
        if not info.holds(a, b):
            raise LayersUnavailable(
                f"layers {a}-{b} are not held; held: {info.first_layer}-{info.last_layer}",
                held=[info.first_layer, info.last_layer],
            )
        if count:
            self.stats.hits += 1
            for segment in info.segments:
                self.slots[segment.slot].policy.touch(segment.id)
        return BlockRead(self.core, self.loader, self.placement, info, a, b)

    async def get(self, ref: BlockRef, first: int | None = None, last: int | None = None) -> bytes:
        """Read layers ``first..last`` of a block into one container buffer."""
        if self.recovery.active:
            await self.recovery.find(ref)  # not told in time: a miss (P4)
        return await self.read(ref, first, last).read_all()

    # --- leases --------------------------------------------------------

    def lease(
        self,
        client: str,
        block_keys: Iterable[str],
        ttl_ms: int,
        allowed: Callable[[BlockRef], bool] | None = None,
    ) -> Lease:
        """Lease every held block with one of ``block_keys`` (LE1-LE3), or those
        of them ``allowed`` accepts (the holder passes the client's scopes)."""
        table = self.table
        held = [
            (info.ref, info.size)
            for key in dict.fromkeys(block_keys)
            for info in map(table.serving, table.refs_for_key(key))
            if info is not None
            and (allowed is None or allowed(info.ref))
            and not self.core.expired(info)
        ]
        if not held:
            raise NotFound("none of the block keys is held")
        self.leases.check_ttl(ttl_ms)
        held, granted_ms = lease_terms(self.core, held, ttl_ms)
        return self.leases.grant(client, held, granted_ms)

    def renew_lease(self, client: str, lease_id: str, ttl_ms: int) -> Lease:
        self.leases.check_ttl(ttl_ms)
        lease = self.leases.lookup(client, lease_id)
        return self.leases.renew(client, lease_id, retention_ttl(self.core, ttl_ms, lease.sizes))

    def release_lease(self, client: str, lease_id: str) -> None:
        self.leases.release(client, lease_id)

    # --- lifecycle -----------------------------------------------------

    async def recover(self) -> int:
        """Find the segments persistent tiers still hold (after a restart);
        returns the number of blocks held. See :mod:`.startup`."""
        return await self.recovery.run()

    @property
    def recovering(self) -> bool:
        """A recovery is under way (in the background after :meth:`open`
        with ``background``): blocks not reached yet are found on demand."""
        return self.recovery.active

    def recovery_progress(self) -> RecoveryProgress:
        """How far recovery is (``/readyz``, metrics)."""
        return self.recovery.progress()

    async def recovered(self) -> None:
        """Wait until a background recovery is done."""
        await self.recovery.wait()

    async def find(self, ref: BlockRef) -> bool:
        """While a background recovery runs, recover ``ref`` now if a
        persistent tier holds it (a request about it answers as if the
        scan were done); False when that could not be told in time (see
        :meth:`.Recovery.find`). The store's async calls do this
        themselves; a caller of :meth:`read` or :meth:`lease` awaits it
        (or :meth:`find_keys`) first."""
        return await self.recovery.find(ref)

    async def find_keys(self, block_keys: Iterable[str]) -> None:
        """:meth:`find` every stored block with one of ``block_keys``."""
        await self.recovery.find_keys(block_keys)

    async def settle(self) -> None:
        """Wait for the background promotions and demotions started so far,
        and for the work finishing changes already made (a cancelled
        DELETE's removal goes on by itself)."""
        await self.placement.settle()

    async def open(
        self, owner: str = "", owner_ttl_s: float = 30.0, *, background: bool = False
    ) -> int:
        """Make the store this process's and find what it holds: claim each
        persistent tier (one owner per storage, :mod:`.owner`; a second
        process on the same LMDB directory, Redis or S3 prefix gets
        :class:`.StorageInUse`), keep the claims while open, and
        :meth:`recover`. Returns the number of blocks found. ``async with``
        calls it; without a persistent tier there is nothing to do.

        ``background``: return once the tiers are claimed and recover while
        serving (what ``kvstore serve`` does, so that a large tier does not
        keep the holder silent): a GET, PUT, DELETE or lease of a block the
        scan has not reached finds it first (:meth:`find`);
        :meth:`recovered` waits for the scan. Returns 0 then."""
        if not any(s.tier.persistent for s in self.slots) or self._ownership is not None:
            return len(self)
        ownership = Ownership([s.tier for s in self.slots], owner or owner_name(), owner_ttl_s)
        await ownership.claim()
        self._ownership = ownership
        ownership.start()
        if background:
            self.recovery.start()
            return 0
        return await self.recover()

    async def close(self, spill: bool = True) -> None:
        """Stop, keeping what it holds: with a persistent tier, what only
        memory tiers hold goes down to it first (:meth:`spill`; its free room
        only), so a store opened on the same tiers finds it again.
        ``spill=False``: as a crash would leave it (what only memory held is
        gone). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        await self.recovery.stop()
        if spill:
            await self.spill()
        await self.placement.stop()
        if self._ownership is not None:
            await self._ownership.stop()
            await self._ownership.release()
            self._ownership = None
        for slot in self.slots:
            await slot.tier.close()

    async def __aenter__(self) -> TieredStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
