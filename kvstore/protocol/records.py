"""Records of the data plane (R1, R2, R5): replicas, lookup, leases, prefetch.

Each record is a frozen dataclass with ``from_json`` (validate a received
object; unknown members are ignored, R1) and ``to_json`` (the object to send;
absent optional members are left out, not written as null).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ._json import (
    UINT32_MAX,
    Obj,
    check_range,
    check_uri,
    drop_none,
    fail,
    hex32_list,
)
from .problems import DigestMismatch

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
class LookupRequest:
    """``POST lookup`` body (L1). ``max_keys`` bounds the request (L4)."""

    scope_id: str
    compat_id: str
    block_keys: tuple[str, ...]
    targets: tuple[str, ...] | None = None

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
        )

    def to_json(self) -> dict[str, Any]:
        return drop_none(
            {
                "scope_id": self.scope_id,
                "compat_id": self.compat_id,
                "block_keys": list(self.block_keys),
                "targets": None if self.targets is None else list(self.targets),
            }
        )


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
    """``POST lookup`` answer: ``replicas[i]`` holds the records of matched key i (L1)."""

    matched: int
    replicas: tuple[tuple[ReplicaRecord, ...], ...]
    targets: tuple[TargetEstimate, ...] = ()

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
        if len(replicas) != matched:
            fail("lookup_response.replicas", f"has {len(replicas)} entries, matched is {matched}")
        targets = tuple(
            TargetEstimate.from_json(item, path) for item, path in obj.items("targets", default=[])
        )
        return cls(matched, tuple(replicas), targets)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "matched": self.matched,
            "replicas": [[r.to_json() for r in records] for records in self.replicas],
        }
        if self.targets:
            out["targets"] = [t.to_json() for t in self.targets]
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
