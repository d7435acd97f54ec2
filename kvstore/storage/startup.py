"""What a store does when it starts: find its segments again, measure its tiers.

Restart recovery rebuilds the block table from what persistent tiers hold,
trusting only what was written when a block was stored (integrity at rest):

1. every tier is listed, each key with its size (:meth:`.Tier.sized_keys`:
   LMDB's pages, S3's listing, Redis's STRLEN), each key parsed once and
   grouped by block;
2. then, a batch of blocks at a time, each block's layer table (``meta``:
   layer lengths and digests, codec, tokens, the whole block's Repr-Digest,
   all taken at PUT) is read, opened against its own AES-GCM tag or
   checksum, and its segments are adopted *unchecked*, without reading
   them: the scan costs one read of each layer table, not of the data. The
   first read of an unchecked segment (a GET, a demotion, a promotion)
   checks it in full, its tag or checksum and each layer against the digest
   its layer table holds, before any of it is used; one that fails is
   corrupt: counted, logged, and its block leaves (LE4), a miss. A tier
   that cannot size a key without reading it has that segment read and
   checked here.

A block joins the table only whole (every segment found placed, its layer
table complete), with no await between that check and its adoption: a
request never sees half of a recovered block. Each adopted block is told as
``stored`` (the holder's publisher republishes it, P1).

**In the background** (:meth:`Recovery.start`, what ``kvstore serve`` does):
the holder serves while the scan runs. A request about a block the scan has
not reached asks :meth:`Recovery.find` first: a block with no layer table in
any persistent tier is new (one small read per tier, no wait); one that has
a table is recovered at once, alone, from the listing (waiting for the
listing if it is not done, at most ``FIND_WAIT_S``). The scan skips what a
request recovered, and a request waits for a batch the scan is reading. Until
the scan is done, the tiers' ``used`` octets count only what was found so far.

A segment whose block has no readable layer table is not adopted and left in
place (a wrong key in the configuration must not destroy the data it cannot
read). A segment that fails here once its layer table opened (so the key is
right) is corrupt: counted, logged, and deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from ..logs import describe
from .core import StoreCore
from .errors import CorruptData, TierFull, TierUnavailable
from .events import RecoveryProgress
from .placement import Placement
from .records import BlockInfo, Segment, TierSlot
from .types import BlockRef, parse_segment_key

log = logging.getLogger("kvstore.storage")


#: Keys read back with one batch call (a Redis pipeline, concurrent S3 GETs).
RECOVER_BATCH = 8
#: Blocks whose layer tables (small) are read back with one batch call.
META_BATCH = 256
#: Longest a request waits for the listing to learn where a block's
#: segments are; past it, a GET is a miss (P4) and a PUT a 503.
FIND_WAIT_S = 5.0
#: Blocks adopted between two freezes of the cyclic collector's heap (the
#: scan's objects are long-lived: the collector's passes over them made the
#: scan slower per block as the tier grew).
FREEZE_EVERY = 16_384


class Phase(enum.Enum):
    """Where a recovery is."""

    IDLE = "idle"  # not started
    LISTING = "listing"  # the tiers' keys are listed
    SCANNING = "scanning"  # blocks' layer tables are read and adopted
    DONE = "done"
    #: A tier failed during the scan: retried after the tier's retry time.
    RETRYING = "retrying"
    #: The scan itself failed (a bug, logged): what it adopted serves, the
    #: rest is not found until the next start.
    FAILED = "failed"
    #: The store stopped before the scan was done.
    STOPPED = "stopped"


@dataclass(slots=True)
class _Listed:
    """What the listing found of one block: the tiers holding its layer
    table, and its segments as (tier index, key, layers, size or None)."""

    metas: list[int] = field(default_factory=list)
    segments: list[tuple[int, str, tuple[int, int], int | None]] = field(default_factory=list)


class Recovery:
    """Rebuilds the block table from the persistent tiers (see the module's
    docstring): all at once (:meth:`run`) or in the background
    (:meth:`start`), with requests finding the blocks they need first."""

    def __init__(self, core: StoreCore, placement: Placement) -> None:
        self.core, self.placement = core, placement
        self.table = core.table
        self.persistent = [i for i, s in enumerate(core.slots) if s.tier.persistent]
        self.phase = Phase.IDLE if self.persistent else Phase.DONE
        self._listed: dict[BlockRef, _Listed] = {}
        self._by_key: dict[str, list[BlockRef]] = {}
        self._listing_done = asyncio.Event()
        #: Blocks settled: looked at by the scan or a request (adopted,
        #: given up, or known to be new). The scan does not look again.
        self._settled: set[BlockRef] = set()
        #: Blocks being read now, by the scan or a request: their batch's end.
        self._reading: dict[BlockRef, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0
        self._ended: float | None = None
        self._error: str | None = None
        self.listed = self.adopted = self.scanned = 0

    # --- progress ----------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def active(self) -> bool:
        """Under way: requests find blocks first."""
        return self.phase in (Phase.LISTING, Phase.SCANNING, Phase.RETRYING)

    def progress(self) -> RecoveryProgress:
        end = self._ended if self._ended is not None else time.monotonic()
        return RecoveryProgress(
            self.phase.value,
            self.active,
            self.listed,
            self.scanned,
            self.adopted,
            (end - self._started) if self._started else 0.0,
            self._error,
        )

    # --- running -----------------------------------------------------------

    async def run(self) -> int:
        """Recover everything now; returns the number of blocks held."""
        if self._task is not None:
            await self.wait()  # one scan at a time: the background one
            return len(self.table)
        self._started = self._started or time.monotonic()
        await self._scan()
        return len(self.table)

    def start(self) -> None:
        """Recover in the background (the store serves meanwhile); a tier
        failing the scan has it retried after the tier's retry time."""
        if self._task is not None or self.done:
            return
        self._started = time.monotonic()
        self.phase = Phase.LISTING  # requests find blocks from now on
        self._task = asyncio.create_task(self._background(), name="kvstore recovery")

    async def wait(self) -> None:
        """Until the background scan is done."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        if self.active:
            self.phase = Phase.STOPPED
        self._listing_done.set()  # nobody waits on a stopped scan

    async def _background(self) -> None:
        while True:
            try:
                await self._scan()
                return
            except (TierUnavailable, TierFull) as exc:
                self._error = exc.detail
                self.phase = Phase.RETRYING
                wait = max(self.core.io.retry_after_s, 0.1)
                log.error("recovery: %s; retried in %.1f s", exc.detail, wait)
                await asyncio.sleep(wait)
            except Exception as exc:
                log.exception("recovery failed")
                self.phase, self._error = Phase.FAILED, describe(exc)
                self._listing_done.set()
                return

    async def _scan(self) -> None:
        # The scan makes a few small objects per block and frees none: the
        # cyclic collector's passes over a growing heap would make it
        # slower per block as the tier grows. Run alone, it turns the
        # collector off; in the background (the store serves meanwhile,
        # and the collector stays on for what requests make), its objects
        # are frozen out of those passes as it goes. Back after.
        alone = self._task is None or asyncio.current_task() is not self._task
        collecting = gc.isenabled()
        if alone:
            gc.disable()
        frozen = False
        try:
            if not self._listing_done.is_set():
                self.phase = Phase.LISTING
                await self._list()
                self._listing_done.set()
            self.phase = Phase.SCANNING
            since_freeze = 0
            while pending := [
                ref
                for ref in self._listed
                if ref not in self._settled and self.table.entry(ref) is None
            ]:
                for start in range(0, len(pending), META_BATCH):
                    batch = pending[start : start + META_BATCH]
                    await self._recover(batch)
                    since_freeze += len(batch)
                    if since_freeze >= FREEZE_EVERY and not alone:
                        gc.freeze()
                        frozen, since_freeze = True, 0
                # Blocks a request was reading as the scan passed them: once
                # those reads end, whatever they left is looked at again.
                for reading in list(set(self._reading.values())):
                    await asyncio.shield(reading)
        finally:
            if frozen:
                gc.unfreeze()
            if alone and collecting:
                gc.enable()
        unread = sum(
            1
            for ref, listed in self._listed.items()
            if self.table.entry(ref) is None and listed.segments and not listed.metas
        )
        if unread:
            log.warning(
                "%d blocks' segments not adopted: no readable layer table (left in place)", unread
            )
        self.phase, self._ended, self._error = Phase.DONE, time.monotonic(), None
        # What only the scan needed (a request finds nothing new any more).
        self._listed, self._by_key, self._settled = {}, {}, set()
        log.info("recovery: %d blocks in %.1f s", self.adopted, self.progress().elapsed_s)

    async def _list(self) -> None:
        """Every persistent tier's layer tables and segments, by block; what
        is not ours is left out (a shared bucket or Redis database)."""
        listed: dict[BlockRef, _Listed] = {}
        for index in self.persistent:
            n = 0
            async for key, size in self.core.slots[index].tier.sized_keys():
                n += 1
                if n % 4096 == 0:
                    await asyncio.sleep(0)  # a large tier does not hold the loop
                parsed = parse_segment_key(key)
                if parsed is None:
                    continue
                ref, span = parsed
                entry = listed.get(ref)
                if entry is None:
                    entry = listed[ref] = _Listed()
                if span is None:
                    entry.metas.append(index)
                else:
                    entry.segments.append((index, key, span, size))
        by_key: dict[str, list[BlockRef]] = {}
        for ref in listed:
            by_key.setdefault(ref.block_key, []).append(ref)
        self._listed, self._by_key = listed, by_key
        self.listed = len(listed)

    # --- requests ------------------------------------------------------------

    async def find(self, ref: BlockRef, wait_s: float | None = None) -> bool:
        """Make sure a request sees ``ref`` as it is stored: recovered now if
        a persistent tier holds it and the scan has not reached it. False
        when that could not be told within ``wait_s`` (default
        ``FIND_WAIT_S``: the listing is not done, or a tier failed): the
        caller answers a miss, or a 503."""
        if not self.active or ref in self._settled:
            return True  # nothing being recovered, or already looked at
        if self.table.entry(ref) is not None:
            return True
        if not self._listing_done.is_set():
            # Before the listing is done, straight from the tiers: a block
            # with no layer table anywhere is new (a PUT of one goes on at
            # once); one with a table is looked for where its layers are
            # put, whole or split (a large tier's listing takes seconds).
            try:
                metas = await self._metas(ref)
                if not metas and not self._listing_done.is_set():
                    self._settled.add(ref)
                    return True
                if metas and await self._probe(ref, metas):
                    return True
            except (TierUnavailable, TierFull):
                return False
            try:
                async with asyncio.timeout(FIND_WAIT_S if wait_s is None else wait_s):
                    await self._listing_done.wait()
            except TimeoutError:
                return False
        if self.done or ref in self._settled or self.table.entry(ref) is not None:
            return True
        if ref not in self._listed:
            self._settled.add(ref)  # nothing of it was there: a new block
            return True
        reading = self._reading.get(ref)
        if reading is not None:
            await asyncio.shield(reading)
            return True
        try:
            await self._recover([ref])
        except (TierUnavailable, TierFull):
            return False
        return True

    async def find_keys(self, block_keys: Iterable[str], wait_s: float | None = None) -> None:
        """:meth:`find` every block with one of ``block_keys`` the listing
        has (a lease names keys, not scopes): waits for the listing."""
        if not self.active:
            return
        try:
            async with asyncio.timeout(FIND_WAIT_S if wait_s is None else wait_s):
                await self._listing_done.wait()
        except TimeoutError:
            return
        for key in block_keys:
            for ref in self._by_key.get(key, ()):
                await self.find(ref, wait_s)

    async def _metas(self, ref: BlockRef) -> dict[int, Any]:
        """The block's stored layer table in each persistent tier holding one."""
        found = {}
        for index in self.persistent:
            slot = self.core.slots[index]
            stored = await self.core.io.call(slot, slot.tier.get(ref.meta_key))
            if stored is not None:
                found[index] = stored
        return found

    async def _probe(self, ref: BlockRef, metas: dict[int, Any]) -> bool:
        """Recover one block without the listing: its segments looked for
        under the layer ranges a PUT gives them (all its layers, or the
        ``fast_layers`` split), each read and checked now. False when that
        does not find it whole (another split once: the listing will)."""
        if ref in self._settled or ref in self._reading or self.table.entry(ref) is not None:
            return False
        infos: dict[BlockRef, BlockInfo] = {}
        adopted: list[BlockInfo] = []
        with self._reading_now([ref], infos) as settled:
            for index, stored in metas.items():
                self._load_meta(infos, ref, index, stored)
            info = infos.get(ref)
            if info is None or not info.layers:
                return False
            last = max(info.layers)
            n = self.core.settings.fast_layers
            spans = [(0, last)] + ([(0, n - 1), (n, last)] if 0 < n <= last else [])
            for index in self.persistent:
                slot = self.core.slots[index]
                keys = [ref.segment_key(*span) for span in spans]
                values = cast(list[Any], await self.core.io.call(slot, slot.tier.get_many(keys)))
                for key, span, stored in zip(keys, spans, values, strict=True):
                    await self._recover_segment(info, index, key, span, stored)
            known = sorted(info.layers)
            covered = sum(s.last - s.first + 1 for s in info.segments)
            if known == list(range(len(known))) and covered == len(known):
                adopted = self._adopt([ref], infos)
                settled.update(i.ref for i in adopted)
        await self._adopted(adopted)
        return bool(adopted)  # else not all of it under these ranges

    # --- one batch -------------------------------------------------------------

    async def _recover(self, refs: list[BlockRef]) -> None:
        """Look at ``refs`` (listed blocks): adopt each whole, or give it up."""
        refs = [
            r
            for r in refs
            if r not in self._settled and r not in self._reading and self.table.entry(r) is None
        ]
        if not refs:
            return
        infos: dict[BlockRef, BlockInfo] = {}
        with self._reading_now(refs, infos) as settled:
            await self._read_metas(refs, infos)
            for index in self.persistent:
                await self._place_segments(index, refs, infos)
            adopted = self._adopt(refs, infos)
            settled.update(refs)  # adopted or given up: not looked at again
        await self._adopted(adopted)

    @contextlib.contextmanager
    def _reading_now(
        self, refs: list[BlockRef], infos: dict[BlockRef, BlockInfo]
    ) -> Iterator[set[BlockRef]]:
        """``refs`` are being read (a request about one waits for the end):
        the caller adds to the set it is given those not to look at again.
        At the end, every block of ``infos`` not adopted gives back the room
        its segments were counted in, whatever ended the reading."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for ref in refs:
            self._reading[ref] = done
        settled: set[BlockRef] = set()
        try:
            yield settled
        finally:
            for ref in refs:
                del self._reading[ref]
            self._settled |= settled
            self.scanned += len(settled)
            for info in infos.values():
                if self.table.entry(info.ref) is not info:
                    self.table.unregister(info)
            done.set_result(None)

    async def _adopted(self, adopted: list[BlockInfo]) -> None:
        """After blocks joined the table: their stored time checked, and
        each told as stored."""
        now = self.core.wall_clock()
        for info in adopted:
            if info.stored_at <= 0 or info.stored_at > now:
                # No time kept (an older version, a lost table), or one from
                # a clock ahead of ours: counted from now, and the table
                # rewritten so that the next restart knows it.
                await info.claim.take()
                try:
                    if self.table.current(info):
                        self.table.restamp(info, now)
                        await self.placement.sync_meta(info)
                finally:
                    info.claim.give()
        for info in adopted:
            if self.table.current(info):
                self.core.events.stored(info.ref)  # P1: republished

    async def _read_metas(self, refs: list[BlockRef], infos: dict[BlockRef, BlockInfo]) -> None:
        for index in self.persistent:
            slot = self.core.slots[index]
            want = [r for r in refs if index in self._listed[r].metas]
            if not want:
                continue
            keys = [r.meta_key for r in want]
            values = cast(list[Any], await self.core.io.call(slot, slot.tier.get_many(keys)))
            for ref, stored in zip(want, values, strict=True):
                if stored is not None:
                    self._load_meta(infos, ref, index, stored)

    def _load_meta(
        self, infos: dict[BlockRef, BlockInfo], ref: BlockRef, index: int, stored: Any
    ) -> None:
        """Add the layer table read from tier ``index`` to ``ref``'s entry of
        ``infos`` (made by the first table that opens)."""
        info = infos.get(ref) or BlockInfo(ref, 0, 0, {}, [])
        try:
            info.load_meta(self.core.sealer.open(ref.meta_name, stored))
        except Exception as exc:
            # Left in place: it may be a wrong key, not a bad disk.
            self._failed(ref.meta_key, self.core.slots[index], exc)
            return
        infos[ref] = info
        self.table.meta_stored(info, index)

    async def _place_segments(
        self, index: int, refs: list[BlockRef], infos: dict[BlockRef, BlockInfo]
    ) -> None:
        slot = self.core.slots[index]
        unsized: list[tuple[BlockInfo, str, tuple[int, int]]] = []
        for ref in refs:
            info = infos.get(ref)
            if info is None or not info.layers:
                continue  # no layer table to check against: left in place
            for where, key, span, size in self._listed[ref].segments:
                if where != index:
                    continue
                if size is None:
                    unsized.append((info, key, span))
                else:
                    await self._place(info, Segment(ref, span[0], span[1], index, size), True)
        for start in range(0, len(unsized), RECOVER_BATCH):
            reads = unsized[start : start + RECOVER_BATCH]
            keys = [key for _, key, _ in reads]
            values = cast(list[Any], await self.core.io.call(slot, slot.tier.get_many(keys)))
            for (info, key, span), stored in zip(reads, values, strict=True):
                await self._recover_segment(info, index, key, span, stored)

    def _adopt(self, refs: list[BlockRef], infos: dict[BlockRef, BlockInfo]) -> list[BlockInfo]:
        """Each block whole into the table (one not adopted is given up at
        the reading's end, :meth:`_reading_now`); no await here, so a
        request sees a block complete or not at all."""
        adopted = []
        for ref in refs:
            info = infos.get(ref)
            if info is None:
                continue
            if self.table.entry(ref) is not None:
                continue  # stored meanwhile: that one stands
            known = sorted(info.layers)
            # A block is kept only if its record can list every layer (R2)
            # and something of it survived; what is dropped stays on disk.
            if not info.segments or known != list(range(len(known))):
                if info.segments:
                    log.warning(
                        "not adopting %s: layers %s known, %d segments",
                        ref.block_key,
                        known[:3],
                        len(info.segments),
                    )
                continue
            if not info.complete:
                self.table.partial(info)  # its digest was taken over layers no longer held
            self.table.adopt(info)
            adopted.append(info)
        self.adopted += len(adopted)
        return adopted

    def _failed(self, key: str, slot: TierSlot, why: object) -> None:
        self.core.stats.integrity_failures += 1
        log.warning("integrity: %s in %s fails: %s", key, slot.kind, why)

    async def _recover_segment(
        self, info: BlockInfo, index: int, key: str, span: tuple[int, int], stored: Any
    ) -> None:
        """Place one stored segment read back, checked now (its tag or
        checksum, then :meth:`.BlockInfo.verify_segment`, as a first read
        does)."""
        if stored is None:
            return
        slot = self.core.slots[index]
        segment = Segment(info.ref, span[0], span[1], index, len(memoryview(stored)))
        try:
            plain = self.core.sealer.open(info.ref.segment_name(*span), stored)
            info.verify_segment(segment, plain)
        except CorruptData as exc:
            # Its layer table opened, so the configuration's key is right:
            # this segment was altered (bit rot, a bad disk, a careless
            # copy). Dropped.
            self._failed(key, slot, exc.detail)
            await self.core.io.delete_quietly(slot, key)
            return
        await self._place(info, segment)

    async def _place(self, info: BlockInfo, segment: Segment, unchecked: bool = False) -> None:
        """Count a segment found in a tier as the block's segment or copy
        (``unchecked``: its first read checks it)."""
        first, last = segment.first, segment.last
        if any((x.first, x.last) == (first, last) for x in [*info.segments, *info.copies]):
            # The same layers in a slower persistent tier: tiers are
            # inclusive, so it is a copy kept below the faster one (tiers
            # are read fastest first). Checked like a segment, then kept as
            # a copy.
            self.table.found(info, segment, copy=True, unchecked=unchecked)
        elif any(x.first <= last and first <= x.last for x in info.segments):
            # Overlapping other layers (e.g. a demotion interrupted between
            # its write and delete, under another split): not kept.
            await self.core.io.delete_quietly(self.core.slots[segment.slot], segment.key)
        else:
            self.table.found(info, segment, unchecked=unchecked)


async def measure_read_rates(store: StoreCore, probe_octets: int, rounds: int) -> None:
    """Measure ``read_mbit_per_s`` of every tier that has none configured (PL1
    inputs): write a probe, read it ``rounds`` times, keep the best, delete it."""
    key = "0" * 64 + "/probe"
    probe = os.urandom(probe_octets)
    for slot in store.slots:
        if slot.tier.read_mbit_per_s is not None:
            continue
        try:
            await store.io.call(slot, slot.tier.put(key, probe), [key])
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                await store.io.call(slot, slot.tier.get(key))
                best = min(best, time.perf_counter() - start)
            slot.tier.read_mbit_per_s = round(8 * probe_octets / max(best, 1e-9) / 1e6)
        except (TierUnavailable, TierFull) as exc:
            log.warning("could not measure %s: %s", slot.kind, exc.detail)
        finally:
            await store.io.delete_quietly(slot, key)
