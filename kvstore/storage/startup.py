"""What a store does when it starts: find its segments again, measure its tiers.

Restart recovery rebuilds the block table from what persistent tiers hold,
trusting only what was written when a block was stored (integrity at rest):

1. every block's layer table (``meta``: layer lengths and digests, codec,
   tokens, the whole block's Repr-Digest, all taken at PUT) is read first,
   opened against its own AES-GCM tag or checksum;
2. then every segment is listed with its size (:meth:`.Tier.sized_keys`:
   LMDB's pages, S3's listing, Redis's STRLEN) and adopted *unchecked*,
   without reading it: the scan costs one read of each layer table, not of
   the data. The first read of an unchecked segment (a GET, a demotion, a
   promotion) checks it in full, its tag or checksum and each layer against
   the digest its layer table holds, before any of it is used; one that
   fails is corrupt: counted, logged, and its block leaves (LE4), a miss.
   A tier that cannot size a key without reading it has that segment read
   and checked here, as before.

A segment whose block has no readable layer table is not adopted and left in
place (a wrong key in the configuration must not destroy the data it cannot
read). A segment that fails here once its layer table opened (so the key is
right) is corrupt: counted, logged, and deleted. Runs before the store
serves, so nothing of it was advertised yet.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any, cast

from .core import StoreCore
from .errors import CorruptData, TierFull, TierUnavailable
from .records import BlockInfo, Segment, TierSlot
from .types import BlockRef, parse_segment_key

log = logging.getLogger("kvstore.storage")


#: Keys read back with one batch call (a Redis pipeline, concurrent S3 GETs).
RECOVER_BATCH = 8
#: Layer tables (small) read back with one batch call.
META_BATCH = 256
#: Listed segments adopted between two yields to the event loop.
ADOPT_BATCH = 1024


async def recover(store: StoreCore) -> int:
    """Rebuild the block table from the persistent tiers (see the module's
    docstring); returns the number of blocks found."""
    # The scan makes a few small objects per block and frees none: the
    # cyclic collector's passes over a growing heap would make it slower
    # per block as the tier grows. Off while it runs (nothing here makes a
    # cycle); back on after.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return await _recover(store)
    finally:
        if collecting:
            gc.enable()


async def _recover(store: StoreCore) -> int:
    persistent = [(i, s) for i, s in enumerate(store.slots) if s.tier.persistent]
    listed = {index: await _listing(slot) for index, slot in persistent}
    for index, slot in persistent:
        metas = listed[index][0]
        for start in range(0, len(metas), META_BATCH):
            batch = metas[start : start + META_BATCH]
            keys = [key for key, _ in batch]
            values = cast(list[Any], await store.io.call(slot, slot.tier.get_many(keys)))
            for (key, ref), stored in zip(batch, values, strict=True):
                _recover_meta(store, index, slot, key, ref, stored)
    unchecked = 0
    for index, slot in persistent:
        unsized: list[tuple[str, BlockRef, tuple[int, int], int | None]] = []
        for n, (key, ref, span, size) in enumerate(listed[index][1]):
            if size is None:
                unsized.append((key, ref, span, size))
            else:
                unchecked += not await _adopt_segment(store, index, ref, span, size)
            if n % ADOPT_BATCH == ADOPT_BATCH - 1:
                await asyncio.sleep(0)  # a large tier does not hold the loop
        for start in range(0, len(unsized), RECOVER_BATCH):
            reads = unsized[start : start + RECOVER_BATCH]
            keys = [key for key, *_ in reads]
            values = cast(list[Any], await store.io.call(slot, slot.tier.get_many(keys)))
            for (key, ref, span, _), stored in zip(reads, values, strict=True):
                unchecked += not await _recover_segment(store, index, key, ref, span, stored)
    if unchecked:
        log.warning(
            "%d segments not adopted: their blocks have no readable layer table (left in place)",
            unchecked,
        )
    for info in store.table:
        known = sorted(info.layers)
        # A block is kept only if its record can list every layer (R2) and
        # something of it survived; what is dropped here stays on disk.
        if not info.segments or known != list(range(len(known))):
            if info.segments:
                log.warning(
                    "not adopting %s: layers %s known, %d segments",
                    info.ref.block_key,
                    known[:3],
                    len(info.segments),
                )
            store.table.unregister(info)
        elif not info.complete:
            store.table.partial(info)  # its digest was taken over layers no longer held
    return len(store.table)


Listing = tuple[list[tuple[str, BlockRef]], list[tuple[str, BlockRef, tuple[int, int], int | None]]]


async def _listing(slot: TierSlot) -> Listing:
    """The tier's layer tables and its segments (with their sizes where the
    tier tells them), each key parsed once; what is not ours is left out (a
    shared bucket or Redis database)."""
    metas: list[tuple[str, BlockRef]] = []
    segments: list[tuple[str, BlockRef, tuple[int, int], int | None]] = []
    async for key, size in slot.tier.sized_keys():
        parsed = parse_segment_key(key)
        if parsed is None:
            continue
        ref, span = parsed
        if span is None:
            metas.append((key, ref))
        else:
            segments.append((key, ref, span, size))
    return metas, segments


def _failed(store: StoreCore, key: str, slot: TierSlot, why: object) -> None:
    store.stats.integrity_failures += 1
    log.warning("integrity: %s in %s fails: %s", key, slot.kind, why)


def _recover_meta(
    store: StoreCore, index: int, slot: TierSlot, key: str, ref: BlockRef, stored: Any
) -> None:
    if stored is None:
        return
    try:
        store.table.load_meta(ref, index, store.sealer.open(ref.meta_name, stored))
    except Exception as exc:
        # Left in place: it may be a wrong key, not a bad disk.
        _failed(store, key, slot, exc)


async def _adopt_segment(
    store: StoreCore, index: int, ref: BlockRef, span: tuple[int, int], size: int
) -> bool:
    """Adopt one listed segment unchecked (its first read checks it); False
    when its block has no layer table to be checked against."""
    info = store.table.entry(ref)
    if info is None or not info.layers:
        return False
    await _place(store, info, Segment(ref, span[0], span[1], index, size), unchecked=True)
    return True


async def _recover_segment(
    store: StoreCore,
    index: int,
    key: str,
    ref: BlockRef,
    span: tuple[int, int],
    stored: Any,
) -> bool:
    """Adopt one stored segment read back, checked now (its tag or checksum,
    then :meth:`.BlockInfo.verify_segment`, as a first read does); False
    when it has no layer table to be checked against."""
    if stored is None:
        return True
    info = store.table.entry(ref)
    if info is None or not info.layers:
        return False
    slot = store.slots[index]
    segment = Segment(ref, span[0], span[1], index, len(memoryview(stored)))
    try:
        info.verify_segment(segment, store.sealer.open(ref.segment_name(*span), stored))
    except CorruptData as exc:
        # Its layer table opened, so the configuration's key is right: this
        # segment was altered (bit rot, a bad disk, a careless copy). Dropped.
        _failed(store, key, slot, exc.detail)
        await store.io.delete_quietly(slot, key)
        return True
    await _place(store, info, segment)
    return True


async def _place(
    store: StoreCore, info: BlockInfo, segment: Segment, unchecked: bool = False
) -> None:
    """Count a segment found in a tier as the block's segment or copy
    (``unchecked``: its first read checks it)."""
    first, last = segment.first, segment.last
    if any((x.first, x.last) == (first, last) for x in [*info.segments, *info.copies]):
        # The same layers in a slower persistent tier: tiers are inclusive,
        # so it is a copy kept below the faster one (tiers are read fastest
        # first). Checked like a segment, then kept as a copy.
        store.table.found(info, segment, copy=True, unchecked=unchecked)
    elif any(x.first <= last and first <= x.last for x in info.segments):
        # Overlapping other layers (e.g. a demotion interrupted between its
        # write and delete, under another split): not kept.
        await store.io.delete_quietly(store.slots[segment.slot], segment.key)
        return
    else:
        store.table.found(info, segment, unchecked=unchecked)


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
