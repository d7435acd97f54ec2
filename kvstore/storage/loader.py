"""The segment loader: a segment's plaintext container, opened and checked.

Every octet the store reads back from a tier passes here, and is checked
against what was written when the block was stored (integrity at rest,
SEC4): a persistent tier's segment by its AES-GCM tag or the checksum
sealed with it (:mod:`.crypto`), and, the first time after a restart
adopted it unread (or always, with ``verify_reads``), every layer against
the layer table's digests (B3). Never against values taken from what was
read.

A segment that is gone, or fails its check, is **lost**: the loader counts
and logs it and raises :class:`SegmentLost`; what follows (the block leaves
the holder, LE4) is the caller's to decide (:mod:`.reads`, :mod:`.placement`).
"""

from __future__ import annotations

import asyncio
import logging

from ..protocol._bytes import BytesLike
from ..protocol.problems import KvspError, NotFound
from .core import StoreCore
from .errors import CorruptData
from .records import BlockInfo, Segment
from .tierio import OFFLOAD_OCTETS

log = logging.getLogger("kvstore.storage")


class SegmentLost(Exception):
    """A segment its block still lists is not in its tier any more, or fails
    its check: the block can no longer be served whole, and must leave (LE4).
    ``error`` is what the read that found it answers (a 404, or a 422 for
    data that fails its digest); ``tier`` is the kind of the tier it was in."""

    def __init__(self, reason: str, error: KvspError, tier: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
        self.tier = tier


class SegmentLoader:
    def __init__(self, core: StoreCore) -> None:
        self.core = core

    async def load(self, info: BlockInfo, segment: Segment) -> BytesLike:
        """The segment's plaintext container. A segment that a concurrent
        promotion or demotion moved is followed to its new tier.

        Raises :class:`NotFound` when the block itself is gone (or put
        again: the same keys then hold another incarnation's octets, never
        to be sent under this header), :class:`SegmentLost` (see there),
        :class:`TierUnavailable` from the tier."""
        core = self.core
        while True:
            slot = core.slots[segment.slot]
            stored = await core.io.call(slot, slot.tier.get(segment.key))
            if core.table.entry(info.ref) is not info:
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
            reason = f"{slot.kind} lost layers {segment.first}-{segment.last}"
            gone = NotFound(f"block {info.ref.block_key} is no longer held")
            raise SegmentLost(reason, gone, slot.kind)
        if not slot.tier.persistent:
            return stored
        checked = segment
        # Adopted at a restart without being read: checked in full once.
        whole = core.settings.verify_reads or core.table.unchecked(info, segment)

        def check_and_open() -> BytesLike:
            # The AES-GCM tag or the checksum written with the segment (never a
            # value taken from what was read): see .crypto.
            plain = core.sealer.open(info.ref.segment_name(checked.first, checked.last), stored)
            if whole:
                info.verify_segment(checked, plain)
            return plain

        try:
            if len(memoryview(stored)) >= OFFLOAD_OCTETS:
                plain = await asyncio.to_thread(check_and_open)
            else:
                plain = check_and_open()
        except CorruptData as exc:  # counted and logged once, here
            core.stats.integrity_failures += 1
            log.warning("integrity: %s in %s fails: %s", checked.key, slot.kind, exc.detail)
            raise SegmentLost(f"corrupt segment in {slot.kind}", exc, slot.kind) from exc
        if whole:
            core.table.checked(info, checked)
        return plain
