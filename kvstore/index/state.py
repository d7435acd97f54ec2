"""Index state: replica records with TTLs, in memory or in Redis (P2, L1, OPS3).

Both implementations keep, per Block Key, the records of the holders that
published it, each with its own expiry, and answer a longest-prefix lookup:
the number of leading keys with at least one unexpired replica of the
requested scope and compatibility, and those replicas, stopping at the first
key without one (L1).

Records are kept as the JSON octets they will be sent as: a lookup of 8k
keys answers with ~24k records, and joining stored octets is what makes
that fast (parsing and re-serializing them would take ~100 ms).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..protocol.problems import InsufficientStorage
from ..protocol.records import ReplicaRecord
from ..protocol.wire import role_id


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
        self, scope_id: str, compat_id: str, block_keys: Sequence[str]
    ) -> list[list[bytes]]:
        """JSON of the replicas of the leading keys that have any, stopping at
        the first miss (L1)."""
        ...

    async def count(self) -> int:
        """Unexpired records (approximate for Redis)."""
        ...

    async def close(self) -> None: ...


class IndexFull(InsufficientStorage):
    title = "Index full"


@dataclass(slots=True)
class MemoryState:
    """One process's index: a dict per Block Key, expiry checked on access.

    No timer per record: an expired record is dropped when a lookup or a
    publish touches its key, and a sweep runs when the record cap is reached,
    so memory stays bounded by ``max_records``.
    """

    max_records: int = 1_000_000
    clock: Callable[[], float] = time.monotonic
    #: block key -> holder id (H6) -> (scope_id, compat_id, record JSON, expiry)
    _records: dict[str, dict[str, tuple[str, str, bytes, float]]] = field(default_factory=dict)
    _size: int = 0

    def _live(self, block_key: str, now: float) -> dict[str, tuple[str, str, bytes, float]]:
        replicas = self._records.get(block_key)
        if not replicas:
            return {}
        dead = [holder for holder, entry in replicas.items() if entry[3] <= now]
        for holder in dead:
            del replicas[holder]
        self._size -= len(dead)
        if not replicas:
            del self._records[block_key]
        return replicas

    def _sweep(self, now: float) -> None:
        for block_key in list(self._records):
            self._live(block_key, now)

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        now = self.clock()
        replicas = self._live(record.block_key, now)
        holder_id = role_id(record.holder)
        if holder_id not in replicas:
            if self._size >= self.max_records:
                self._sweep(now)
            if self._size >= self.max_records:
                raise IndexFull(f"the index holds its maximum of {self.max_records} records")
            self._size += 1
        self._records.setdefault(record.block_key, replicas)[holder_id] = (
            record.scope_id,
            record.compat_id,
            json.dumps(record.to_json(), separators=(",", ":")).encode(),
            now + ttl_ms / 1000,
        )

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        entry = self._live(block_key, self.clock()).get(holder_id)
        return None if entry is None else entry[0]

    async def delete(self, holder_id: str, block_key: str) -> bool:
        replicas = self._live(block_key, self.clock())
        if holder_id not in replicas:
            return False
        del replicas[holder_id]
        self._size -= 1
        if not replicas:
            self._records.pop(block_key, None)
        return True

    async def lookup(
        self, scope_id: str, compat_id: str, block_keys: Sequence[str]
    ) -> list[list[bytes]]:
        now = self.clock()
        matched: list[list[bytes]] = []
        records = self._records
        for block_key in block_keys:
            replicas = records.get(block_key)
            if not replicas:
                break  # L1: the chain is broken here
            # Read-only: expired entries are skipped here and dropped by writes.
            found = [
                raw
                for scope, compat, raw, expires in replicas.values()
                if expires > now and scope == scope_id and compat == compat_id
            ]
            if not found:
                break
            matched.append(found)
        return matched

    async def count(self) -> int:
        self._sweep(self.clock())
        return self._size

    async def close(self) -> None:
        pass
