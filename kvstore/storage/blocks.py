"""What the manager knows of tiers, segments and blocks, and a read in progress.

No data lives here: a :class:`BlockInfo` holds lengths and layer digests; the
octets are in the tiers. :class:`BlockRead` streams a block's layers from its
segments, in ascending order, one segment at a time (B4).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.problems import NotFound
from .errors import CorruptData, TierUnavailable
from .policy import LRU, EvictionPolicy
from .state import BlockState, Claim
from .tier import Tier
from .types import BlockRef

if TYPE_CHECKING:
    from .manager import TieredStore

RANGE_DIGESTS_KEPT = 8


def repr_digest_of(data: BytesLike) -> str:
    """``Repr-Digest`` field value of these octets (BL4, RFC 9530)."""
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


def layer_table(container: kc.Container) -> dict[int, tuple[int, int, bytes]]:
    """absolute layer -> (K length, V length, layer digest) (B3)."""
    return {layer.index: (len(layer.k), len(layer.v), layer.digest()) for layer in container}


@dataclass(slots=True)
class TierSlot:
    """A configured tier and the manager's bookkeeping for it."""

    tier: Tier
    capacity: int
    policy: EvictionPolicy = field(default_factory=LRU)
    #: Octets of the segments attached here, plus those reserved for writes
    #: under way (taken before the I/O, so no two writes count on one room).
    used: int = 0
    #: The reserved part of ``used``; 0 when nothing is being written.
    reserved: int = 0
    #: Tasks waiting for room that moves under way will free.
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    degraded_until: float = 0.0
    failures: int = 0
    last_error: str = ""

    @property
    def kind(self) -> str:
        return self.tier.kind


@dataclass(slots=True)
class Segment:
    ref: BlockRef
    first: int
    last: int
    slot: int
    stored_octets: int

    @property
    def id(self) -> tuple[BlockRef, int]:
        return (self.ref, self.first)

    @property
    def key(self) -> str:
        return self.ref.segment_key(self.first, self.last)


@dataclass(slots=True)
class BlockInfo:
    """What the manager knows of one held block (no data)."""

    ref: BlockRef
    codec: int
    token_count: int
    #: absolute layer -> (K length, V length, layer digest)
    layers: dict[int, tuple[int, int, bytes]]
    segments: list[Segment]
    readers: int = 0
    #: Copies in persistent tiers of segments a faster tier serves (tiers are
    #: inclusive below memory: a promotion, or a write-through PUT, leaves the
    #: persistent copy in place until that tier evicts it). Each covers the
    #: same layers as one of ``segments``; reads never use them.
    copies: list[Segment] = field(default_factory=list)
    #: Repr-Digest of the whole container, computed on the first whole read.
    whole_repr_digest: str | None = None
    #: Persistent tiers holding this block's layer table (see :meth:`meta`).
    meta_slots: set[int] = field(default_factory=set)
    #: Repr-Digests of layer ranges already served, (first, last) -> value.
    range_digests: dict[tuple[int, int], str] = field(default_factory=dict)
    #: When it was stored (this process's wall clock, Unix seconds; kept in
    #: the layer table so that retention survives a restart). 0: unknown.
    stored_at: float = 0.0
    #: Segments and copies (tier index, first layer) adopted at a restart
    #: without being read: the first read of one checks it in full.
    unchecked: set[tuple[int, int]] = field(default_factory=set)
    #: Where it is in its life (see :mod:`.state`); None until the table has it.
    state: BlockState | None = None
    #: Serializes the moves and the removal of this block's data.
    claim: Claim = field(default_factory=Claim)
    #: Resolved when it leaves WRITING or LEAVING (a second PUT waits on it).
    settled: asyncio.Future[None] | None = None

    @property
    def first_layer(self) -> int:
        """First layer held (segments may cover fewer layers than are known)."""
        return min(x.first for x in self.segments)

    @property
    def last_layer(self) -> int:
        """Last layer held."""
        return max(x.last for x in self.segments)

    def holds(self, first: int, last: int) -> bool:
        """True when segments cover every layer of ``first..last``."""
        covered = sum(
            min(last, x.last) - max(first, x.first) + 1
            for x in self.segments
            if x.last >= first and x.first <= last
        )
        return first <= last and covered == last - first + 1

    @property
    def complete(self) -> bool:
        """Segments hold every layer the block was stored with."""
        return bool(self.layers and self.segments) and self.holds(
            min(self.layers), max(self.layers)
        )

    @property
    def layer_digests(self) -> list[bytes]:
        """Digests of every layer of the block, held or not, in layer order (B3)."""
        return [self.layers[i][2] for i in sorted(self.layers)]

    @property
    def size(self) -> int:
        """Octets of the container that serves every held layer."""
        held = [self.layers[i] for x in self.segments for i in range(x.first, x.last + 1)]
        data = sum(k + v for k, v, _ in held)
        return kc.FIXED_HEADER_OCTETS + kc.LENGTH_ENTRY_OCTETS * len(held) + data

    def meta(self) -> bytes:
        """The block's layer table as stored beside its segments in persistent
        tiers, so a restart knows every layer's digest even when only some
        segments survived (the replica record lists all of them, R2)."""
        return json.dumps(
            {
                "codec": self.codec,
                "token_count": self.token_count,
                "layers": [[i, k, v, d.hex()] for i, (k, v, d) in sorted(self.layers.items())],
                "stored_at": self.stored_at,
                # BL4: the whole block's Repr-Digest as its PUT took it, so
                # that a restart serves the one taken from what was sent.
                "repr_digest": self.whole_repr_digest if self.complete else None,
            },
            separators=(",", ":"),
        ).encode()

    def load_meta(self, raw: BytesLike) -> None:
        """Adopt a stored layer table (see :meth:`meta`); ValueError if malformed."""
        try:
            data = json.loads(bytes(raw))
            layers = {int(i): (int(k), int(v), bytes.fromhex(d)) for i, k, v, d in data["layers"]}
            codec, tokens = int(data["codec"]), int(data["token_count"])
            stored_at = float(data.get("stored_at", 0.0))
            repr_digest = data.get("repr_digest")
            if repr_digest is not None and not isinstance(repr_digest, str):
                raise ValueError("repr_digest is not a string")
            if stored_at != stored_at or stored_at in (float("inf"), float("-inf")):
                raise ValueError("stored_at is not a finite time")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed block metadata: {exc}") from exc
        if self.layers and (
            (codec, tokens) != (self.codec, self.token_count)
            or any(layers[i] != known for i, known in self.layers.items() if i in layers)
        ):
            raise ValueError("block metadata disagrees with its segments")
        self.codec, self.token_count = codec, tokens
        self.layers.update(layers)
        if stored_at > 0:
            self.stored_at = stored_at
        if repr_digest is not None:
            self.whole_repr_digest = repr_digest

    def verify_segment(self, segment: Segment, plain: BytesLike) -> None:
        """Check a segment's layers (lengths and digests) against the layer
        table taken at put (B3); :class:`CorruptData` if any differs."""
        try:
            container = kc.decode(plain)
        except Exception as exc:
            raise CorruptData(f"segment of {self.ref.block_key} does not decode: {exc}") from exc
        if (container.first_layer, container.last_layer) != (segment.first, segment.last):
            raise CorruptData(f"segment of {self.ref.block_key} holds other layers")
        if (container.codec, container.token_count) != (self.codec, self.token_count):
            raise CorruptData(f"segment of {self.ref.block_key}: another codec or token count")
        for layer in container:
            # Lengths too: a digest of K then V does not tell where K ends.
            if self.layers.get(layer.index) != (len(layer.k), len(layer.v), layer.digest()):
                raise CorruptData(f"layer {layer.index} of {self.ref.block_key} fails its digest")

    def header(self, first: int, last: int) -> kc.ContainerHeader:
        lengths = tuple(self.layers[i][:2] for i in range(first, last + 1))
        return kc.ContainerHeader(self.codec, first, self.token_count, lengths)


@dataclass(slots=True)
class StoreStats:
    """Counters for metrics (OPS1); issue-level exporters read them."""

    puts: int = 0
    hits: int = 0
    misses: int = 0
    demotions: int = 0
    promotions: int = 0
    #: Persistent copies given up for room while a faster tier serves the block.
    copies_dropped: int = 0
    #: Hits not promoted: enough promotions under way already, the block busy
    #: moving, or no room in the first tier without waiting for it.
    promotions_dropped: int = 0
    #: PUT segments written to a lower tier than their first choice, which
    #: was full and draining in the background (watermarks on).
    puts_fell_through: int = 0
    evictions: int = 0
    fault_evictions: int = 0
    #: Blocks removed for being older than the retention limit (SEC4).
    expired: int = 0
    integrity_failures: int = 0
    tier_errors: int = 0


class BlockRead:
    """A read in progress: the container header is known before any data is fetched.

    Iterate it (``async for chunk in read``) to receive the header octets, then
    each layer's K and V sections in ascending order, one segment in memory at
    a time (B4). ``len(read)`` is the exact size of what will be sent.
    """

    def __init__(self, store: TieredStore, info: BlockInfo, first: int, last: int) -> None:
        self._store = store
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
        store, now = self._store, self._store.clock()
        for segment in self._info.segments:
            slot = store.slots[segment.slot]
            if (
                segment.last >= self.first
                and segment.first <= self.last
                and (slot.degraded_until > now)
            ):
                raise TierUnavailable(
                    f"layers {segment.first}-{segment.last} are in tier {slot.kind}, unavailable",
                    tier=slot.kind,
                )

    @property
    def in_memory(self) -> bool:
        """Every segment this read needs is in a memory tier (host, device):
        streaming it cannot fail half way for a tier's sake."""
        slots = self._store.slots
        return all(
            not slots[x.slot].tier.persistent
            for x in self._info.segments
            if x.last >= self.first and x.first <= self.last
        )

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
        return self._keep_digest(hasher)

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
        return self._keep_digest(hasher), chunks

    def _keep_digest(self, hasher: Any) -> str:
        info, span = self._info, (self.first, self.last)
        value = "sha-256=:" + base64.b64encode(hasher.digest()).decode() + ":"
        if self.whole:
            info.whole_repr_digest = value
        else:
            # Engines ask for the same few ranges (their layer split) again and
            # again; keep a handful per block so those GETs hash nothing either.
            if len(info.range_digests) >= RANGE_DIGESTS_KEPT:
                info.range_digests.pop(next(iter(info.range_digests)))
            info.range_digests[span] = value
        return value

    def __aiter__(self) -> AsyncIterator[BytesLike]:
        return self._chunks(promote=self._store.promote)

    async def _chunks(self, promote: bool) -> AsyncIterator[BytesLike]:
        store, info = self._store, self._info
        info.readers += 1
        promoted: list[tuple[Segment, BytesLike]] = []
        try:
            segments = [x for x in info.segments if x.last >= self.first and x.first <= self.last]
            # The block may have been dropped (and even put again) since
            # read() was called: never send a header without its layers.
            covered = sum(min(self.last, x.last) - max(self.first, x.first) + 1 for x in segments)
            if not store.table.current(info) or covered != self.last - self.first + 1:
                raise NotFound(f"block {info.ref.block_key} is no longer held")
            yield self.header.pack()
            for segment in segments:
                plain = await store._load(info, segment)
                if segment.slot > 0 and promote:
                    promoted.append((segment, plain))
                # The layers a segment contributes are contiguous in it: one
                # view per segment, however many layers (few, large writes).
                start, stop = max(self.first, segment.first), min(self.last, segment.last)
                yield kc.decode(plain).span(start, stop)
        finally:
            info.readers -= 1
        if promoted:
            # In the background: this read (a GET's response) is over once
            # its bytes are out, whatever the promotion then costs.
            store.placement.promote_later(info, promoted)

    async def read_all(self) -> bytes:
        """The whole answer in one buffer (library use; servers should stream)."""
        return b"".join([bytes(chunk) async for chunk in self])
