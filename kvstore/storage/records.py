"""The store's records: what it knows of tiers, segments and blocks.

The bottom of the storage package: plain data and what follows from it
alone, no tier I/O, nothing of the store above. No data lives here: a
:class:`BlockInfo` holds lengths and layer digests; the octets are in the
tiers. The block table (:mod:`.table`) owns every :class:`BlockInfo` once
it has it; the other parts ask it to change one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.records import ReplicaRecord, Residency
from .errors import CorruptData
from .latency import Latency, latencies
from .policy import LRU, EvictionPolicy
from .state import BlockState, Claim
from .tier import Tier
from .types import BlockRef

RANGE_DIGESTS_KEPT = 8


def repr_digest_value(digest: bytes) -> str:
    """``Repr-Digest`` field value of a SHA-256 digest (BL4, RFC 9530)."""
    return "sha-256=:" + base64.b64encode(digest).decode() + ":"


def repr_digest_of(data: BytesLike) -> str:
    """``Repr-Digest`` field value of these octets (BL4, RFC 9530)."""
    return repr_digest_value(hashlib.sha256(data).digest())


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
    #: How long its calls took, by operation (read, write, delete).
    latency: dict[str, Latency] = field(default_factory=latencies)

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
    #: Its KV octets as its scope's usage counted them (BlockTable).
    counted_octets: int = 0
    #: Where it is in its life (see :mod:`.state`); None until the table has it.
    state: BlockState | None = None
    #: Serializes the moves and the removal of this block's data.
    claim: Claim = field(default_factory=Claim)
    #: Resolved when it leaves WRITING or LEAVING (a second PUT waits on it).
    settled: asyncio.Future[None] | None = None

    @property
    def kv_octets(self) -> int:
        """Octets of its K and V sections (what a tenant's usage counts)."""
        return sum(k + v for k, v, _ in self.layers.values())

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

    def residency(self, slots: Sequence[TierSlot]) -> tuple[Residency, ...]:
        """The ``residency`` array of the block's Replica Record: adjacent
        segments in one tier merged, ascending, non-overlapping (R2)."""
        out: list[Residency] = []
        for segment in sorted(self.segments, key=lambda s: s.first):
            slot = slots[segment.slot]
            prev = out[-1] if out else None
            if prev is not None and prev.tier == slot.kind and prev.last + 1 == segment.first:
                out[-1] = Residency(prev.tier, prev.first, segment.last, prev.read_mbit_per_s)
            else:
                out.append(
                    Residency(slot.kind, segment.first, segment.last, slot.tier.read_mbit_per_s)
                )
        return tuple(out)

    def replica_record(self, slots: Sequence[TierSlot], holder: str, ttl_ms: int) -> ReplicaRecord:
        """The block's Replica Record (R2) as ``holder`` publishes it."""
        digests = self.layer_digests
        return ReplicaRecord(
            block_key=self.ref.block_key,
            compat_id=self.ref.compat_id,
            scope_id=self.ref.scope_id,
            holder=holder,
            codec=self.codec,
            size=self.size,
            digest="sha-256:" + kc.replica_digest(digests).hex(),
            residency=self.residency(slots),
            ttl_ms=ttl_ms,
            layer_digests=tuple(d.hex() for d in digests),
        )

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
