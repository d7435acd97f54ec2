"""Records of the data plane (R1, R2, R5): replicas, lookup, leases, prefetch.

Each record is a frozen dataclass with ``from_json`` (validate a received
object; unknown members are ignored, R1) and ``to_json`` (the object to send;
absent optional members are left out, not written as null).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ._json import (
    UINT32_MAX,
    Obj,
    check_int,
    check_range,
    check_uri,
    drop_none,
    fail,
    hex32_list,
)
from .problems import DigestMismatch
from .residency import Resident

# R5: "KVSP Storage Tiers" registry, fastest first (also the demotion chain).
TIERS = ("device", "host", "local-storage", "remote-memory", "remote-storage")
STORAGE_TIERS = frozenset({"local-storage", "remote-storage"})
LAYER_ORDERS = frozenset({"ascending"})
PREFETCH_STATES = frozenset({"pending", "partial", "complete", "failed"})

_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")

# Bounds on what one received record may carry (hostile input).
MAX_LAYERS = 4096
MAX_SOURCES = 64


@dataclass(frozen=True, slots=True)
class Residency:
    """Layers ``first..last`` (inclusive) of a replica reside in ``tier``."""

    tier: str
    first: int
    last: int
    read_mbit_per_s: float | None = None

    @property
    def layer_count(self) -> int:
        return self.last - self.first + 1

    @classmethod
    def from_json(cls, value: Any, path: str) -> Residency:
        obj = Obj(value, path)
        first, last = check_range(obj.value.get("layers"), f"{path}.layers", half_open=False)
        return cls(
            tier=obj.name("tier"),
            first=first,
            last=last,
            read_mbit_per_s=obj.number("read_mbit_per_s", None, lo=1e-6),
        )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "tier": self.tier,
                "layers": [self.first, self.last],
                "read_mbit_per_s": self.read_mbit_per_s,
            }
        )


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A copy of a block, or of some of its layers, at a holder (R2)."""

    block_key: str
    compat_id: str
    scope_id: str
    holder: str
    codec: int
    size: int
    digest: str
    residency: tuple[Residency, ...]
    ttl_ms: int
    layer_digests: tuple[str, ...] | None = None
    moqt_namespace: str | None = None

    @property
    def layers(self) -> tuple[int, int] | None:
        """The inclusive layer span of the residency, or None when empty."""
        if not self.residency:
            return None
        return min(r.first for r in self.residency), max(r.last for r in self.residency)

    @classmethod
    def from_json(cls, value: Any, path: str = "replica") -> ReplicaRecord:
        obj = Obj(value, path)
        holder = obj.uri("holder")
        moqt_namespace = obj.text("moqt_namespace", None, max_len=1024)
        if urlsplit(holder).scheme == "moqt":  # urlsplit lowercases the scheme
            if moqt_namespace is None:
                fail(f"{path}.moqt_namespace", "required when the holder is a moqt URI")
            # base64url without padding: its alphabet only, and never a length
            # of 1 mod 4 (no whole octet), and not empty.
            if not _BASE64URL.fullmatch(moqt_namespace) or len(moqt_namespace) % 4 == 1:
                fail(f"{path}.moqt_namespace", "must be base64url without padding")
        residency = tuple(
            Residency.from_json(item, item_path)
            for item, item_path in obj.items("residency", max_items=MAX_LAYERS)
        )
        # R2: layer ranges of the residency MUST NOT overlap.
        spans = sorted((r.first, r.last) for r in residency)
        for (_, prev_last), (first, _) in itertools.pairwise(spans):
            if first <= prev_last:
                fail(f"{path}.residency", "layer ranges overlap")
        layer_digests = None
        if "layer_digests" in obj:
            layer_digests = hex32_list(obj, "layer_digests", max_items=MAX_LAYERS)
            if spans and spans[-1][1] >= len(layer_digests):
                fail(f"{path}.layer_digests", "fewer digests than the layers in residency")
        record = cls(
            block_key=obj.hex32("block_key"),
            compat_id=obj.hex32("compat_id"),
            scope_id=obj.hex16("scope_id"),
            holder=holder,
            codec=obj.integer("codec", lo=1, hi=0xFFFF),
            size=obj.integer("size"),
            digest=obj.digest("digest"),
            residency=residency,
            ttl_ms=obj.integer("ttl_ms", hi=UINT32_MAX),
            layer_digests=layer_digests,
            moqt_namespace=moqt_namespace,
        )
        record.check_digests()
        return record

    def check_digests(self) -> None:
        """B3: the replica digest is the digest of the layer digests, when both are present."""
        if self.layer_digests is None:
            return
        joined = b"".join(bytes.fromhex(d) for d in self.layer_digests)
        if "sha-256:" + hashlib.sha256(joined).hexdigest() != self.digest:
            raise DigestMismatch(
                f"replica {self.block_key}: digest does not match its layer_digests"
            )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "block_key": self.block_key,
                "compat_id": self.compat_id,
                "scope_id": self.scope_id,
                "holder": self.holder,
                "codec": self.codec,
                "size": self.size,
                "digest": self.digest,
                "layer_digests": None if self.layer_digests is None else list(self.layer_digests),
                "residency": [r.to_json() for r in self.residency],
                "ttl_ms": self.ttl_ms,
                "moqt_namespace": self.moqt_namespace,
            }
        )


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """What placement reads of a Replica Record: where it is and how fast it reads."""

    holder: str
    size: int
    residency: tuple[Residency, ...]
    #: len(layer_digests), when the record lists them.
    layer_count: int | None = None

    @classmethod
    def of(cls, record: ReplicaRecord) -> ReplicaShape:
        digests = record.layer_digests
        return cls(
            record.holder, record.size, record.residency, None if digests is None else len(digests)
        )

    @property
    def whole(self) -> bool:
        """False for a replica known to hold only some layers of its block."""
        if self.layer_count is None:
            return True
        return sum(r.layer_count for r in self.residency) == self.layer_count

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "size": self.size,
            "layer_count": self.layer_count,
            "residency": [r.to_json() for r in self.residency],
        }

    def encode(self) -> bytes:
        """Compact JSON octets (what an index state keeps beside each record)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, value: Any, path: str = "shape") -> ReplicaShape:
        obj = Obj(value, path)
        return cls(
            holder=obj.uri("holder"),
            size=obj.integer("size"),
            residency=tuple(Residency.from_json(v, p) for v, p in obj.items("residency")),
            layer_count=obj.integer("layer_count", None),
        )


def decode_shapes(octets: bytes) -> tuple[ReplicaShape, ...]:
    """A JSON array of shapes (one matched block's replicas) back to shapes."""
    value = json.loads(octets)
    if not isinstance(value, list):
        value = [value]
    return tuple(ReplicaShape.from_json(v, f"shapes[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True, slots=True)
class ShapeRuns:
    """Ours (kvstore, not KVSP): a lookup's matched keys without their records.

    ``groups`` are the distinct lists of replica shapes among the matched
    keys; ``runs`` covers the matched keys in order as (group index, number
    of consecutive keys). An IS answers so when asked with ``shapes_only``:
    a placement needs no more, and an 8k-key answer shrinks from ~60 MB of
    records to a few hundred octets.
    """

    groups: tuple[tuple[ReplicaShape, ...], ...]
    runs: tuple[tuple[int, int], ...]

    @property
    def matched(self) -> int:
        return sum(count for _, count in self.runs)

    def counts(self) -> list[tuple[tuple[ReplicaShape, ...], int]]:
        """Each group with the number of matched keys whose replicas have it."""
        totals = [0] * len(self.groups)
        for group, count in self.runs:
            totals[group] += count
        return [(g, n) for g, n in zip(self.groups, totals, strict=True) if n]

    @classmethod
    def from_json(cls, value: Any, path: str = "shapes") -> ShapeRuns:
        obj = Obj(value, path)
        groups = []
        for item, where in obj.items("groups", max_items=1 << 16):
            if not isinstance(item, list):
                fail(where, "must be an array of shapes")
            groups.append(
                tuple(ReplicaShape.from_json(v, f"{where}[{i}]") for i, v in enumerate(item))
            )
        runs = []
        for item, where in obj.items("runs", max_items=1 << 20):
            if not isinstance(item, list) or len(item) != 2:
                fail(where, "must be [group index, count]")
            group = check_int(item[0], where + "[0]", 0, len(groups) - 1)
            count = check_int(item[1], where + "[1]", 1, UINT32_MAX)
            runs.append((group, count))
        return cls(tuple(groups), tuple(runs))

    def to_json(self) -> dict[str, Any]:
        return {
            "groups": [[s.to_json() for s in group] for group in self.groups],
            "runs": [list(run) for run in self.runs],
        }


def _plain_json_strings(values: Sequence[str]) -> bool:
    """True when every value stands in a JSON string as it is (printable
    ASCII without quote or backslash), checked by passes in C."""
    joined = "".join(values)
    return (
        bool(values)
        and joined.isascii()
        and joined.isprintable()
        and not ('"' in joined or "\\" in joined)
    )


@dataclass(frozen=True, slots=True)
class LookupRequest:
    """``POST lookup`` body (L1). ``max_keys`` bounds the request (L4).

    ``shapes_only`` is ours (kvstore, not KVSP): answer with
    :class:`ShapeRuns` instead of the records. An IS that does not know the
    member ignores it (R1) and answers with records.
    """

    scope_id: str
    compat_id: str
    #: A tuple of hex strings, or :class:`~kvstore.protocol.keys.PackedKeys`.
    block_keys: Sequence[str]
    targets: tuple[str, ...] | None = None
    shapes_only: bool = False

    @classmethod
    def from_json(cls, value: Any, max_keys: int = 8192, max_targets: int = 256) -> LookupRequest:
        obj = Obj(value, "lookup")
        targets = None
        if "targets" in obj:
            targets = tuple(
                check_uri(item if isinstance(item, str) else "", path)
                for item, path in obj.items("targets", max_items=max_targets)
            )
        return cls(
            scope_id=obj.hex16("scope_id"),
            compat_id=obj.hex32("compat_id"),
            block_keys=hex32_list(obj, "block_keys", max_items=max_keys),
            targets=targets,
            shapes_only=obj.flag("shapes_only", False),
        )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "scope_id": self.scope_id,
                "compat_id": self.compat_id,
                "block_keys": list(self.block_keys),
                "targets": None if self.targets is None else list(self.targets),
                "shapes_only": self.shapes_only or None,
            }
        )

    def encode(self) -> bytes:
        """:meth:`to_json` as JSON octets; keys that need no escaping (hex
        keys do not) are joined, not encoded one by one (an 8k-key request:
        ~0.3 ms instead of ~2)."""
        if not _plain_json_strings(self.block_keys):
            return json.dumps(self.to_json()).encode()
        rest = self.to_json()
        del rest["block_keys"]
        head = json.dumps(rest)[:-1].encode()
        return head + b', "block_keys": ["' + '", "'.join(self.block_keys).encode() + b'"]}'


@dataclass(frozen=True, slots=True)
class TargetEstimate:
    """Per-target placement estimates of a lookup answer (L2, PL1)."""

    instance: str
    fetch_us: float
    recompute_us: float

    @classmethod
    def from_json(cls, value: Any, path: str) -> TargetEstimate:
        obj = Obj(value, path)
        return cls(obj.uri("instance"), obj.number("fetch_us"), obj.number("recompute_us"))

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "fetch_us": self.fetch_us,
            "recompute_us": self.recompute_us,
        }


@dataclass(frozen=True, slots=True)
class LookupResponse:
    """``POST lookup`` answer: ``replicas[i]`` holds the records of matched key i (L1);
    or, answering ``shapes_only``, no records and ``shapes`` (ours)."""

    matched: int
    replicas: tuple[tuple[ReplicaRecord, ...], ...]
    targets: tuple[TargetEstimate, ...] = ()
    shapes: ShapeRuns | None = None
    #: Instances holding a prefix of the keys in their own memory (ours,
    #: kvstore.protocol.residency): never sources to fetch from.
    resident: tuple[Resident, ...] = ()

    @classmethod
    def from_json(cls, value: Any) -> LookupResponse:
        obj = Obj(value, "lookup_response")
        matched = obj.integer("matched")
        replicas = []
        for item, path in obj.items("replicas", default=[]):
            if not isinstance(item, list):
                fail(path, "must be an array of replica records")
            replicas.append(
                tuple(ReplicaRecord.from_json(r, f"{path}[{i}]") for i, r in enumerate(item))
            )
        shapes = None
        if "shapes" in obj:
            shapes = ShapeRuns.from_json(obj.value["shapes"], "lookup_response.shapes")
            if shapes.matched != matched:
                fail("lookup_response.shapes", f"covers {shapes.matched} keys, matched {matched}")
        if len(replicas) != matched and not (shapes is not None and not replicas):
            fail("lookup_response.replicas", f"has {len(replicas)} entries, matched is {matched}")
        targets = tuple(
            TargetEstimate.from_json(item, path) for item, path in obj.items("targets", default=[])
        )
        resident = tuple(
            Resident.from_json(item, path) for item, path in obj.items("resident", default=[])
        )
        return cls(matched, tuple(replicas), targets, shapes, resident)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "matched": self.matched,
            "replicas": [[r.to_json() for r in records] for records in self.replicas],
        }
        if self.targets:
            out["targets"] = [t.to_json() for t in self.targets]
        if self.shapes is not None:
            out["shapes"] = self.shapes.to_json()
        if self.resident:
            out["resident"] = [r.to_json() for r in self.resident]
        return out


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """``POST leases`` body (LE1): block keys to protect and the wanted TTL."""

    block_keys: tuple[str, ...]
    ttl_ms: int
    scope_id: str | None = None
    compat_id: str | None = None

    @classmethod
    def from_json(cls, value: Any, max_keys: int = 8192) -> LeaseRequest:
        obj = Obj(value, "lease")
        keys = hex32_list(obj, "block_keys", max_items=max_keys)
        if not keys:
            fail("lease.block_keys", "must list at least one block key")
        return cls(
            block_keys=keys,
            ttl_ms=obj.integer("ttl_ms", lo=1, hi=UINT32_MAX),
            scope_id=obj.hex16("scope_id") if "scope_id" in obj else None,
            compat_id=obj.hex32("compat_id") if "compat_id" in obj else None,
        )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "block_keys": list(self.block_keys),
                "ttl_ms": self.ttl_ms,
                "scope_id": self.scope_id,
                "compat_id": self.compat_id,
            }
        )


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """Answer to ``POST leases`` / ``PUT leases/{id}``: the lease and its granted TTL."""

    lease: str
    ttl_ms: int
    block_keys: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, value: Any) -> LeaseGrant:
        obj = Obj(value, "lease_grant")
        return cls(
            lease=obj.text("lease", max_len=128),
            ttl_ms=obj.integer("ttl_ms", hi=UINT32_MAX),
            block_keys=hex32_list(obj, "block_keys") if "block_keys" in obj else (),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lease": self.lease, "ttl_ms": self.ttl_ms}
        if self.block_keys:
            out["block_keys"] = list(self.block_keys)
        return out


@dataclass(frozen=True, slots=True)
class PrefetchBlock:
    block_key: str
    sources: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"block_key": self.block_key, "sources": list(self.sources)}


@dataclass(frozen=True, slots=True)
class PrefetchDirective:
    """``POST prefetch`` body (PF1, PF2)."""

    directive: str
    scope_id: str
    compat_id: str
    blocks: tuple[PrefetchBlock, ...]
    deadline_ms: int
    lease_ms: int
    layer_order: str = "ascending"
    request_ref: str | None = None

    @classmethod
    def from_json(cls, value: Any, max_blocks: int = 8192) -> PrefetchDirective:
        obj = Obj(value, "prefetch")
        blocks = []
        for item, path in obj.items("blocks", max_items=max_blocks):
            block = Obj(item, path)
            sources = tuple(
                check_uri(src if isinstance(src, str) else "", src_path)
                for src, src_path in block.items("sources", max_items=MAX_SOURCES)
            )
            if not sources:
                fail(f"{path}.sources", "must list at least one source")
            blocks.append(PrefetchBlock(block.hex32("block_key"), sources))
        return cls(
            directive=obj.uuid("directive"),
            request_ref=obj.text("request_ref", None),
            scope_id=obj.hex16("scope_id"),
            compat_id=obj.hex32("compat_id"),
            blocks=tuple(blocks),
            layer_order=obj.name("layer_order", LAYER_ORDERS, default="ascending"),
            deadline_ms=obj.integer("deadline_ms", hi=UINT32_MAX),
            lease_ms=obj.integer("lease_ms", hi=UINT32_MAX),
        )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "directive": self.directive,
                "request_ref": self.request_ref,
                "scope_id": self.scope_id,
                "compat_id": self.compat_id,
                "blocks": [b.to_json() for b in self.blocks],
                "layer_order": self.layer_order,
                "deadline_ms": self.deadline_ms,
                "lease_ms": self.lease_ms,
            }
        )


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """``GET prefetch/{id}`` answer (PF3)."""

    directive: str
    state: str
    loaded: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, value: Any) -> PrefetchStatus:
        obj = Obj(value, "prefetch_status")
        return cls(
            directive=obj.uuid("directive"),
            state=obj.name("state", PREFETCH_STATES),
            loaded=hex32_list(obj, "loaded") if "loaded" in obj else (),
        )

    def to_json(self) -> dict[str, Any]:
        return {"directive": self.directive, "state": self.state, "loaded": list(self.loaded)}
