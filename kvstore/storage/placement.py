"""Where segments go and how they move: place, make room, demote, promote,
evict. The store's placement policy, in one class (STYLE 5).

No store-wide lock is held across tier I/O. A write takes its room with
:meth:`.BlockTable.reserve` (a check and a take with no await between), does
its I/O, then commits (attaches the segment) or gives the room back. Moves and
the removal of a block are serialized by that block's :class:`.Claim`; the
walk that makes room skips a claimed block instead of waiting on it, so
unrelated PUTs and GETs never wait on each other's tier I/O. Rules, with the
requirement they serve:

* a block under an unexpired lease, or being read, is never picked to make
  room (LE2); a put that could only make room by evicting leased data goes
  to a lower tier, or fails with :class:`InsufficientStorage`;
* eviction marks the block LEAVING (no new read or lease), awaits
  the store's ``evicting`` event so the holder withdraws it from the Index Service (P3), then
  deletes it; data lost to a fault leaves the same way, leased or not (LE4);
* tiers are inclusive below memory: a promotion copies a segment up and the
  persistent tier keeps its copy until it needs the room; a demotion onto a
  kept copy writes nothing;
* promotions are optional work: in the background, bounded, dropped when the
  bound is reached or the block is busy, and they never wait for room;
* tiers above the last keep headroom on their own (watermarks: drained in
  the background), and a PUT never waits for a demotion: one that finds
  such a tier full goes to the tier below (see :meth:`Placement.make_room`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, cast

from ..logs import Tally
from ..protocol._bytes import BytesLike
from ..protocol.problems import InsufficientStorage, NotFound
from .core import StoreCore
from .errors import TierFull, TierUnavailable
from .loader import SegmentLoader, SegmentLost
from .moves import Moves
from .records import BlockInfo, Segment
from .reservation import Reservation
from .state import BlockState
from .types import BlockRef

log = logging.getLogger("kvstore.storage")


class Demotion(enum.Enum):
    """How a :meth:`Placement.demote` ended."""

    #: The segment left its tier: moved below, or dropped as lost.
    LEFT = "left"
    #: A read or a lease came while it was copied (LE2): undone, the block
    #: stays where it is (not a reason to evict it).
    STAYED = "stayed"
    #: No tier below could take it.
    NO_ROOM = "no room"


class Placement:
    #: Promotions waiting or running at once; beyond, a hit is not promoted
    #: (dropped, not waited for: a GET never queues behind tier writes).
    MAX_PROMOTIONS = 4
    #: Longest a write waits for room that moves under way will free before
    #: it counts the tier full. A safety net: those moves end within their
    #: tiers' deadlines, and two chains of demotions that each wait for the
    #: other's room (possible with blocks split over tiers) end here.
    ROOM_WAIT_S = 5.0
    ROOM_POLL_S = 0.05

    def __init__(self, core: StoreCore, loader: SegmentLoader) -> None:
        self.core, self.loader = core, loader
        self.table = core.table
        self.io = core.io
        self.slots = core.slots
        self.stats = core.stats
        self.moves = Moves(self.MAX_PROMOTIONS)
        #: Eviction hooks under way: a read they make does not promote
        #: (more promotions would set off more evictions, and more hooks).
        self.hooks_running = 0
        #: Background demotion: one drain at a time per tier (see after_write).
        self.drains = Moves(len(self.slots))
        self._draining: set[int] = set()
        #: Work finishing a change the table already made (deleting the old
        #: place, the layer tables, a removal), each in a task of its own so
        #: that a cancelled caller never leaves it half done.
        self.finishing: set[asyncio.Future[None]] = set()
        #: Blocks a tier lost, logged with a count per tier every 10 s.
        self.losses = Tally(
            log,
            "tier %s no longer holds the segments of %d block(s) it had acknowledged"
            " (restarted without its data, flushed or corrupted outside kvstore?);"
            " they were withdrawn and evicted (LE4)",
        )

    async def settle(self) -> None:
        """Wait for the background moves started so far and for the work
        finishing changes already made (which nothing cancels)."""
        await self.moves.settle()
        await self.drains.settle()
        await self._finished()

    async def stop(self) -> None:
        """No background move starts from now on; those under way are
        cancelled; the work finishing changes already made still ends."""
        await self.moves.stop()
        await self.drains.stop()
        await self._finished()
        self.losses.flush()  # the count of the last window's losses

    async def _finished(self) -> None:
        while self.finishing:
            await asyncio.gather(*self.finishing, return_exceptions=True)

    async def _finish(self, work: Coroutine[Any, Any, None], hold: bool = True) -> None:
        """Run ``work`` in a tracked task and wait for it. A cancel of the
        caller does not cancel the work: an old place left behind would be
        an orphan that a restart adopts, a deleted block coming back.

        ``hold`` (a move's clean-up, an undone write): the caller waits for
        the work even when it is cancelled meanwhile (the cancel is raised
        once the work is done), since it holds the block's claim (or its
        WRITING state) until then; else another move could write the place
        this work deletes, and lose it. The work is tier calls, each bounded
        by its tier's deadline. A removal does not hold: its LEAVING entry
        keeps a new incarnation out until its deletes are done."""
        task = asyncio.ensure_future(work)
        self.finishing.add(task)
        task.add_done_callback(self.finishing.discard)
        cancelled = False
        while True:
            try:
                await asyncio.shield(task)
                break
            except asyncio.CancelledError:
                if task.done() or not hold:
                    raise  # the work itself was cancelled, or no claim to keep
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _reserved(self, index: int, octets: int) -> Reservation:
        """The write protocol for room already taken in tier ``index``."""
        return Reservation(self.table, self.io, index, octets, self._undo)

    async def _undo(self, index: int, *keys: str) -> None:
        """A write was cancelled under way: it may have landed, or still land
        (a thread, a request sent). Delete what it wrote, once it has, before
        the caller lets go of the block (its claim, or its WRITING state), so
        that no newer write of those keys can come between."""
        await self._finish(self._clean(None, *((index, key) for key in keys)))

    async def _clean(self, info: BlockInfo | None, *old: tuple[int, str]) -> None:
        """Delete what the table no longer counts (tier index, key), then keep
        the block's layer tables where its segments are."""
        for index, key in old:
            await self.io.delete_quietly(self.slots[index], key)
        if info is not None:
            await self.sync_meta(info)

    def holds(self, info: BlockInfo, segment: Segment) -> bool:
        """The block is still this serving one and the segment still its own."""
        return self.table.current(info) and segment in info.segments

    # --- writes ----------------------------------------------------------

    async def place(
        self, info: BlockInfo, first: int, last: int, plain: BytesLike, start: int
    ) -> Segment:
        """Write a new segment in the first tier from ``start`` that can take it."""
        segment = await self.write_first(
            info, first, last, plain, range(start, len(self.slots)), hurry=True
        )
        self.table.attach(info, segment)
        self.after_write(segment.slot)
        return segment

    async def place_copy(self, info: BlockInfo, segment: Segment, plain: BytesLike) -> None:
        """Write-through: a copy of a new segment in the first persistent tier
        below it that can take it; else the PUT fails (it would not be durable)."""
        below = [
            i for i in range(segment.slot + 1, len(self.slots)) if self.slots[i].tier.persistent
        ]
        try:
            copy = await self.write_first(info, segment.first, segment.last, plain, below)
        except InsufficientStorage as exc:
            raise InsufficientStorage(f"write_through: {exc.detail}") from exc
        self.table.attach_copy(info, copy)

    async def write_first(
        self,
        info: BlockInfo,
        first: int,
        last: int,
        plain: BytesLike,
        slots: Iterable[int],
        hurry: bool = False,
    ) -> Segment:
        """Store layers ``first..last`` in the first of ``slots`` that can take
        them (making room there); the segment written into reserved room, for
        the caller to attach with no await in between. ``hurry`` (a PUT): a
        tier that drains in the background is not made room in by this
        write; see :meth:`make_room`."""
        errors: list[str] = []
        for index in slots:
            slot = self.slots[index]
            if self.io.degraded(index):
                errors.append(f"{slot.kind}: degraded")
                continue
            stored = await self.io.stored_form(slot, info.ref, first, last, plain)
            size = len(memoryview(stored))
            if not await self.make_room(index, size, exclude=info.ref, hurry=hurry):
                errors.append(f"{slot.kind}: full")
                continue
            segment = Segment(info.ref, first, last, index, size)
            async with self._reserved(index, size) as room:
                if await room.write([(segment.key, stored)]):
                    room.keep()
                    return segment
                errors.append(cast(str, room.refused))
        raise InsufficientStorage(
            f"no tier can store layers {first}-{last} of {info.ref.block_key} ({'; '.join(errors)})"
        )

    # --- room ------------------------------------------------------------

    async def make_room(
        self,
        index: int,
        need: int,
        exclude: BlockRef | None = None,
        wait: bool = True,
        hurry: bool = False,
    ) -> bool:
        """Reserve ``need`` octets in tier ``index``, demoting or evicting
        unpinned segments for them. False when that cannot be done: then
        nothing is reserved. ``wait``: when only moves under way could free
        the room, wait for them (a little); promotions do not.

        ``hurry`` (a PUT): in a tier that drains in the background
        (watermarks on, a tier below), move no victim and wait for none: take
        free room, else False (the drain is started), and the PUT goes to the
        next tier below at once. The PUTs' tails are then those of the tier
        that takes them, not of a queue of demotions. (Waiting up to 20 ms
        for the drain's room measured worse: PUT p99 at 16 clients 2.0-2.6x
        host-only's, against 1.7-2.0x at once.)"""
        slot = self.slots[index]
        if need > slot.capacity:
            return False
        if hurry and self.drains_in_background(index):
            return self._room_from_drain(index, need)
        give_up_at = None  # ROOM_WAIT_S in all, however many wake-ups
        while not self.table.reserve(index, need):
            victim, busy = self._victim(index, exclude)
            if victim is None:
                now = asyncio.get_running_loop().time()
                give_up_at = give_up_at or now + self.ROOM_WAIT_S
                if not (wait and busy) or now >= give_up_at:
                    return False
                # Woken when room is freed; and the walk is tried again every
                # ROOM_POLL_S, since a busy block may become a candidate with
                # no room freed (a promotion leaves a copy behind).
                await self.table.room_freed(index, min(self.ROOM_POLL_S, give_up_at - now))
                continue
            info, part = victim
            try:
                if part in info.copies:
                    await self.drop_copy(info, part)
                    continue
                moved = await self.demote(info, part, wait=wait)
                if moved is Demotion.STAYED:
                    continue  # a read or a lease came meanwhile: it stays, next victim
                if moved is Demotion.NO_ROOM:
                    if self.table.reserve(index, need):
                        return True  # room came free meanwhile: nothing evicted for it
                    if self.holds(info, part):
                        # Nowhere below can take it: it leaves the holder.
                        await self.evict(info, "capacity", unless_pinned=True)
            finally:
                info.claim.give()
        return True

    def _victim(
        self, index: int, exclude: BlockRef | None
    ) -> tuple[tuple[BlockInfo, Segment] | None, bool]:
        """The first segment or copy of tier ``index`` that may leave it, its
        block claimed; and whether some were skipped for being moved already."""
        busy = False
        for item in self.slots[index].policy.candidates():
            ref, first = cast(tuple[BlockRef, int], item)
            info = self.table.serving(ref)
            if ref == exclude:
                continue
            if info is None:
                # Not a candidate: being put, or leaving (its room comes free
                # once its withdrawal and deletes are done).
                entry = self.table.entry(ref)
                busy = busy or (entry is not None and entry.state is BlockState.LEAVING)
                continue
            if info.claim.taken:
                # Moved or removed by another task: its room may come free.
                # (One this task claimed higher up the chain is not waited for.)
                busy = busy or not info.claim.owned
                continue
            if self.core.pinned(ref):
                continue  # LE2: leased and in-flight blocks never move
            part = next(
                (x for x in [*info.segments, *info.copies] if x.first == first and x.slot == index),
                None,
            )
            if part is not None and info.claim.try_take():
                return (info, part), busy
        return None, busy

    async def drop_copy(self, info: BlockInfo, copy: Segment) -> None:
        """A tier needs the room of a copy: the faster tier above still serves it."""
        self.table.detach_copy(info, copy)
        self.stats.copies_dropped += 1
        await self._finish(self._clean(info, (copy.slot, copy.key)))

    # --- background demotion ---------------------------------------------

    def drains_in_background(self, index: int) -> bool:
        """Tier ``index`` keeps headroom on its own: watermarks on, a tier below."""
        return self.core.settings.high_watermark is not None and index < len(self.slots) - 1

    def after_write(self, index: int, need: int = 0) -> None:
        """Once tier ``index`` (above the last) is fuller than the store's
        high watermark (``demote_above``), or too full for a write of
        ``need`` octets, demote its least recently used segments in the
        background down to the low watermark (``demote_to``), so that the next
        PUTs find free room rather than move a victim down first. Off when
        ``demote_above`` is None."""
        if not self.drains_in_background(index) or index in self._draining:
            return
        slot = self.slots[index]
        above = cast(float, self.core.settings.high_watermark)
        if slot.used <= above * slot.capacity and slot.used + need <= slot.capacity:
            return
        self._draining.add(index)
        if not self.drains.start(lambda: self._drain(index), f"kvstore-demote-{slot.kind}"):
            self._draining.discard(index)

    def _room_from_drain(self, index: int, need: int) -> bool:
        """A PUT's room in a tier that drains: free now, or none (the drain
        started for the next PUTs); never a victim moved by the PUT."""
        if self.table.reserve(index, need):
            self.after_write(index)
            return True
        self.after_write(index, need)
        self.stats.puts_fell_through += 1
        return False

    async def _drain(self, index: int) -> None:
        slot = self.slots[index]
        try:
            while slot.used > self.core.settings.low_watermark * slot.capacity:
                victim, _ = self._victim(index, None)
                if victim is None:
                    return  # all pinned or moving: the PUTs make room as before
                info, part = victim
                try:
                    if part in info.copies:
                        await self.drop_copy(info, part)
                    elif await self.demote(info, part, wait=False) is not Demotion.LEFT:
                        return  # no room below without waiting, or pinned: later
                finally:
                    info.claim.give()
        finally:
            self._draining.discard(index)

    # --- moves -----------------------------------------------------------

    async def demote(
        self,
        info: BlockInfo,
        segment: Segment,
        make_room: bool = True,
        wait: bool = True,
        pinned_ok: bool = False,
    ) -> Demotion:
        """Move a segment one step down the chain (skipping degraded tiers);
        the caller holds the block's claim. See :class:`Demotion` for how it
        ends. ``make_room``: demote or evict what is below to fit (else only free
        room is used). ``pinned_ok``: a lease arriving meanwhile does not stop
        it (the spill at a graceful stop, which keeps the block).
        """
        copy = self.table.copy_of(info, segment)
        if copy is not None and self.io.degraded(copy.slot):
            # Its tier is down: not a place to serve from; written anew below.
            await self.drop_copy(info, copy)
            copy = None
        if copy is not None:
            # Inclusive tiers: the copy below takes over, nothing is written.
            self.table.copy_takes_over(info, segment, copy)
            self.stats.demotions += 1
            await self._finish(self._clean(info, (segment.slot, segment.key)))
            return Demotion.LEFT
        below = range(segment.slot + 1, len(self.slots))
        if all(self.io.degraded(i) for i in below):
            return Demotion.NO_ROOM  # nowhere to go: not even worth reading it
        try:
            plain = await self.loader.load(info, segment)
        except SegmentLost as lost:
            await self.lost(info, lost)  # LE4: it leaves, withdrawn first
            return Demotion.LEFT
        except (TierUnavailable, NotFound):
            return Demotion.NO_ROOM if self.holds(info, segment) else Demotion.LEFT
        for index in below:
            dst = self.slots[index]
            if self.io.degraded(index):
                continue
            stored = await self.io.stored_form(dst, info.ref, segment.first, segment.last, plain)
            size = len(memoryview(stored))
            if make_room:
                if not await self.make_room(index, size, exclude=info.ref, wait=wait):
                    continue
            elif not self.table.reserve(index, size):
                continue
            moved = Segment(info.ref, segment.first, segment.last, index, size)
            items = [(moved.key, stored)]
            if dst.tier.persistent and index not in info.meta_slots:
                # The layer table goes with the segment, in one batch call
                # (one LMDB transaction, one fsync; one Redis pipeline).
                items.append(
                    (info.ref.meta_key, self.io.sealer.seal(info.ref.meta_name, info.meta()))
                )
            async with self._reserved(index, size) as room:
                # Written below before it is removed above: nothing is lost.
                if not await room.write(items):
                    continue
                if len(items) > 1:
                    self.table.meta_stored(info, index)
                undone = (
                    info.readers
                    or (not pinned_ok and self.core.pinned(info.ref))
                    or not self.holds(info, segment)
                )
                if not undone:
                    room.keep()
                    self.table.replace(info, segment, moved)
            if not undone:
                self.stats.demotions += 1
                await self._finish(self._clean(info, (segment.slot, segment.key)))
                return Demotion.LEFT
            # A read or a lease started (LE2), or the block went, while we
            # copied: undone (the layer table goes with the next sync).
            if self.holds(info, segment):
                await self._finish(self._clean(info, (index, moved.key)))
                return Demotion.STAYED
            # Gone: its removal may have run before the table went in.
            self.table.meta_dropped(info, index)
            await self._finish(self._clean(None, *((index, key) for key, _ in items)))
            return Demotion.LEFT
        return Demotion.NO_ROOM

    def promote_later(self, info: BlockInfo, segments: list[tuple[Segment, BytesLike]]) -> None:
        """Copy a read's lower segments up in a background task, if few run."""
        if self.moves.stopped:
            return

        async def promote() -> None:
            for segment, plain in segments:
                await self.promote(info, segment, plain)

        if self.hooks_running or not self.moves.start(promote, "kvstore-promote"):
            self.stats.promotions_dropped += 1

    async def promote(self, info: BlockInfo, segment: Segment, plain: BytesLike) -> None:
        """Copy a segment read from a lower tier into the first tier (promotion
        on hit). Optional work: dropped if the block is busy or there is no
        room without waiting for it."""
        if self.hooks_running or not info.claim.try_take():
            self.stats.promotions_dropped += 1
            return
        try:
            top = self.slots[0]
            if not self.holds(info, segment) or self.io.degraded(0):
                return
            stored = await self.io.stored_form(top, info.ref, segment.first, segment.last, plain)
            size = len(memoryview(stored))
            if not await self.make_room(0, size, exclude=info.ref, wait=False):
                self.stats.promotions_dropped += 1
                return
            moved = Segment(info.ref, segment.first, segment.last, 0, size)
            # Inclusive: a persistent copy stays (and keeps its room there)
            # until that tier evicts it; the block stays durable.
            persistent = self.slots[segment.slot].tier.persistent
            async with self._reserved(0, size) as room:
                if not await room.write([(moved.key, stored)]):
                    return
                if self.holds(info, segment):
                    room.keep()
                    # A read of the old place that is still under way finds
                    # its segment moved and follows it (SegmentLoader.load).
                    keep = self.table.keep_as_copy if persistent else self.table.replace
                    keep(info, segment, moved)
            if not room.kept:  # gone while it was copied
                await self._finish(self._clean(None, (0, moved.key)))
                return
            self.stats.promotions += 1
            self.after_write(0)
            old = () if persistent else ((segment.slot, segment.key),)
            await self._finish(self._clean(info, *old))
        finally:
            info.claim.give()

    # --- removal ---------------------------------------------------------

    async def evict(self, info: BlockInfo, reason: str, unless_pinned: bool = False) -> bool:
        """Remove a whole block from the holder: LEAVING, withdrawn by the
        ``evicting`` listeners (P3, LE4), then deleted. ``unless_pinned``: not if a
        lease or a read now pins it (LE2). True if it went."""
        await info.claim.take()
        try:
            if not self.table.current(info) or (unless_pinned and self.core.pinned(info.ref)):
                return False
            self.table.leave(info)
            # The withdrawal and the removal run in one task of their own: a
            # cancelled caller (a client gone, a PUT given up) never cuts the
            # withdrawal short nor leaves a LEAVING block behind (P3).
            await self._finish(self._leave(info, reason), hold=False)
            return True
        finally:
            info.claim.give()

    async def _leave(self, info: BlockInfo, reason: str) -> None:
        self.hooks_running += 1
        try:
            await self.core.events.evicting(info.ref, reason)  # P3: withdrawn before it goes
        finally:
            self.hooks_running -= 1
        self.core.leases.forget_block(info.ref)
        self._count(reason)
        # One line per block at DEBUG (counted in kvstore_store_evictions); a
        # tier's losses are one WARNING with a count (lost(), below).
        log.debug("evicted %s (%s)", info.ref.block_key, reason)
        await self._remove(info, self.table.deleted)

    def _count(self, reason: str) -> None:
        if reason == "capacity":
            self.stats.evictions += 1
        elif reason == "retention":
            self.stats.expired += 1
        elif reason != "deleted":  # a client's DELETE is not an eviction
            self.stats.fault_evictions += 1

    async def lost(self, info: BlockInfo, lost: SegmentLost) -> None:
        """LE4: data a tier no longer holds (or holds corrupt) leaves the
        holder, notified first. A tier that lost many (a Redis restarted
        without persistence) is one WARNING with a count, not a line each."""
        self.losses(lost.tier, lost.reason)
        await self.evict(info, lost.reason)

    async def discard(self, info: BlockInfo) -> None:
        """Remove the segments of a PUT that failed (never acknowledged)."""
        await self._finish(self._remove(info, self.table.failed), hold=False)

    async def _remove(self, info: BlockInfo, settle: Callable[[BlockInfo], object]) -> None:
        """Delete a block's data from its tiers, then ``settle`` it in the table
        (GONE). In that order: a PUT of the same reference waits for it to
        settle, and the keys it writes are these (a delete that came after it
        would take its data)."""
        keys: dict[int, list[str]] = {}
        for part in [*info.segments, *info.copies]:
            keys.setdefault(part.slot, []).append(part.key)
        # The layer table also wherever a segment is persistent: a PUT's write
        # of it cut short may still land, and the delete waits for it (TierIO).
        for index in sorted(info.meta_slots | {i for i in keys if self.slots[i].tier.persistent}):
            keys.setdefault(index, []).append(info.ref.meta_key)
        # One batch call per tier (a Redis pipeline), the tiers at once.
        await asyncio.gather(
            *(self.io.delete_quietly(self.slots[index], *batch) for index, batch in keys.items())
        )
        settle(info)  # and the layer tables are gone with the rest

    async def sync_meta(self, info: BlockInfo, strict: bool = False) -> None:
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
            stored = self.io.sealer.seal(info.ref.meta_name, info.meta())
            try:
                await self.io.call(
                    slot, slot.tier.put(info.ref.meta_key, stored), [info.ref.meta_key]
                )
                self.table.meta_stored(info, index)
            except (TierUnavailable, TierFull) as exc:
                if strict:
                    what = f"the layer table of {info.ref.block_key} not stored in {slot.kind}"
                    if isinstance(exc, TierUnavailable):
                        raise TierUnavailable(f"{what}: {exc.detail}", tier=slot.kind) from exc
                    raise InsufficientStorage(f"{what}: {exc.detail}") from exc
                log.warning(
                    "layer table of %s not stored in %s: %s",
                    info.ref.block_key,
                    slot.kind,
                    exc.detail,
                )
        for index in sorted(info.meta_slots - want):
            self.table.meta_dropped(info, index)
            await self.io.delete_quietly(self.slots[index], info.ref.meta_key)
