"""What a store does when it starts: find its segments again, measure its tiers.

Restart recovery rebuilds the block table from what persistent tiers hold.

Each stored segment is opened (decrypted, checked) and decoded, so a tampered
segment is skipped, not trusted; a segment that cannot be opened is left in
place, because a wrong key in the configuration must not destroy the data it
cannot read. Runs under the store lock, before the store serves.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from typing import TYPE_CHECKING

from ..protocol import container as kc
from ..protocol.problems import TierFull, TierUnavailable
from .blocks import BlockInfo, Segment, TierSlot
from .types import parse_segment_key

if TYPE_CHECKING:
    from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


async def recover(store: TieredStore) -> int:
    for index, slot in enumerate(store.slots):
        if not slot.tier.persistent:
            continue
        async for key in slot.tier.keys():
            await _recover_segment(store, index, slot, key)
    return len(store._blocks)


async def _recover_segment(store: TieredStore, index: int, slot: TierSlot, key: str) -> None:
    parsed = parse_segment_key(key)
    if parsed is None:
        return  # not ours (a shared bucket or Redis database)
    ref, first, last = parsed
    stored = await store._tier_call(slot, slot.tier.get(key))
    if stored is None:
        return
    try:
        plain = store.sealer.open(ref.segment_name(first, last), stored)
        container = kc.decode(plain)
    except Exception as exc:
        store.stats.integrity_failures += 1
        log.warning("skipping unreadable segment %s in %s: %s", key, slot.kind, exc)
        return
    info = store._blocks.get(ref)
    if info is None:
        info = BlockInfo(ref, container.codec, container.token_count, {}, [])
        store._blocks[ref] = info
        store._by_key.setdefault(ref.block_key, set()).add(ref)
    if any(i in info.layers for i in range(first, last + 1)) or info.codec != container.codec:
        # A second copy (e.g. a demotion interrupted between its write and delete).
        await store._quiet_delete(slot, key)
        return
    for layer in container:
        info.layers[layer.index] = (len(layer.k), len(layer.v), layer.digest())
    size = len(memoryview(stored))
    crc = None if store.sealer.authenticates else zlib.crc32(stored)
    store._attach(info, Segment(ref, first, last, index, size, crc))


async def measure_read_rates(store: TieredStore, probe_octets: int, rounds: int) -> None:
    """Measure ``read_mbit_per_s`` of every tier that has none configured (PL1
    inputs): write a probe, read it ``rounds`` times, keep the best, delete it."""
    key = "0" * 64 + "/probe"
    probe = os.urandom(probe_octets)
    for slot in store.slots:
        if slot.tier.read_mbit_per_s is not None:
            continue
        try:
            await store._tier_call(slot, slot.tier.put(key, probe))
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                await store._tier_call(slot, slot.tier.get(key))
                best = min(best, time.perf_counter() - start)
            slot.tier.read_mbit_per_s = round(8 * probe_octets / max(best, 1e-9) / 1e6)
        except (TierUnavailable, TierFull) as exc:
            log.warning("could not measure %s: %s", slot.kind, exc.detail)
        finally:
            await store._quiet_delete(slot, key)
