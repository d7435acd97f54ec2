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

from ..native import KeyTable, walk
from ..protocol.keys import PackedKeys
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


# Plain tuples, not classes: the garbage collector stops tracking a tuple of
# strings, octets and numbers (not a subclass of tuple), and then the dicts
# that hold only such tuples.
#: (kind = scope id + compat id, record JSON, shape JSON, expiry)
_Replica = tuple[str, bytes, bytes, float]
#: A key's live replicas of one kind joined for answers:
#: (kind, "[r1,r2,...]", "[s1,s2,...]", the first expiry among them)
_Group = tuple[str, bytes, bytes, float]


#: Distinct joined shape lists kept, so that equal ones are one object: keys
#: on the same holders then share it, and grouping a lookup's keys by their
#: shapes compares identities (a deployment has few distinct lists).
SHAPES_INTERNED = 1 << 16


def _group(
    replicas: dict[str, _Replica], kind: str, now: float, interned: dict[bytes, bytes]
) -> _Group | None:
    live = [r for r in replicas.values() if r[3] > now and r[0] == kind]
    if not live:
        return None
    shapes = b"[" + b",".join(r[2] for r in live) + b"]"
    if len(interned) >= SHAPES_INTERNED:
        interned.clear()
    return (
        kind,
        b"[" + b",".join(r[1] for r in live) + b"]",
        interned.setdefault(shapes, shapes),
        min(r[3] for r in live),
    )


@dataclass(slots=True)
class MemoryState:
    """One process's index: records per Block Key, expiry checked on access.

    No timer per record: an expired record is dropped when a publish touches
    its key, is skipped by lookups, and a sweep runs when the record cap is
    reached, so memory stays bounded by ``max_records`` (a looked-up key
    also keeps its records joined, so the bound is about twice the records'
    octets).

    Entries are tuples of strings, octets and numbers in plain dicts, which
    the garbage collector stops tracking: with objects per record, every
    full collection walked every record of the index (~100 ms at 200k
    records, a pause in the middle of some lookup).
    """

    max_records: int = 1_000_000
    clock: Callable[[], float] = time.monotonic
    #: block key -> holder id (H6) -> replica
    _replicas: dict[str, dict[str, _Replica]] = field(default_factory=dict)
    #: block key -> its live replicas joined, built by the first lookup after
    #: a change; keyed by the keys' octets (a packed lookup makes no strings)
    _groups: KeyTable = field(default_factory=KeyTable)
    _interned: dict[bytes, bytes] = field(default_factory=dict)
    _size: int = 0

    def _live(self, block_key: str, now: float) -> dict[str, _Replica] | None:
        replicas = self._replicas.get(block_key)
        if replicas is None:
            return None
        dead = [holder for holder, r in replicas.items() if r[3] <= now]
        if dead:
            for holder in dead:
                del replicas[holder]
            self._size -= len(dead)
            self._groups.pop(block_key, None)
        if not replicas:
            del self._replicas[block_key]
            return None
        return replicas

    def _sweep(self, now: float) -> None:
        for block_key in list(self._replicas):
            self._live(block_key, now)

    def check_room(self, record: ReplicaRecord) -> None:
        """Raise :class:`IndexFull` where :meth:`put` of ``record`` would now
        (a new record at the cap, after expired ones are swept)."""
        now = self.clock()
        replicas = self._live(record.block_key, now)
        if replicas is None or role_id(record.holder) not in replicas:
            self._make_room(now)

    def _make_room(self, now: float) -> None:
        if self._size >= self.max_records:
            self._sweep(now)
        if self._size >= self.max_records:
            raise IndexFull(f"the index holds its maximum of {self.max_records} records")

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        now = self.clock()
        replicas = self._live(record.block_key, now)
        holder_id = role_id(record.holder)
        if replicas is None or holder_id not in replicas:
            self._make_room(now)
            self._size += 1
            if replicas is None:
                replicas = self._replicas[record.block_key] = {}
        raw, shape = record_octets(record)
        replicas[holder_id] = (record.scope_id + record.compat_id, raw, shape, now + ttl_ms / 1000)
        self._groups.pop(record.block_key, None)

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        replicas = self._live(block_key, self.clock())
        replica = None if replicas is None else replicas.get(holder_id)
        return None if replica is None else replica[0][:32]

    async def delete(self, holder_id: str, block_key: str) -> bool:
        replicas = self._live(block_key, self.clock())
        if replicas is None or holder_id not in replicas:
            return False
        del replicas[holder_id]
        self._groups.pop(block_key, None)
        self._size -= 1
        if not replicas:
            del self._replicas[block_key]
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
        groups, kind = self._groups, scope_id + compat_id
        walked: Sequence[str] | bytes
        if isinstance(block_keys, PackedKeys):
            walked = block_keys.octets  # walked as octets; a key's hex only at a miss
        elif isinstance(block_keys, (list, tuple)):
            walked = block_keys
        else:
            walked = block_keys = tuple(block_keys)
        into_records = chunks if records else None
        into_shapes = found_shapes if shapes else None
        # The keys whose joined groups are cached, of this kind and unexpired
        # (a hot prompt's, between two publishes), in one loop in C (walk);
        # key by key here only where a group must be joined again.
        matched = walk(groups, walked, 0, kind, now, into_records, into_shapes)
        while matched < len(block_keys):
            block_key = block_keys[matched]
            # Expired records are skipped here and dropped by writes.
            replicas = self._replicas.get(block_key)
            group = None if replicas is None else _group(replicas, kind, now, self._interned)
            if group is None:
                break  # L1: the chain is broken here
            groups[block_key] = group
            matched += 1
            if records:
                chunks.append(group[1])
            if shapes:
                found_shapes.append(group[2])
            matched = walk(groups, walked, matched, kind, now, into_records, into_shapes)
        return Hits(matched, chunks, found_shapes if shapes else None)

    async def count(self) -> int:
        self._sweep(self.clock())
        return self._size

    async def close(self) -> None:
        pass
