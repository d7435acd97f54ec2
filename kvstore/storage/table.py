"""The block table: which blocks the store has, in which state, and what each
tier's room is spent on. The one owner of those maps and of every
:class:`.BlockInfo` it holds (STYLE 15): the PUT, reads, placement,
retention, the spill and recovery change them only through these methods,
each of which keeps the invariants below without awaiting anything.

Invariants, at every moment between two awaits:

* a block's entry is in ``_entries`` from its PUT (WRITING) until it is GONE;
  ``_by_key`` lists exactly the RESIDENT ones (leases and lookups see only those);
* a tier's ``used`` is the octets of the segments and copies attached to it
  plus its ``reserved`` octets; a write reserves before its I/O
  (:meth:`reserve`, a check and a take with no await between), so two writes
  never count on the same room; at quiescence ``reserved`` is 0;
* every attached segment or copy is in its tier's eviction order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from .records import RANGE_DIGESTS_KEPT, BlockInfo, Segment, TierSlot
from .state import HELD, SERVING, BlockState, Event, advance
from .types import BlockRef


class BlockTable:
    def __init__(self, slots: list[TierSlot]) -> None:
        self.slots = slots
        self._entries: dict[BlockRef, BlockInfo] = {}
        self._by_key: dict[str, set[BlockRef]] = {}
        #: Each scope's blocks held (stored or adopted, not leaving) and
        #: their KV octets: [blocks, octets] (a tenant's usage, /metrics).
        self._scopes: dict[str, list[int]] = {}

    # --- lookups (RESIDENT unless said otherwise) -------------------------

    def entry(self, ref: BlockRef) -> BlockInfo | None:
        """The block's entry in any state (None: absent or gone)."""
        return self._entries.get(ref)

    def serving(self, ref: BlockRef) -> BlockInfo | None:
        info = self._entries.get(ref)
        return info if info is not None and info.state in SERVING else None

    def held(self, ref: BlockRef) -> bool:
        info = self._entries.get(ref)
        return info is not None and info.state in HELD

    def current(self, info: BlockInfo) -> bool:
        """``info`` is still the table's entry for its reference, and serving."""
        return self._entries.get(info.ref) is info and info.state in SERVING

    def __iter__(self) -> Iterator[BlockInfo]:
        return iter([i for i in self._entries.values() if i.state in SERVING])

    def __len__(self) -> int:
        return sum(len(refs) for refs in self._by_key.values())

    def states(self) -> dict[BlockState, int]:
        """How many blocks are in each state but GONE (metrics)."""
        counts = dict.fromkeys((BlockState.WRITING, BlockState.RESIDENT, BlockState.LEAVING), 0)
        for info in self._entries.values():
            if info.state in counts:
                counts[info.state] += 1
        return counts

    def refs_for_key(self, block_key: str) -> set[BlockRef]:
        return set(self._by_key.get(block_key, ()))

    def scope_usage(self) -> dict[str, tuple[int, int]]:
        """Each scope's (blocks, KV octets) held (metrics: a tenant's usage)."""
        return {scope: (n, octets) for scope, (n, octets) in self._scopes.items()}

    def _counted(self, info: BlockInfo, sign: int) -> None:
        if sign > 0:
            info.counted_octets = info.kv_octets  # what leaving takes off again
        usage = self._scopes.setdefault(info.ref.scope_id, [0, 0])
        usage[0] += sign
        usage[1] += sign * info.counted_octets
        if usage[0] <= 0:
            del self._scopes[info.ref.scope_id]

    # --- lifecycle (the transitions of .state) ----------------------------

    def begin(self, info: BlockInfo) -> None:
        """A PUT starts storing ``info`` (WRITING); the caller checked there
        is no entry for its reference."""
        assert info.ref not in self._entries, "one entry per reference"
        info.state = advance(info.state, Event.PUT)
        self._entries[info.ref] = info

    def adopt(self, info: BlockInfo) -> None:
        """A block found in a persistent tier at start (RESIDENT), whole;
        the caller checked there is no entry for its reference."""
        assert info.ref not in self._entries, "one entry per reference"
        info.state = advance(info.state, Event.RECOVERED)
        self._entries[info.ref] = info
        self._by_key.setdefault(info.ref.block_key, set()).add(info.ref)
        self._counted(info, 1)

    def stored(self, info: BlockInfo) -> None:
        """The PUT is acknowledged: served, leasable, movable from now on."""
        info.state = advance(info.state, Event.STORED)
        self._by_key.setdefault(info.ref.block_key, set()).add(info.ref)
        self._counted(info, 1)
        self._settle(info)

    def failed(self, info: BlockInfo) -> list[Segment]:
        """The PUT failed and what it wrote is deleted: unaccounted for, and a
        PUT of the same reference waiting for it may go on."""
        info.state = advance(info.state, Event.FAILED)
        return self._drop(info)

    def leave(self, info: BlockInfo) -> None:
        """Removal starts: no new read or lease from now on (its data stays
        until :meth:`deleted`)."""
        info.state = advance(info.state, Event.LEAVE)
        self._counted(info, -1)
        refs = self._by_key.get(info.ref.block_key)
        if refs is not None:
            refs.discard(info.ref)
            if not refs:
                del self._by_key[info.ref.block_key]

    def deleted(self, info: BlockInfo) -> list[Segment]:
        """The data is deleted from the tiers: every segment and copy is
        unaccounted for, and a PUT of the same reference may go on."""
        info.state = advance(info.state, Event.DELETED)
        return self._drop(info)

    def unregister(self, info: BlockInfo) -> None:
        """Recovery gives up a block it could not complete (never adopted):
        the room its segments were counted in is given back."""
        assert self._entries.get(info.ref) is not info, "an adopted block leaves by eviction"
        self._drop(info)

    async def settled(self, info: BlockInfo) -> None:
        """Wait until ``info`` is neither WRITING nor LEAVING."""
        while info.state in (BlockState.WRITING, BlockState.LEAVING):
            if info.settled is None:
                info.settled = asyncio.get_running_loop().create_future()
            await asyncio.shield(info.settled)

    def _settle(self, info: BlockInfo) -> None:
        if info.settled is not None and not info.settled.done():
            info.settled.set_result(None)
        info.settled = None

    def _drop(self, info: BlockInfo) -> list[Segment]:
        parts = [*info.segments, *info.copies]
        for segment in info.segments[:]:
            self.detach(info, segment)
        for copy in info.copies[:]:
            self.detach_copy(info, copy)
        info.meta_slots.clear()
        if self._entries.get(info.ref) is info:
            del self._entries[info.ref]
        self._settle(info)
        return parts

    # --- what is known of a block -----------------------------------------

    def hashed(
        self, info: BlockInfo, layers: dict[int, tuple[int, int, bytes]], whole: str
    ) -> None:
        """A PUT's digests are in: its layer table (B3) and the whole
        container's Repr-Digest (BL4), both taken from the octets sent."""
        info.layers = layers
        info.whole_repr_digest = whole

    @contextlib.contextmanager
    def reading(self, info: BlockInfo) -> Iterator[None]:
        """A read of the block is under way: it pins the block (LE2)."""
        info.readers += 1
        try:
            yield
        finally:
            info.readers -= 1

    def keep_repr_digest(self, info: BlockInfo, first: int, last: int, value: str) -> None:
        """Keep the Repr-Digest of layers ``first..last`` as served (BL4), so
        that the next read of them hashes nothing."""
        if (first, last) == (info.first_layer, info.last_layer):
            info.whole_repr_digest = value
            return
        # Engines ask for the same few ranges (their layer split) again and
        # again; keep a handful per block so those GETs hash nothing either.
        if len(info.range_digests) >= RANGE_DIGESTS_KEPT:
            info.range_digests.pop(next(iter(info.range_digests)))
        info.range_digests[(first, last)] = value

    def meta_stored(self, info: BlockInfo, index: int) -> None:
        """Tier ``index`` holds the block's layer table now."""
        info.meta_slots.add(index)

    def meta_dropped(self, info: BlockInfo, index: int) -> None:
        """Tier ``index`` does not hold the block's layer table (any more)."""
        info.meta_slots.discard(index)

    def restamp(self, info: BlockInfo, stored_at: float) -> None:
        """Recovery found no usable stored time: counted from ``stored_at``,
        and every layer table is to be written again with it."""
        info.stored_at = stored_at
        info.meta_slots.clear()

    def partial(self, info: BlockInfo) -> None:
        """Recovery kept only some of the block's layers: the whole block's
        Repr-Digest is not that of what it now serves."""
        info.whole_repr_digest = None

    def unchecked(self, info: BlockInfo, segment: Segment) -> bool:
        """The segment was adopted at a restart unread: its first read checks it whole."""
        return (segment.slot, segment.first) in info.unchecked

    def checked(self, info: BlockInfo, segment: Segment) -> None:
        """The segment was read and checked whole against the layer table."""
        info.unchecked.discard((segment.slot, segment.first))

    # --- room ------------------------------------------------------------

    def reserve(self, index: int, octets: int) -> bool:
        """Take ``octets`` of tier ``index``'s free room for a write, if it has them."""
        slot = self.slots[index]
        if slot.used + octets > slot.capacity:
            return False
        slot.used += octets
        slot.reserved += octets
        return True

    def unreserve(self, index: int, octets: int) -> None:
        """A write that reserved room did not happen."""
        slot = self.slots[index]
        slot.used -= octets
        slot.reserved -= octets
        self._freed(slot)

    async def room_freed(self, index: int, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until tier ``index`` frees some room."""
        waiter = asyncio.get_running_loop().create_future()
        slot = self.slots[index]
        slot.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                slot.waiters.remove(waiter)

    def _freed(self, slot: TierSlot) -> None:
        for waiter in slot.waiters:
            if not waiter.done():
                waiter.set_result(None)
        slot.waiters.clear()

    # --- segments and copies ---------------------------------------------

    def attach(self, info: BlockInfo, segment: Segment) -> None:
        """A segment written into room reserved for it serves the block."""
        slot = self.slots[segment.slot]
        slot.reserved -= segment.stored_octets
        slot.policy.add(segment.id)
        info.segments.append(segment)
        info.segments.sort(key=lambda s: s.first)

    def attach_copy(self, info: BlockInfo, copy: Segment) -> None:
        """A copy written into room reserved for it is kept below (inclusive tiers)."""
        slot = self.slots[copy.slot]
        slot.reserved -= copy.stored_octets
        slot.policy.add(copy.id)
        info.copies.append(copy)

    def found(
        self, info: BlockInfo, segment: Segment, copy: bool = False, unchecked: bool = False
    ) -> None:
        """Recovery: a segment (or copy) already in a tier, counted from now;
        ``unchecked``: adopted unread, its first read checks it whole."""
        self.slots[segment.slot].used += segment.stored_octets
        self.slots[segment.slot].reserved += segment.stored_octets
        (self.attach_copy if copy else self.attach)(info, segment)
        if unchecked:
            info.unchecked.add((segment.slot, segment.first))

    def detach(self, info: BlockInfo, segment: Segment) -> None:
        info.segments.remove(segment)
        self._unaccount(segment)

    def detach_copy(self, info: BlockInfo, copy: Segment) -> None:
        info.copies.remove(copy)
        self._unaccount(copy)

    def _unaccount(self, part: Segment) -> None:
        slot = self.slots[part.slot]
        slot.used -= part.stored_octets
        slot.policy.remove(part.id)
        self._freed(slot)

    def replace(self, info: BlockInfo, old: Segment, new: Segment) -> None:
        """A move: ``new`` (written into reserved room) serves ``old``'s layers."""
        self.detach(info, old)
        self.attach(info, new)

    def keep_as_copy(self, info: BlockInfo, old: Segment, new: Segment) -> None:
        """A promotion out of a persistent tier: ``new`` serves, ``old`` stays
        below as a copy (and keeps its room there)."""
        info.segments.remove(old)
        info.copies.append(old)
        self.attach(info, new)

    def copy_takes_over(self, info: BlockInfo, segment: Segment, copy: Segment) -> None:
        """A demotion onto a kept copy: nothing is written, the copy serves."""
        self.detach(info, segment)
        info.copies.remove(copy)
        info.segments.append(copy)
        info.segments.sort(key=lambda s: s.first)

    def copy_of(self, info: BlockInfo, segment: Segment) -> Segment | None:
        """The persistent copy below ``segment`` (same layers), if one is kept."""
        span = (segment.first, segment.last)
        return next((x for x in info.copies if (x.first, x.last) == span), None)

    def accounting(self) -> tuple[list[int], list[int]]:
        """(each tier's ``used``, what its attached segments and copies and its
        reservations add up to): equal at every moment between awaits."""
        expected = [slot.reserved for slot in self.slots]
        for info in self._entries.values():
            for part in [*info.segments, *info.copies]:
                expected[part.slot] += part.stored_octets
        return [slot.used for slot in self.slots], expected
