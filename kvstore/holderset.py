"""A set of holders that share the writing: rendezvous hashing and discovery.

A holder run with ``[server] workers = N`` is N KVSP holders, each with its
own base URI (docs/workers.md). Every worker answers ``GET {base}shards``
(ours, not KVSP) with the base URIs of all of them, so a client configured
with one URI finds the rest: :meth:`HolderSet.discover`.

Which holder of a set takes a block is decided by rendezvous (highest
random weight) hashing of the holder's base URI with the Block Key
(:func:`rank`): every client, instance and engine plug-in computes the same
order without talking to each other, and when a holder joins or leaves only
the blocks it takes or took move. A holder that fails a request (unreachable,
5xx) is skipped for ``down_s``: its blocks go to the next of their order,
and reads try there too (:meth:`HolderSet.get_block`), so a dead worker
costs a miss or a detour, never an error while another holder is up.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .protocol._bytes import BytesLike
from .protocol.problems import KvspError, NotFound, PreconditionFailed
from .protocol.records import ReplicaRecord

log = logging.getLogger("kvstore.holderset")


def rank(holders: Iterable[str], block_key: str) -> list[str]:
    """``holders`` in rendezvous order for ``block_key``: the first takes it.

    The weight is SHA-256 of the base URI followed by the key (hex, as in
    the resource path); the engine plug-ins have named their chunks' holders
    this way since they were written, so their caches keep their places."""
    key = block_key.encode()
    return sorted(holders, key=lambda h: hashlib.sha256(h.encode() + key).digest())


def base(uri: str) -> str:
    """A base URI as the set keeps it (with its trailing slash)."""
    return uri if uri.endswith("/") else uri + "/"


def fails_holder(exc: BaseException) -> bool:
    """Whether an error says the holder, not the request, is at fault: it
    did not answer (transport errors come as status 500), or answered 5xx.
    507 (no room) is an answer about space, not a failed holder."""
    return isinstance(exc, KvspError) and exc.status >= 500 and exc.status != 507


class DownHolders:
    """Holders skipped for a while after a request to them failed, so that a
    dead or slow holder costs one timeout, not one per block. The one
    implementation behind :class:`HolderSet`, the engines' chunk store and
    :mod:`kvstore.fetch` (whose threads share it: each update is one dict
    operation)."""

    def __init__(self, down_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.down_s = down_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def up(self, holder: str) -> bool:
        return self._until.get(holder, 0.0) <= self._clock()

    def failed(self, holder: str) -> None:
        """Skip ``holder`` for ``down_s`` from now."""
        self._until[holder] = self._clock() + self.down_s

    def order(self, holders: Iterable[str]) -> list[str]:
        """``holders`` in their order, those marked down moved last (tried
        only when every other one failed too)."""
        now = self._clock()
        return sorted(holders, key=lambda h: self._until.get(h, 0.0) > now)  # stable


class ShardSource(Protocol):
    async def shards(self, holder: str) -> list[str]: ...


class BlockClient(Protocol):
    async def put_block(
        self, holder: str, compat_id: str, scope_id: str, block_key: str, data: BytesLike
    ) -> ReplicaRecord: ...

    async def get_block(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        *,
        layers: tuple[int, int] | None = None,
        codec: int | None = None,
        record: ReplicaRecord | None = None,
    ) -> bytes: ...


class NoHolder(KvspError):
    """No holder of the set could take or serve a block (each one's error is logged)."""

    status = 503
    title = "No holder available"


class HolderSet:
    """Holders that share the writing of blocks (see the module).

    ``seeds`` are base URIs as configured; until :meth:`discover` runs they
    are the set. Not thread-safe; meant for one event loop, like the client
    it is used with."""

    #: After a discovery a seed did not answer, how long until the next.
    rediscover_s = 30.0

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        down_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not seeds:
            raise ValueError("a holder set needs at least one holder URI")
        self.seeds = tuple(dict.fromkeys(base(s) for s in seeds))
        self.holders: tuple[str, ...] = self.seeds
        self.discovered = False
        self.down = DownHolders(down_s, clock)
        self._clock = clock
        self._discover_after = 0.0

    def needs_discovery(self) -> bool:
        """Whether :meth:`discover` should run now: not yet done, and not
        tried within the last ``rediscover_s`` (a seed that did not answer)."""
        return not self.discovered and self._clock() >= self._discover_after

    def __repr__(self) -> str:
        return f"HolderSet({list(self.holders)!r})"

    async def discover(self, client: ShardSource) -> tuple[str, ...]:
        """Each seed's ``GET shards``: the set becomes every worker of every
        seed, in the seeds' order. A seed that does not answer it (another
        KVSP implementation answers 404; an unreachable one is tried again at
        the next call) stands for itself."""
        found: dict[str, None] = {}
        complete = True
        for seed in self.seeds:
            try:
                listed = [base(u) for u in await client.shards(seed)]
            except KvspError as exc:
                listed = [seed]  # a lone holder (404), another implementation (any 4xx)
                if fails_holder(exc):  # unreachable, 5xx: asked again later
                    log.warning(
                        "holder %s: no shard list (%s); using it alone for now", seed, exc.detail
                    )
                    complete = False
            found.update(dict.fromkeys(listed or [seed]))
        self.holders = tuple(found)
        self.discovered = complete
        self._discover_after = self._clock() + self.rediscover_s
        return self.holders

    @property
    def down_s(self) -> float:
        return self.down.down_s

    def up(self, holder: str) -> bool:
        return self.down.up(holder)

    def failed(self, holder: str, exc: BaseException | None = None) -> None:
        """Skip ``holder`` for ``down_s`` (a request to it failed)."""
        self.down.failed(holder)
        log.warning(
            "holder %s failed (%s); skipped for %.0f s",
            holder,
            getattr(exc, "detail", exc),
            self.down_s,
        )

    def order(self, block_key: str) -> list[str]:
        """The set in rendezvous order for ``block_key``, holders marked
        down moved last (tried only when every other one failed too)."""
        return self.down.order(rank(self.holders, block_key))

    def owner(self, block_key: str) -> str:
        """The holder that takes ``block_key`` now."""
        return self.order(block_key)[0]

    async def put_block(
        self,
        client: BlockClient,
        compat_id: str,
        scope_id: str,
        block_key: str,
        data: BytesLike,
    ) -> tuple[str, ReplicaRecord | None]:
        """Store a block at the first holder of its order that takes it:
        ``(holder, record)``; the record is None when that holder had it
        already (BL7's 412). A holder with no room (507) passes it to the
        next, unmarked; a refusal (4xx) is raised: another holder of the
        same deployment would refuse it the same way."""
        last: BaseException | None = None
        for holder in self.order(block_key):
            try:
                return holder, await client.put_block(holder, compat_id, scope_id, block_key, data)
            except PreconditionFailed:
                return holder, None
            except KvspError as exc:
                if exc.status == 507:
                    last = exc
                    continue
                if not fails_holder(exc):
                    raise
                self.failed(holder, exc)
                last = exc
        raise NoHolder(f"no holder of {len(self.holders)} took block {block_key[:16]}: {last}")

    async def get_block(
        self,
        client: BlockClient,
        compat_id: str,
        scope_id: str,
        block_key: str,
        *,
        layers: tuple[int, int] | None = None,
        record: ReplicaRecord | None = None,
        tries: int = 2,
    ) -> tuple[str, bytes]:
        """Fetch (and verify, BL6) a block from the first of its order that
        serves it, asking at most ``tries`` holders: a block is at the first
        holder of its order unless that one was down when it was written.
        :class:`NotFound` when none of them has it."""
        missing = 0
        last: BaseException | None = None
        for holder in self.order(block_key)[:tries]:
            try:
                return holder, await client.get_block(
                    holder, compat_id, scope_id, block_key, layers=layers, record=record
                )
            except NotFound as exc:
                missing += 1
                last = exc
            except KvspError as exc:
                if not fails_holder(exc):
                    raise
                self.failed(holder, exc)
                last = exc
        if missing:
            raise NotFound(f"block {block_key[:16]} is at none of its holders ({last})")
        raise NoHolder(f"no holder of {len(self.holders)} served block {block_key[:16]}: {last}")
