"""The Tier interface: one small async key/value contract per storage tier.

A tier stores opaque segment octets under string keys. It knows nothing of
containers, leases, encryption or capacity policy: that is the manager's work,
done once (STYLE 5). Each backend (``kvstore/backends/*.py``) implements five methods
and translates its library's exceptions into ours at the boundary (STYLE 6):

* a missing key is ``None`` from :meth:`Tier.get` (a plain miss);
* a backend that cannot answer raises :class:`TierUnavailable`;
* a backend out of space raises :class:`TierFull`.

Keys given by the manager always start with the 64-hex Block Key followed by
``/``; a backend may rely on that (Redis uses it as a Cluster hash tag so all
segments of a block share a slot).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Protocol, runtime_checkable

from ..protocol._bytes import BytesLike

#: "KVSP Storage Tiers" registry names, fastest first: the demotion chain.
TIER_ORDER = ("device", "host", "local-storage", "remote-memory", "remote-storage")


@runtime_checkable
class ArenaTier(Protocol):
    """A tier that keeps blocks in an arena of its own (the host tier's
    business, not every tier's): the store asks it for memory to receive a
    block into, and reports its figures."""

    def arena_figures(self) -> tuple[int, int, int] | None:
        """(octets mapped, octets in extents, blocks kept outside the arena);
        None while it has no arena (it could not map one)."""

    def buffer(self, size: int) -> memoryview | None:
        """Writable memory for ``size`` octets that ``put`` keeps without a
        copy when given the whole of it, or None (no room, no arena)."""


class StorageInUse(RuntimeError):
    """Another live process owns a tier's storage: one owner per storage
    (an LMDB directory, a Redis or S3 key prefix). The message names it."""


class Tier(ABC):
    """One storage tier. Subclasses set :attr:`kind` and implement five methods."""

    #: Registry name of the tier (R5), e.g. ``"host"``.
    kind: str
    #: True when data outlives the process (stored encrypted by the manager, SEC4).
    persistent: bool = False
    #: Rate this tier can be read at, for residency records (PL1); None if unknown.
    read_mbit_per_s: float | None = None
    #: Longest a call may take: past it the manager counts the tier unavailable
    #: (a miss or the next tier, never a request waiting on a hung tier).
    #: None: no deadline (memory tiers). Set per tier by ``deadline_s``.
    deadline_s: float | None = None

    @abstractmethod
    async def get(self, key: str) -> BytesLike | None:
        """The octets stored under ``key``, or None when there are none."""

    @abstractmethod
    async def put(self, key: str, value: BytesLike) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    @abstractmethod
    def keys(self) -> AsyncIterator[str]:
        """Every key stored (used to find segments again after a restart)."""

    async def sized_keys(self) -> AsyncIterator[tuple[str, int | None]]:
        """Every key stored with the octets of its value, as the listing
        tells them without reading the value (LMDB's pages, S3's listing,
        Redis's STRLEN); None where the tier cannot (a restart then reads
        that value to size it). Restart recovery sizes segments with it."""
        async for key in self.keys():
            yield key, None

    async def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release connections and handles."""

    async def claim(self, owner: str, ttl_s: float) -> None:  # noqa: B027 - optional hook
        """Take this tier's storage for ``owner`` (this process), or raise
        :class:`StorageInUse` naming the live process that has it. Called
        again every ``ttl_s`` / 3 to keep it: a claim not kept for ``ttl_s``
        frees itself (a crashed owner). Memory tiers own nothing to claim."""

    async def release(self, owner: str) -> None:  # noqa: B027 - optional hook
        """Give up what :meth:`claim` took (a clean stop)."""

    def provision(self, capacity: int) -> None:  # noqa: B027 - optional hook
        """Told once, before use, the octets the store may keep here (a
        memory tier may reserve them up front)."""

    # Batch forms, built from the single-item ones; backends with a native
    # batch operation (Redis pipelines) override them.

    async def get_many(self, keys: Sequence[str]) -> list[BytesLike | None]:
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    async def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> None:
        await asyncio.gather(*(self.put(key, value) for key, value in items))

    async def delete_many(self, keys: Iterable[str]) -> None:
        await asyncio.gather(*(self.delete(key) for key in keys))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind}>"
