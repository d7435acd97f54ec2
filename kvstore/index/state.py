"""Index state: replica records with TTLs, in memory or in Redis (P2, L1, OPS3).

Both implementations keep, per Block Key, the records of the holders that
published it, each with its own expiry, and answer a longest-prefix lookup:
the number of leading keys with at least one unexpired replica of the
requested scope and compatibility, and those replicas, stopping at the first
key without one (L1).

Records are kept as the JSON octets they will be sent as, and a lookup
answers with those octets (:class:`Hits`), already joined per key: an 8k-key
lookup answers with ~24k records (~60 MB with 32 layer digests each), and
parsing, re-serializing or even re-joining them per record is what would
make it slow. Beside each record a state keeps its :class:`ReplicaShape`
(holder, size, residency), all that placement estimates need (PL1).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol.placement import ReplicaShape
from ..protocol.problems import InsufficientStorage
from ..protocol.records import ReplicaRecord
from ..protocol.wire import role_id


@dataclass(slots=True)
class Hits:
    """What a lookup matched (L1), as the answer carries it.

    ``chunks`` joined with ``,`` are the items of the answer's ``replicas``
    array: each chunk holds the JSON arrays of records of one or more
    consecutive matched keys (``[r1,r2],[r3]``). ``shapes``, when asked for,
    holds per matched key a JSON array of its replicas' shapes.
    """

    matched: int = 0
    chunks: list[bytes | memoryview] = field(default_factory=list)
    shapes: list[bytes] | None = None

    def records(self) -> list[list[Any]]:
        """The matched records parsed (small answers: tests and tools)."""
        value: list[list[Any]] = json.loads(b"[" + b",".join(self.chunks) + b"]")
        return value


def record_octets(record: ReplicaRecord) -> tuple[bytes, bytes]:
    """The JSON a state keeps for ``record``, and its shape's."""
    raw = json.dumps(record.to_json(), separators=(",", ":"), allow_nan=False).encode()
    return raw, ReplicaShape.of(record).encode()


class IndexState(Protocol):
    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        """Publish or refresh ``record`` for ``ttl_ms`` (idempotent, P2)."""
        ...

    async def delete(self, holder_id: str, block_key: str) -> bool:
        """Withdraw the record of the holder whose id (H6) is ``holder_id``;
        False when there was no such record."""
        ...

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        """The scope of an unexpired record, or None."""
        ...

    async def lookup(
        self,
        scope_id: str,
        compat_id: str,
        block_keys: Sequence[str],
        shapes: bool = False,
        records: bool = True,
    ) -> Hits:
        """The replicas of the leading keys that have any, stopping at the
        first miss (L1); with ``shapes``, their shapes too (PL1); without
        ``records``, the matched count and shapes only (``chunks`` empty)."""
        ...

    async def count(self) -> int:
        """Unexpired records (approximate for Redis)."""
        ...

    async def close(self) -> None: ...


class IndexFull(InsufficientStorage):
    title = "Index full"


@dataclass(slots=True)
class _Replica:
    kind: str  # scope id + compat id
    raw: bytes
    shape: bytes
    expires: float


@dataclass(slots=True)
class _Group:
    """A key's live replicas of one scope and compat ID, joined for answers."""

    kind: str  # scope id + compat id
    records: bytes  # [r1,r2,...]
    shapes: bytes  # [s1,s2,...]
    valid_until: float  # the first expiry among them


@dataclass(slots=True)
class _Key:
    replicas: dict[str, _Replica] = field(default_factory=dict)  # holder id -> replica
    group: _Group | None = None  # built by the first lookup after a change

    def regroup(self, kind: str, now: float) -> _Group | None:
        live = [r for r in self.replicas.values() if r.expires > now and r.kind == kind]
        if not live:
            return None
        self.group = _Group(
            kind,
            b"[" + b",".join(r.raw for r in live) + b"]",
            b"[" + b",".join(r.shape for r in live) + b"]",
            min(r.expires for r in live),
        )  # fmt: skip
        return self.group


@dataclass(slots=True)
class MemoryState:
    """One process's index: records per Block Key, expiry checked on access.

    No timer per record: an expired record is dropped when a publish touches
    its key, is skipped by lookups, and a sweep runs when the record cap is
    reached, so memory stays bounded by ``max_records`` (a looked-up key
    also keeps its records joined, so the bound is about twice the records'
    octets).
    """

    max_records: int = 1_000_000
    clock: Callable[[], float] = time.monotonic
    _keys: dict[str, _Key] = field(default_factory=dict)
    _size: int = 0

    def _live(self, block_key: str, now: float) -> _Key | None:
        entry = self._keys.get(block_key)
        if entry is None:
            return None
        dead = [holder for holder, r in entry.replicas.items() if r.expires <= now]
        if dead:
            for holder in dead:
                del entry.replicas[holder]
            self._size -= len(dead)
            entry.group = None
        if not entry.replicas:
            del self._keys[block_key]
            return None
        return entry

    def _sweep(self, now: float) -> None:
        for block_key in list(self._keys):
            self._live(block_key, now)

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        now = self.clock()
        entry = self._live(record.block_key, now)
        holder_id = role_id(record.holder)
        if entry is None or holder_id not in entry.replicas:
            if self._size >= self.max_records:
                self._sweep(now)
            if self._size >= self.max_records:
                raise IndexFull(f"the index holds its maximum of {self.max_records} records")
            self._size += 1
            if entry is None:
                entry = self._keys[record.block_key] = _Key()
        raw, shape = record_octets(record)
        entry.replicas[holder_id] = _Replica(
            record.scope_id + record.compat_id, raw, shape, now + ttl_ms / 1000
        )
        entry.group = None

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        entry = self._live(block_key, self.clock())
        replica = None if entry is None else entry.replicas.get(holder_id)
        return None if replica is None else replica.kind[:32]

    async def delete(self, holder_id: str, block_key: str) -> bool:
        entry = self._live(block_key, self.clock())
        if entry is None or holder_id not in entry.replicas:
            return False
        del entry.replicas[holder_id]
        entry.group = None
        self._size -= 1
        if not entry.replicas:
            del self._keys[block_key]
        return True

    async def lookup(
        self,
        scope_id: str,
        compat_id: str,
        block_keys: Sequence[str],
        shapes: bool = False,
        records: bool = True,
    ) -> Hits:
        now = self.clock()
        chunks: list[bytes | memoryview] = []
        found_shapes: list[bytes] = []
        get, kind = self._keys.get, scope_id + compat_id
        add_records, add_shapes = chunks.append, found_shapes.append
        matched = 0
        for block_key in block_keys:  # (the hot loop of an 8k-key lookup)
            entry = get(block_key)
            if entry is None:
                break  # L1: the chain is broken here
            group = entry.group
            if group is None or group.valid_until <= now or group.kind != kind:
                # Expired records are skipped here and dropped by writes.
                group = entry.regroup(kind, now)
                if group is None:
                    break
            matched += 1
            if records:
                add_records(group.records)
            if shapes:
                add_shapes(group.shapes)
        return Hits(matched, chunks, found_shapes if shapes else None)

    async def count(self) -> int:
        self._sweep(self.clock())
        return self._size

    async def close(self) -> None:
        pass
