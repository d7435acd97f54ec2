"""The tiered store: segments of blocks across tiers, under one eviction manager.

Everything that is not "store these octets under this key" lives here, once
(STYLE 5, 8): placement, capacity, ordering, demotion and promotion, leases,
sealing of persistent tiers, integrity checks, tier health, eviction
notifications. A **segment** is a layer range of one block stored as a KV
Block Container; a block's segments and their tiers are its ``residency``.
Rules, with the requirement they serve:

* a block under an unexpired lease, or being read, is never demoted or
  evicted (LE2); a put that could only make room by evicting leased data
  goes to a lower tier, or fails with :class:`InsufficientStorage`;
* ``on_evict`` is awaited *before* a block leaves the holder, so the holder
  can withdraw it from the Index Service first (P3); data lost to a fault
  (a tier that no longer has a segment) notifies before it is forgotten,
  leased or not (LE4);
* tiers are inclusive below memory: a promotion copies a segment up and the
  persistent tier keeps its copy (``BlockInfo.copies``) until that tier needs
  the room, so what reached LMDB, Redis or S3 stays there when it is read
  (a demotion back down is then free); ``write_through`` also makes a PUT
  write that copy before it is acknowledged (acknowledged = durable);
* a tier that raises :class:`TierUnavailable` is marked degraded and skipped
  for new writes until its retry time; reads of segments there fail with
  that error and the caller treats it as a miss (P4). No backend decides this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.compat import CompatibilityDescriptor
from ..protocol.problems import (
    CorruptData,
    InsufficientStorage,
    LayersUnavailable,
    MalformedContainer,
    NotFound,
    PreconditionFailed,
    TierFull,
    TierUnavailable,
)
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
from .leases import Lease, LeaseLimits, LeaseTable
from .moves import Moves
from .policy import LRU, EvictionPolicy
from .tier import Tier
from .tierio import OFFLOAD_OCTETS, TierIO
from .types import BlockRef

log = logging.getLogger("kvstore.storage")

EvictHook = Callable[[BlockRef, str], Awaitable[None]]


class TieredStore(TierIO):
    """Blocks in segments over an ordered list of tiers, fastest first."""

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
    ) -> None:
        """
        ``tiers``: (tier, capacity in octets), fastest first (device -> remote-storage).
        ``sealer``: encryption/compression for persistent tiers (SEC4).
        ``fast_layers``: keep layers [0, n) of a new block in the first tier and
        the rest in the second (the draft's device 0-15 / host 16-31 split).
        ``verify_reads``: True re-checks layer digests on every read of a
        persistent tier. By default (None) reads are checked by what is cheap:
        the AES-GCM tag when encryption is on, else a CRC-32 of the stored
        octets kept in memory (detects corruption, not a forger; turn
        encryption on against one).
        ``retention_s``: blocks stored longer ago than this are removed by
        :meth:`expire` (SEC4: the retention limit of the originating service).
        ``write_through``: a PUT is acknowledged once every layer is also in
        the first persistent tier below the one serving it (a copy there),
        so that an acknowledged block survives a crash.
        """
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.slots = [TierSlot(tier, capacity, policy()) for tier, capacity in tiers]
        self.sealer = sealer or SegmentSealer()
        self.leases = LeaseTable(lease_limits or LeaseLimits(), clock)
        self.promote = promote
        self.fast_layers = fast_layers
        self.verify_reads = verify_reads
        self.retry_after_s = retry_after_s
        self.on_evict = on_evict
        self.clock = clock
        self.retention_s, self.wall_clock = retention_s, wall_clock
        self.write_through = write_through and any(s.tier.persistent for s in self.slots)
        self.stats = StoreStats()
        self._blocks: dict[BlockRef, BlockInfo] = {}
        self._by_key: dict[str, set[BlockRef]] = {}
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._hooks_running = 0
        #: Promotions, in the background (stopped by spill() and close()).
        self._moves = Moves(self.MAX_PROMOTIONS)

    # --- queries -------------------------------------------------------

    def __contains__(self, ref: object) -> bool:
        return ref in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> Iterator[BlockInfo]:
        return iter(list(self._blocks.values()))

    def info(self, ref: BlockRef) -> BlockInfo:
        info = self._blocks.get(ref)
        if info is None:
            raise NotFound(f"block {ref.block_key} is not held")
        return info

    def refs_for_key(self, block_key: str) -> set[BlockRef]:
        return set(self._by_key.get(block_key, ()))

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
        from .startup import measure_read_rates

        await measure_read_rates(self, probe_octets, rounds)

    def health(self) -> list[dict[str, object]]:
        now = self.clock()
        return [
            {
                "tier": s.kind,
                "used": s.used,
                "capacity": s.capacity,
                "degraded": s.degraded_until > now,
                "failures": s.failures,
                "last_error": s.last_error,
            }
            for s in self.slots
        ]

    # --- writes --------------------------------------------------------

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
        if layer_digests is not None and len(layer_digests) == len(container):
            # Already taken by the caller as the octets arrived (the holder).
            table = {
                layer.index: (len(layer.k), len(layer.v), digest)
                for layer, digest in zip(container, layer_digests, strict=True)
            }
            hashing: asyncio.Future[dict[int, tuple[int, int, bytes]]] = asyncio.Future()
            hashing.set_result(table)
        else:
            hashing = asyncio.ensure_future(asyncio.to_thread(layer_table, container))
        # BL4: the Repr-Digest of the whole block, taken now (off the loop,
        # while the segments are written) so that no GET reads it twice.
        whole = asyncio.ensure_future(asyncio.to_thread(repr_digest_of, data))
        async with self._locked():
            try:
                if ref in self._blocks:
                    raise PreconditionFailed(f"block {ref.block_key} is already held")
                info = BlockInfo(ref, container.codec, container.token_count, {}, [])
                info.stored_at = self.wall_clock()
                try:
                    for first, last, slot in self._split(container):
                        if (first, last) == (container.first_layer, container.last_layer):
                            part: BytesLike = data  # the whole container: no copy
                        else:
                            part = container.slice(first, last).tobytes()
                        segment = await self._place(info, first, last, part, slot)
                        if self.write_through and not self.slots[segment.slot].tier.persistent:
                            await self._place_copy(info, segment, part)
                    info.layers = await hashing
                    info.whole_repr_digest = await whole
                    await self._sync_meta(info, strict=True)
                except BaseException:
                    await self._discard(info)
                    raise
            finally:
                await asyncio.gather(hashing, whole, return_exceptions=True)
            self._blocks[ref] = info
            self._by_key.setdefault(ref.block_key, set()).add(ref)
            self.stats.puts += 1
            return info

    def _split(self, container: kc.Container) -> list[tuple[int, int, int]]:
        first, last = container.first_layer, container.last_layer
        n = self.fast_layers
        if n is None or len(self.slots) < 2 or first >= n or last < n:
            return [(first, last, 0)]
        return [(first, n - 1, 0), (n, last, 1)]

    async def _place(
        self, info: BlockInfo, first: int, last: int, plain: BytesLike, start: int
    ) -> Segment:
        """Write a new segment in the first tier from ``start`` that can take it."""
        segment = await self._write_first(info, first, last, plain, range(start, len(self.slots)))
        self._attach(info, segment)
        return segment

    async def _place_copy(self, info: BlockInfo, segment: Segment, plain: BytesLike) -> None:
        """Write-through: a copy of a new segment in the first persistent tier
        below it that can take it; else the PUT fails (it would not be durable)."""
        below = [i for i in range(segment.slot + 1, len(self.slots))
                 if self.slots[i].tier.persistent]  # fmt: skip
        try:
            copy = await self._write_first(info, segment.first, segment.last, plain, below)
        except InsufficientStorage as exc:
            raise InsufficientStorage(f"write_through: {exc.detail}") from exc
        self._attach_copy(info, copy)

    async def _write_first(
        self, info: BlockInfo, first: int, last: int, plain: BytesLike, slots: Iterable[int]
    ) -> Segment:
        """Store layers ``first..last`` in the first of ``slots`` that can take
        them (making room there); the segment written, not yet attached."""
        errors: list[str] = []
        for index in slots:
            slot = self.slots[index]
            if slot.degraded_until > self.clock():
                errors.append(f"{slot.kind}: degraded")
                continue
            stored, crc = await self._stored_form(slot, info.ref, first, last, plain)
            size = len(memoryview(stored))
            if not await self._make_room(index, size, exclude=info.ref):
                errors.append(f"{slot.kind}: full")
                continue
            segment = Segment(info.ref, first, last, index, size, crc)
            try:
                await self._tier_call(slot, slot.tier.put(segment.key, stored))
            except (TierUnavailable, TierFull) as exc:
                errors.append(f"{slot.kind}: {exc.detail}")
                continue
            return segment
        raise InsufficientStorage(
            f"no tier can store layers {first}-{last} of {info.ref.block_key} ({'; '.join(errors)})"
        )

    def _attach(self, info: BlockInfo, segment: Segment) -> None:
        slot = self.slots[segment.slot]
        slot.used += segment.stored_octets
        slot.policy.add(segment.id)
        info.segments.append(segment)
        info.segments.sort(key=lambda s: s.first)

    def _detach(self, info: BlockInfo, segment: Segment) -> None:
        slot = self.slots[segment.slot]
        slot.used -= segment.stored_octets
        slot.policy.remove(segment.id)
        info.segments.remove(segment)

    def _attach_copy(self, info: BlockInfo, copy: Segment) -> None:
        slot = self.slots[copy.slot]
        slot.used += copy.stored_octets
        slot.policy.add(copy.id)
        info.copies.append(copy)

    def _detach_copy(self, info: BlockInfo, copy: Segment) -> None:
        slot = self.slots[copy.slot]
        slot.used -= copy.stored_octets
        slot.policy.remove(copy.id)
        info.copies.remove(copy)

    def _copy_of(self, info: BlockInfo, segment: Segment) -> Segment | None:
        """The persistent copy below ``segment`` (same layers), if one is kept."""
        return next((x for x in info.copies if (x.first, x.last) == (segment.first, segment.last)),
                    None)  # fmt: skip

    async def _drop_copy(self, info: BlockInfo, copy: Segment) -> None:
        """A tier needs the room of a copy: the faster tier above still serves it."""
        self._detach_copy(info, copy)
        await self._quiet_delete(self.slots[copy.slot], copy.key)
        await self._sync_meta(info)
        self.stats.copies_dropped += 1

    def _pinned(self, ref: BlockRef) -> bool:
        info = self._blocks.get(ref)
        return (info is not None and info.readers > 0) or self.leases.is_leased(ref)

    async def _make_room(self, index: int, need: int, exclude: BlockRef | None = None) -> bool:
        """Free ``need`` octets in tier ``index`` by demoting or evicting unpinned segments."""
        slot = self.slots[index]
        if need > slot.capacity:
            return False
        if slot.used + need <= slot.capacity:
            return True  # the common case: no walk over the eviction order
        for item in slot.policy.candidates():
            if slot.used + need <= slot.capacity:
                break
            ref, first = cast(tuple[BlockRef, int], item)
            if ref == exclude or self._pinned(ref):
                continue  # LE2: leased and in-flight blocks never move
            info = self._blocks.get(ref)
            if info is None:
                continue  # a block still being put: not a candidate yet
            segment = next((x for x in info.segments if x.first == first and x.slot == index), None)
            if segment is None:
                copy = next((x for x in info.copies if x.first == first and x.slot == index), None)
                if copy is not None:
                    await self._drop_copy(info, copy)
                continue
            if await self._demote(info, segment):
                continue
            if self._pinned(ref) or not self._current(info, segment):
                continue  # a reader or a lease arrived while we tried
            await self._evict(info, "capacity")
        return slot.used + need <= slot.capacity

    async def _demote(self, info: BlockInfo, segment: Segment, make_room: bool = True) -> bool:
        """Move a segment one step down the chain (skipping degraded tiers).

        True when the segment left its tier: moved, or dropped as lost.
        ``make_room``: demote or evict what is below to fit (else only free
        room is used).
        """
        src = self.slots[segment.slot]
        copy = self._copy_of(info, segment)
        if copy is not None and self.slots[copy.slot].degraded_until > self.clock():
            # Its tier is down: not a place to serve from; written anew below.
            await self._drop_copy(info, copy)
            copy = None
        if copy is not None:
            # Inclusive tiers: the copy below takes over, nothing is written.
            self._detach(info, segment)
            info.copies.remove(copy)
            info.segments.append(copy)
            info.segments.sort(key=lambda s: s.first)
            await self._quiet_delete(src, segment.key)
            await self._sync_meta(info)
            self.stats.demotions += 1
            return True
        now = self.clock()
        if all(s.degraded_until > now for s in self.slots[segment.slot + 1 :]):
            return False  # nowhere to go: not even worth reading it
        try:
            plain = await self._load(info, segment)
        except (TierUnavailable, CorruptData, NotFound):
            return not self._current(info, segment)
        for index in range(segment.slot + 1, len(self.slots)):
            dst = self.slots[index]
            if dst.degraded_until > self.clock():
                continue
            stored, crc = await self._stored_form(dst, info.ref, segment.first, segment.last, plain)
            size = len(memoryview(stored))
            if not make_room:
                if dst.used + size > dst.capacity:
                    continue
            elif not await self._make_room(index, size, exclude=info.ref):
                continue
            moved = Segment(info.ref, segment.first, segment.last, index, size, crc)
            try:
                # Written below before it is removed above: nothing is lost.
                await self._tier_call(dst, dst.tier.put(moved.key, stored))
            except (TierUnavailable, TierFull):
                continue
            if info.readers or not self._current(info, segment):
                # A read started, or the block went, while we copied: undo.
                await self._quiet_delete(dst, moved.key)
                return not self._current(info, segment)
            self._replace(info, segment, moved)
            await self._quiet_delete(src, segment.key)
            await self._sync_meta(info)
            self.stats.demotions += 1
            return True
        return False

    #: Promotions waiting or running at once; beyond, a hit is not promoted
    #: (dropped, not waited for: a GET never queues behind tier writes).
    MAX_PROMOTIONS = 4

    def _promote_later(self, info: BlockInfo, segments: list[tuple[Segment, BytesLike]]) -> None:
        """Copy a read's lower segments up in a background task, if few run."""
        if self._moves.stopped:
            return

        async def promote() -> None:
            for segment, plain in segments:
                await self._promote(info, segment, plain)

        # A hook reading a block it is told about must not set off more
        # evictions (and more hooks) by promoting it.
        if self._hooks_running or not self._moves.start(promote, "kvstore-promote"):
            self.stats.promotions_dropped += 1

    async def settle(self) -> None:
        """Wait for the background promotions started so far (tests)."""
        await self._moves.settle()

    async def _promote(self, info: BlockInfo, segment: Segment, plain: BytesLike) -> None:
        """Copy a segment read from a lower tier into the first tier (promotion on hit)."""
        async with self._locked():
            # Another read still walks the old location: moving it would pull
            # the segment out from under that read.
            # A hook reading a block it is told about must not set off more
            # evictions (and more hooks) by promoting it.
            if info.readers or self._hooks_running or not self._current(info, segment):
                return
            top = self.slots[0]
            if top.degraded_until > self.clock():
                return
            stored, crc = await self._stored_form(top, info.ref, segment.first, segment.last, plain)
            size = len(memoryview(stored))
            if not await self._make_room(0, size, exclude=info.ref):
                return
            moved = Segment(info.ref, segment.first, segment.last, 0, size, crc)
            try:
                await self._tier_call(top, top.tier.put(moved.key, stored))
            except (TierUnavailable, TierFull):
                return
            if info.readers or not self._current(info, segment):
                await self._quiet_delete(top, moved.key)
                return
            src = self.slots[segment.slot]
            if src.tier.persistent:
                # Inclusive: the persistent copy stays (and keeps its room
                # there) until that tier evicts it; the block stays durable.
                info.segments.remove(segment)
                info.copies.append(segment)
                self._attach(info, moved)
            else:
                self._replace(info, segment, moved)
                await self._quiet_delete(src, segment.key)
            await self._sync_meta(info)
            self.stats.promotions += 1

    def _current(self, info: BlockInfo, segment: Segment) -> bool:
        """The block is still this registered one and the segment still its own."""
        return self._blocks.get(info.ref) is info and segment in info.segments

    def _replace(self, info: BlockInfo, old: Segment, new: Segment) -> None:
        self._detach(info, old)
        self._attach(info, new)

    async def _evict(self, info: BlockInfo, reason: str) -> None:
        """Remove a whole block from the holder, notifying first (P3, LE4)."""
        if self._blocks.get(info.ref) is not info:
            return
        if self.on_evict is not None:
            self._hooks_running += 1
            try:
                await self.on_evict(info.ref, reason)
            except Exception:
                log.exception("eviction hook failed for %s", info.ref.block_key)
            finally:
                self._hooks_running -= 1
            if self._blocks.get(info.ref) is not info:
                return
        # Unregistered at once, with no await in between: a cancelled or
        # failing eviction never leaves a block registered without its data.
        segments = list(info.segments) + list(info.copies)
        for segment in info.segments[:]:
            self._detach(info, segment)
        for copy in info.copies[:]:
            self._detach_copy(info, copy)
        del self._blocks[info.ref]
        refs = self._by_key.get(info.ref.block_key)
        if refs is not None:
            refs.discard(info.ref)
            if not refs:
                del self._by_key[info.ref.block_key]
        self.leases.forget_block(info.ref)
        if reason == "capacity":
            self.stats.evictions += 1
        elif reason == "retention":
            self.stats.expired += 1
        else:
            self.stats.fault_evictions += 1
        log.info("evicted %s (%s)", info.ref.block_key, reason)
        await asyncio.shield(self._delete_segments(segments, info))

    async def _discard(self, info: BlockInfo) -> None:
        """Remove the segments of a block that was never registered (a failed put)."""
        segments = list(info.segments) + list(info.copies)
        for segment in info.segments[:]:
            self._detach(info, segment)
        for copy in info.copies[:]:
            self._detach_copy(info, copy)
        await asyncio.shield(self._delete_segments(segments, info))

    async def _delete_segments(self, segments: Sequence[Segment], info: BlockInfo) -> None:
        for segment in segments:
            await self._quiet_delete(self.slots[segment.slot], segment.key)
        await self._sync_meta(info)

    async def _sync_meta(self, info: BlockInfo, strict: bool = False) -> None:
        """Keep the block's layer table in each persistent tier that holds one of
        its segments, and nowhere else (a restart reads it back, see startup).

        ``strict`` (a new block): a table that cannot be written fails the
        put. The table carries the block's stored time (SEC4: a restart
        without it counts the block's age from then) and its layer
        digests, so a PUT is acknowledged only with it in place: a disk out
        of room after the segment went in is a 507, a tier gone a 503."""
        want = {
            x.slot for x in [*info.segments, *info.copies] if self.slots[x.slot].tier.persistent
        }
        for index in sorted(want - info.meta_slots):
            slot = self.slots[index]
            stored = self.sealer.seal(info.ref.meta_name, info.meta())
            try:
                await self._tier_call(slot, slot.tier.put(info.ref.meta_key, stored))
                info.meta_slots.add(index)
            except (TierUnavailable, TierFull) as exc:
                if strict:
                    what = f"the layer table of {info.ref.block_key} not stored in {slot.kind}"
                    if isinstance(exc, TierUnavailable):
                        raise TierUnavailable(f"{what}: {exc.detail}", tier=slot.kind) from exc
                    raise InsufficientStorage(f"{what}: {exc.detail}") from exc
                log.warning("layer table of %s not stored in %s: %s", info.ref.block_key,
                            slot.kind, exc.detail)  # fmt: skip
        for index in sorted(info.meta_slots - want):
            info.meta_slots.discard(index)
            await self._quiet_delete(self.slots[index], info.ref.meta_key)

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

        # Promotions are optional work: none may run after the spill, where
        # making room for one would evict what the spill kept.
        await self._moves.stop()
        return await spill(self, timeout_s)

    async def delete(self, ref: BlockRef) -> None:
        """Remove a block (an operator action); leased blocks are refused (LE2)."""
        async with self._locked():
            info = self.info(ref)
            if self._pinned(ref):
                raise PreconditionFailed(f"block {ref.block_key} is leased or being read")
            await self._evict(info, "deleted")

    # --- reads ---------------------------------------------------------

    def read(
        self, ref: BlockRef, first: int | None = None, last: int | None = None, *,
        count: bool = True,
    ) -> BlockRead:  # fmt: skip
        """Start a read of layers ``first..last`` (default: all held), BL1-BL2.
        ``count=False``: a probe (HEAD), neither a hit nor a use of the block."""
        info = self._blocks.get(ref)
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
            stored = await self._tier_call(slot, slot.tier.get(segment.key))
            if stored is not None:
                break
            if self._blocks.get(info.ref) is not info:
                raise NotFound(f"block {info.ref.block_key} is no longer held")
            if segment not in info.segments:
                moved = next((x for x in info.segments if x.first == segment.first), None)
                if moved is None:
                    raise NotFound(f"block {info.ref.block_key} is no longer held")
                segment = moved
                continue
            # The tier lost data it had acknowledged (restart, external eviction).
            await self._lost(info, f"{slot.kind} lost layers {segment.first}-{segment.last}")
            raise NotFound(f"block {info.ref.block_key} is no longer held")
        if not slot.tier.persistent:
            return stored
        checked = segment

        def check_and_open() -> BytesLike:
            if checked.crc is not None and zlib.crc32(stored) != checked.crc:
                raise CorruptData(
                    f"segment {checked.first}-{checked.last} of {info.ref.block_key} "
                    f"in {slot.kind} fails its checksum"
                )
            plain = self.sealer.open(info.ref.segment_name(checked.first, checked.last), stored)
            if self.verify_reads:
                info.verify_segment(checked, plain)
            return plain

        try:
            if len(memoryview(stored)) >= OFFLOAD_OCTETS:
                return await asyncio.to_thread(check_and_open)
            return check_and_open()
        except CorruptData:
            self.stats.integrity_failures += 1
            await self._lost(info, f"corrupt segment in {slot.kind}")
            raise

    async def _lost(self, info: BlockInfo, reason: str) -> None:
        """LE4: data a tier no longer holds leaves the holder, notified first."""
        async with self._locked():
            await self._evict(info, reason)

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """The store lock, re-entrant for the task holding it (an ``on_evict``
        hook may read the store; a demotion may find data lost)."""
        task = asyncio.current_task()
        if self._owner is task:
            yield
            return
        async with self._lock:
            self._owner = task
            try:
                yield
            finally:
                self._owner = None

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
        held = [
            (ref, self._blocks[ref].size)
            for key in dict.fromkeys(block_keys)
            for ref in self._by_key.get(key, ())
            if (allowed is None or allowed(ref)) and not self._expired(self._blocks[ref])
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
        from .startup import recover

        async with self._locked():
            found = await recover(self)
            now = self.wall_clock()
            for info in list(self._blocks.values()):
                if info.stored_at <= 0 or info.stored_at > now:
                    # No time kept (an older version, a lost table), or one
                    # from a clock ahead of ours: counted from now, and the
                    # table rewritten so that the next restart knows it.
                    info.stored_at = min(now, info.stored_at) if info.stored_at > 0 else now
                    info.meta_slots.clear()
                    await self._sync_meta(info)
            return found

    async def close(self) -> None:
        await self._moves.stop()
        for slot in self.slots:
            await slot.tier.close()

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
