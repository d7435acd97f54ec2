"""The tiered store: segments of blocks across tiers, under one eviction manager.

Everything that is not "store these octets under this key" lives in the
storage package, once (STYLE 5, 8): placement, capacity, ordering, demotion
and promotion, leases, sealing of persistent tiers, integrity checks, tier
health, eviction notifications. A **segment** is a layer range of one block
stored as a KV Block Container; a block's segments and their tiers are its
``residency``. The store is a facade over the parts that own each idea:

* :class:`.BlockTable` (``table``): which blocks exist, in which state
  (:mod:`.state`: writing, resident, leaving, gone), and each tier's room;
* :class:`.Placement` (``placement``): where segments go and how they move
  (place, make room, demote, promote, evict), with no store-wide lock held
  across tier I/O;
* :class:`.TierIO` (``io``): every tier call, with its deadline and the
  tier's health (a tier that raises :class:`TierUnavailable` is degraded and
  skipped until its retry time; reads there are misses, P4);
* :class:`.LeaseTable` (``leases``): LE1-LE4.

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
from .blocks import (
    BlockInfo,
    BlockRead,
    Segment,
    StoreStats,
    TierSlot,
    layer_table,
    repr_digest_of,
)
from .crypto import SegmentSealer
from .errors import CorruptData
from .events import EvictHook, OnEvict, StoreEvents, StoreSnapshot, TierSnapshot
from .leases import Lease, LeaseLimits, LeaseTable
from .owner import Ownership, owner_name
from .placement import Placement
from .policy import LRU, EvictionPolicy
from .startup import measure_read_rates, recover
from .state import SERVING, SETTLING
from .table import BlockTable
from .tier import ArenaTier, Tier
from .tierio import OFFLOAD_OCTETS, TierIO
from .types import BlockRef

log = logging.getLogger("kvstore.storage")

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
        *,
        sealer: SegmentSealer | None = None,
        lease_limits: LeaseLimits | None = None,
        policy: Callable[[], EvictionPolicy] = LRU,
        promote: bool = True,
        fast_layers: int | None = None,
        verify_reads: bool | None = None,
        retry_after_s: float = 5.0,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        retention_s: float | None = None,
        wall_clock: Callable[[], float] = time.time,
        write_through: bool = False,
        demote_above: float | None = 0.9,
        demote_to: float | None = None,
    ) -> None:
        """
        ``tiers``: (tier, capacity in octets), fastest first (device -> remote-storage).
        ``on_evict``: a listener of evictions only (see :attr:`events`).
        ``sealer``: encryption/compression for persistent tiers (SEC4).
        ``fast_layers``: keep layers [0, n) of a new block in the first tier and
        the rest in the second (the draft's device 0-15 / host 16-31 split).
        ``verify_reads``: True re-checks layer digests on every read of a
        persistent tier. By default (None) reads are checked by what is cheap:
        the AES-GCM tag when encryption is on, else an XXH3-64 stored with
        the segment when it was written (a CRC-32 in segments written before
        it; detects corruption, not a forger; turn encryption on against one).
        ``retention_s``: blocks stored longer ago than this are removed by
        :meth:`expire` (SEC4: the retention limit of the originating service).
        ``write_through``: a PUT is acknowledged once every layer is also in
        the first persistent tier below the one serving it (a copy there),
        so that an acknowledged block survives a crash.
        ``demote_above`` (the high watermark): once a tier above the last is
        fuller than this fraction of its capacity, its least recently used
        segments move down in the background, down to ``demote_to`` (the low
        watermark; default 0.9 of ``demote_above``), so that PUTs find room
        without demoting a victim first; a PUT that finds such a tier full
        anyway is written to the tier below it (see
        :meth:`.Placement.make_room`). None: no background demotion; a PUT
        that needs room moves a victim down itself, however long that takes.
        """
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if demote_above is not None and not 0 < demote_above < 1:
            raise ValueError("demote_above is a fraction of a tier's capacity, in (0, 1)")
        if demote_to is not None and (demote_above is None or not 0 < demote_to < demote_above):
            raise ValueError("demote_to is a fraction of a tier's capacity below demote_above")
        self.demote_above = demote_above
        #: The low watermark: a background drain stops there.
        self.demote_to = demote_to or 0.9 * (demote_above or 1.0)
        self.slots = [TierSlot(tier, capacity, policy()) for tier, capacity in tiers]
        #: The tiers with an arena to receive blocks into (the host tier's).
        self._arenas = [tier for tier, _ in tiers if isinstance(tier, ArenaTier)]
        for tier, capacity in tiers:
            tier.provision(capacity)
        self.leases = LeaseTable(lease_limits or LeaseLimits(), clock)
        self.promote = promote
        self.fast_layers = fast_layers
        self.verify_reads = verify_reads
        #: Who hears of blocks stored and leaving (the holder's publisher, P1-P3).
        self.events = StoreEvents()
        if on_evict is not None:
            self.events.subscribe(OnEvict(on_evict))
        self.clock = clock
        self.retention_s, self.wall_clock = retention_s, wall_clock
        self.write_through = write_through and any(s.tier.persistent for s in self.slots)
        self.stats = StoreStats()
        self.io = TierIO(self.slots, sealer or SegmentSealer(), self.stats, retry_after_s, clock)
        self.table = BlockTable(self.slots)
        self.placement = Placement(self)
        self._spilled = False
        #: The claims of the persistent tiers while open (see :meth:`open`).
        self._ownership: Ownership | None = None
        self._closed = False

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
        info = self.table.entry(ref)
        return (info is not None and info.readers > 0) or self.leases.is_leased(ref)

    def accounting(self) -> tuple[list[int], list[int]]:
        """(each tier's used octets, the sum of its segments, copies and
        reservations): equal whenever no await is under way (tests)."""
        return self.table.accounting()

    def residency(self, ref: BlockRef) -> tuple[Residency, ...]:
        """The ``residency`` array of the block's Replica Record: adjacent
        segments in one tier merged, ascending, non-overlapping (R2)."""
        out: list[Residency] = []
        for segment in sorted(self.info(ref).segments, key=lambda s: s.first):
            slot = self.slots[segment.slot]
            prev = out[-1] if out else None
            if prev is not None and prev.tier == slot.kind and prev.last + 1 == segment.first:
                out[-1] = Residency(prev.tier, prev.first, segment.last, prev.read_mbit_per_s)
            else:
                out.append(
                    Residency(slot.kind, segment.first, segment.last, slot.tier.read_mbit_per_s)
                )
        return tuple(out)

    def replica_record(self, ref: BlockRef, holder: str, ttl_ms: int) -> ReplicaRecord:
        info = self.info(ref)
        digests = info.layer_digests
        return ReplicaRecord(
            block_key=ref.block_key,
            compat_id=ref.compat_id,
            scope_id=ref.scope_id,
            holder=holder,
            codec=info.codec,
            size=info.size,
            digest="sha-256:" + kc.replica_digest(digests).hex(),
            residency=self.residency(ref),
            ttl_ms=ttl_ms,
            layer_digests=tuple(d.hex() for d in digests),
        )

    async def measure_read_rates(self, probe_octets: int = 2 << 20, rounds: int = 3) -> None:
        """Measure ``read_mbit_per_s`` of tiers that have none configured (PL1 inputs)."""
        await measure_read_rates(self, probe_octets, rounds)

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
            info = BlockInfo(ref, container.codec, container.token_count, {}, [])
            info.stored_at = self.wall_clock()
            self.table.begin(info)
            try:
                for first, last, slot in self._split(container):
                    if (first, last) == (container.first_layer, container.last_layer):
                        part: BytesLike = data  # the whole container: no copy
                    else:
                        part = container.slice(first, last).tobytes()
                    segment = await self.placement.place(info, first, last, part, slot)
                    if self.write_through and not self.slots[segment.slot].tier.persistent:
                        await self.placement.place_copy(info, segment, part)
                info.layers = await hashing
                info.whole_repr_digest = await whole
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
        n = self.fast_layers
        if n is None or len(self.slots) < 2 or first >= n or last < n:
            return [(first, last, 0)]
        return [(first, n - 1, 0), (n, last, 1)]

    def _expired(self, info: BlockInfo) -> bool:
        """Past the retention limit: not served any more, even before a sweep."""
        limit = self.retention_s
        return bool(limit) and info.stored_at < self.wall_clock() - (limit or 0.0)

    async def expire(self, batch: int = 32) -> int:
        """Remove every block stored more than ``retention_s`` ago (SEC4);
        see :func:`.retention.expire`. Returns how many went."""
        from .retention import expire

        return await expire(self, batch)

    async def spill(self, timeout_s: float = 10.0) -> int:
        """At a graceful shutdown, move what only memory tiers hold into the
        persistent tiers' free room; see :func:`.spill.spill`."""
        from .spill import spill

        # Once per process: the holder's stop spills before it withdraws what
        # did not go down, and the store's own stop finds nothing left to do.
        if self._spilled:
            return 0
        self._spilled = True
        # Promotions are optional work: none may run after the spill, where
        # making room for one would evict what the spill kept.
        await self.placement.stop()
        return await spill(self, timeout_s)

    async def delete(self, ref: BlockRef, *, force: bool = False) -> None:
        """Remove a block (an operator action), withdrawn first (P3); a
        leased one is refused (LE2) unless ``force`` (then it goes as data
        lost to a fault would, LE4)."""
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
        ``force``. Returns (removed, leased and kept)."""
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
        if info is None or self._expired(info):
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
        return BlockRead(self, info, a, b)

    async def get(self, ref: BlockRef, first: int | None = None, last: int | None = None) -> bytes:
        """Read layers ``first..last`` of a block into one container buffer."""
        return await self.read(ref, first, last).read_all()

    async def _load(self, info: BlockInfo, segment: Segment) -> BytesLike:
        """A segment's plaintext container, opened and checked.

        A segment that a concurrent promotion or demotion moved is followed
        to its new tier; one that is gone while still attached was lost by
        its tier, and the block leaves the holder (LE4).
        """
        while True:
            slot = self.slots[segment.slot]
            stored = await self.io.call(slot, slot.tier.get(segment.key))
            if self.table.entry(info.ref) is not info:
                # Gone (and maybe put again: the same keys hold another
                # incarnation's octets, never to be sent under this header).
                raise NotFound(f"block {info.ref.block_key} is no longer held")
            if stored is not None:
                break
            if segment not in info.segments:
                moved = next((x for x in info.segments if x.first == segment.first), None)
                if moved is None:
                    raise NotFound(f"block {info.ref.block_key} is no longer held")
                segment = moved
                continue
            # The tier lost data it had acknowledged (restart, external eviction).
            lost = f"{slot.kind} lost layers {segment.first}-{segment.last}"
            await self.placement.lost(info, lost)
            raise NotFound(f"block {info.ref.block_key} is no longer held")
        if not slot.tier.persistent:
            return stored
        checked = segment
        # Adopted at a restart without being read: checked in full once.
        whole = self.verify_reads or (segment.slot, segment.first) in info.unchecked

        def check_and_open() -> BytesLike:
            # The AES-GCM tag or the checksum written with the segment (never a
            # value taken from what was read): see .crypto.
            plain = self.sealer.open(info.ref.segment_name(checked.first, checked.last), stored)
            if whole:
                info.verify_segment(checked, plain)
            return plain

        try:
            if len(memoryview(stored)) >= OFFLOAD_OCTETS:
                plain = await asyncio.to_thread(check_and_open)
            else:
                plain = check_and_open()
            if whole:
                info.unchecked.discard((checked.slot, checked.first))
            return plain
        except CorruptData as exc:  # logged once: the block leaves (withdrawn first, LE4)
            self.stats.integrity_failures += 1
            log.warning("integrity: %s in %s fails: %s", checked.key, slot.kind, exc.detail)
            await self.placement.lost(info, f"corrupt segment in {slot.kind}")
            raise

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
            and not self._expired(info)
        ]
        if not held:
            raise NotFound("none of the block keys is held")
        self.leases.check_ttl(ttl_ms)
        from .retention import lease_terms

        held, granted_ms = lease_terms(self, held, ttl_ms)
        return self.leases.grant(client, held, granted_ms)

    def renew_lease(self, client: str, lease_id: str, ttl_ms: int) -> Lease:
        self.leases.check_ttl(ttl_ms)
        lease = self.leases.lookup(client, lease_id)
        from .retention import retention_ttl

        return self.leases.renew(client, lease_id, retention_ttl(self, ttl_ms, lease.sizes))

    def release_lease(self, client: str, lease_id: str) -> None:
        self.leases.release(client, lease_id)

    # --- lifecycle -----------------------------------------------------

    async def recover(self) -> int:
        """Find the segments persistent tiers still hold (after a restart);
        returns the number of blocks found. See :mod:`.startup`."""
        found = await recover(self)
        now = self.wall_clock()
        for info in self.table:
            if info.stored_at <= 0 or info.stored_at > now:
                # No time kept (an older version, a lost table), or one
                # from a clock ahead of ours: counted from now, and the
                # table rewritten so that the next restart knows it.
                info.stored_at = min(now, info.stored_at) if info.stored_at > 0 else now
                info.meta_slots.clear()
                await self.placement.sync_meta(info)
        return found

    async def settle(self) -> None:
        """Wait for the background promotions and demotions started so far,
        and for the work finishing changes already made (a cancelled
        DELETE's removal goes on by itself)."""
        await self.placement.settle()

    async def open(self, owner: str = "", owner_ttl_s: float = 30.0) -> int:
        """Make the store this process's and find what it holds: claim each
        persistent tier (one owner per storage, :mod:`.owner`; a second
        process on the same LMDB directory, Redis or S3 prefix gets
        :class:`.StorageInUse`), keep the claims while open, and
        :meth:`recover`. Returns the number of blocks found. ``async with``
        calls it; without a persistent tier there is nothing to do."""
        if not any(s.tier.persistent for s in self.slots) or self._ownership is not None:
            return len(self)
        ownership = Ownership([s.tier for s in self.slots], owner or owner_name(), owner_ttl_s)
        await ownership.claim()
        self._ownership = ownership
        ownership.start()
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
