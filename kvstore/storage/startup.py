"""What a store does when it starts: find its segments again, measure its tiers.

Restart recovery rebuilds the block table from what persistent tiers hold.

Each stored segment is opened (decrypted, checked) and decoded, so a tampered
segment is skipped, not trusted; a segment that cannot be opened is left in
place, because a wrong key in the configuration must not destroy the data it
cannot read. Runs before the store serves.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from typing import TYPE_CHECKING, Any, cast

from ..protocol import container as kc
from ..protocol.problems import TierFull, TierUnavailable
from .blocks import BlockInfo, Segment, TierSlot
from .types import BlockRef, parse_segment_key

if TYPE_CHECKING:
    from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


#: Keys read back with one batch call (a Redis pipeline, concurrent S3 GETs).
RECOVER_BATCH = 8


async def recover(store: TieredStore) -> int:
    for index, slot in enumerate(store.slots):
        if not slot.tier.persistent:
            continue
        batch: list[str] = []
        async for key in slot.tier.keys():
            if parse_segment_key(key) is None:
                continue  # not ours (a shared bucket or Redis database)
            batch.append(key)
            if len(batch) == RECOVER_BATCH:
                await _recover_batch(store, index, slot, batch)
                batch = []
        await _recover_batch(store, index, slot, batch)
    for info in store.blocks():
        known = sorted(info.layers)
        # A block is kept only if its record can list every layer (R2) and
        # something of it survived; what is dropped here stays on disk.
        if not info.segments or known != list(range(len(known))):
            log.warning("not adopting %s: layers %s known, %d segments", info.ref.block_key,
                        known[:3], len(info.segments))  # fmt: skip
            store.table.unregister(info)
    return len(store)


def _info(store: TieredStore, ref: BlockRef, codec: int, token_count: int) -> BlockInfo:
    info = store.table.entry(ref)
    if info is None:
        info = BlockInfo(ref, codec, token_count, {}, [])
        store.table.adopt(info)
    return info


async def _recover_batch(store: TieredStore, index: int, slot: TierSlot, keys: list[str]) -> None:
    if not keys:
        return
    values = cast(list[Any], await store.io.call(slot, slot.tier.get_many(keys)))
    for key, stored in zip(keys, values, strict=True):
        if stored is not None:
            await _recover_key(store, index, slot, key, stored)


async def _recover_key(
    store: TieredStore, index: int, slot: TierSlot, key: str, stored: Any
) -> None:
    parsed = parse_segment_key(key)
    assert parsed is not None
    ref, span = parsed
    name = ref.meta_name if span is None else ref.segment_name(*span)
    try:
        plain = store.sealer.open(name, stored)
        if span is None:
            info = _info(store, ref, 0, 0)  # a new entry takes codec and tokens from the table
            info.load_meta(plain)
            info.meta_slots.add(index)
            return
        container = kc.decode(plain)
        if (container.first_layer, container.last_layer) != span:
            raise ValueError("segment holds other layers than its key says")
    except Exception as exc:
        store.stats.integrity_failures += 1
        log.warning("skipping unreadable %s in %s: %s", key, slot.kind, exc)
        return
    info = _info(store, ref, container.codec, container.token_count)
    first, last = span
    same = any((x.first, x.last) == span for x in [*info.segments, *info.copies])
    if info.codec == container.codec and same:
        # The same layers in a slower persistent tier: tiers are inclusive,
        # so it is a copy kept below the faster one (tiers are read fastest
        # first). Checked like a segment, then kept as a copy.
        copy = _checked(store, info, container, key, slot, index, stored, span)
        if copy is not None:
            store.table.found(info, copy, copy=True)
        return
    if any(x.first <= last and first <= x.last for x in info.segments) or (
        info.codec != container.codec
    ):
        # Overlapping other layers (e.g. a demotion interrupted between its
        # write and delete, under another split): not kept.
        await store.io.delete_quietly(slot, key)
        return
    segment = _checked(store, info, container, key, slot, index, stored, span)
    if segment is not None:
        store.table.found(info, segment)


def _checked(
    store: TieredStore,
    info: BlockInfo,
    container: kc.Container,
    key: str,
    slot: TierSlot,
    index: int,
    stored: Any,
    span: tuple[int, int],
) -> Segment | None:
    """The segment of ``stored`` once every layer matches the known digests."""
    for layer in container:
        known = info.layers.get(layer.index)
        digest = layer.digest()
        if known is not None and known[2] != digest:
            store.stats.integrity_failures += 1
            log.warning("skipping %s in %s: layer %d fails its digest", key, slot.kind, layer.index)
            return None
        info.layers[layer.index] = (len(layer.k), len(layer.v), digest)
    size = len(memoryview(stored))
    crc = None if store.sealer.authenticates else zlib.crc32(stored)
    return Segment(info.ref, span[0], span[1], index, size, crc)


async def measure_read_rates(store: TieredStore, probe_octets: int, rounds: int) -> None:
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
