"""A read in progress: a block's layers streamed from its segments.

:class:`BlockRead` knows its container header before any data is fetched,
and sends each layer's K and V sections in ascending order, one segment in
memory at a time (B4). A segment it finds lost makes the block leave the
holder (LE4) before the read fails; a segment read from a lower tier is
promoted in the background once the read is over.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.problems import NotFound
from .core import StoreCore
from .errors import TierUnavailable
from .loader import SegmentLoader, SegmentLost
from .placement import Placement
from .records import BlockInfo, Segment, repr_digest_value


class BlockRead:
    """A read in progress: the container header is known before any data is fetched.

    Iterate it (``async for chunk in read``) to receive the header octets, then
    each layer's K and V sections in ascending order, one segment in memory at
    a time (B4). ``len(read)`` is the exact size of what will be sent.
    """

    def __init__(
        self,
        core: StoreCore,
        loader: SegmentLoader,
        placement: Placement,
        info: BlockInfo,
        first: int,
        last: int,
    ) -> None:
        self._core, self._loader, self._placement = core, loader, placement
        self._info = info
        self.first = first
        self.last = last
        self.header = info.header(first, last)
        self.whole = first == info.first_layer and last == info.last_layer

    def __len__(self) -> int:
        return self.header.total_octets

    def check_reachable(self) -> None:
        """Raise :class:`TierUnavailable` if a segment this read needs is in a
        tier that failed within its retry window. A probe's guess, from
        metadata only: a GET tries the tier and may still succeed (or find
        the data lost, a 404)."""
        for segment in self._segments():
            if self._core.io.degraded(segment.slot):
                kind = self._core.slots[segment.slot].kind
                raise TierUnavailable(
                    f"layers {segment.first}-{segment.last} are in tier {kind}, unavailable",
                    tier=kind,
                )

    @property
    def in_memory(self) -> bool:
        """Every segment this read needs is in a memory tier (host, device):
        streaming it cannot fail half way for a tier's sake."""
        slots = self._core.slots
        return all(not slots[x.slot].tier.persistent for x in self._segments())

    def known_repr_digest(self) -> str | None:
        """``Repr-Digest`` if already computed (no segment is read for it)."""
        if self.whole:
            return self._info.whole_repr_digest
        return self._info.range_digests.get((self.first, self.last))

    async def repr_digest(self) -> str:
        """``Repr-Digest`` of exactly what this read sends (BL4).

        For a whole-block read it is computed once and kept (at PUT time), so
        a hot GET hashes nothing; a layer-range read hashes its data (one
        extra pass: a server uses :meth:`buffered` instead).
        """
        known = self.known_repr_digest()
        if known is not None:
            return known
        hasher = hashlib.sha256()
        async for chunk in self._chunks(promote=False):
            hasher.update(chunk)
        return self._keep_digest(hasher.digest())

    async def buffered(self) -> tuple[str, list[BytesLike]]:
        """The ``Repr-Digest`` and the chunks of this read, from one pass over
        its segments (a cold GET: the header needs the digest before the body,
        and reading the tiers twice would cost twice). The chunks are views of
        the loaded segments, in order; at most the read's size in memory."""
        hasher = hashlib.sha256()
        chunks: list[BytesLike] = []
        async for chunk in self:
            hasher.update(chunk)
            chunks.append(chunk)
        return self._keep_digest(hasher.digest()), chunks

    def _keep_digest(self, digest: bytes) -> str:
        value = repr_digest_value(digest)
        self._core.table.keep_repr_digest(self._info, self.first, self.last, value)
        return value

    def _segments(self) -> list[Segment]:
        return [x for x in self._info.segments if x.last >= self.first and x.first <= self.last]

    def __aiter__(self) -> AsyncIterator[BytesLike]:
        return self._chunks(promote=self._core.settings.promote)

    async def _chunks(self, promote: bool) -> AsyncIterator[BytesLike]:
        table, info = self._core.table, self._info
        promoted: list[tuple[Segment, BytesLike]] = []
        with table.reading(info):
            segments = self._segments()
            # The block may have been dropped (and even put again) since
            # read() was called: never send a header without its layers.
            covered = sum(min(self.last, x.last) - max(self.first, x.first) + 1 for x in segments)
            if not table.current(info) or covered != self.last - self.first + 1:
                raise NotFound(f"block {info.ref.block_key} is no longer held")
            yield self.header.pack()
            for segment in segments:
                try:
                    plain = await self._loader.load(info, segment)
                except SegmentLost as lost:
                    await self._placement.lost(info, lost)  # LE4: withdrawn first
                    raise lost.error from None
                if segment.slot > 0 and promote:
                    promoted.append((segment, plain))
                # The layers a segment contributes are contiguous in it: one
                # view per segment, however many layers (few, large writes).
                start, stop = max(self.first, segment.first), min(self.last, segment.last)
                yield kc.decode(plain).span(start, stop)
        if promoted:
            # In the background: this read (a GET's response) is over once
            # its bytes are out, whatever the promotion then costs.
            self._placement.promote_later(info, promoted)

    async def read_all(self) -> bytes:
        """The whole answer in one buffer (library use; servers should stream)."""
        return b"".join([bytes(chunk) async for chunk in self])
