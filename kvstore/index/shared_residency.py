"""Instance residency shared by several IS processes through Redis
(``[index] state`` ``redis`` or ``replicated``): a bridge's update taken by
one IS process is answered by every other.

Redis holds what is resident, one hash a instance (``<prefix>{res}:i:<id>``:
a field ``scope|compat|medium|key`` a record, ``@`` the instance's URI),
expiring with the instance's TTL, and a stream of the updates
(``<prefix>{res}:log``). All of them share one hash tag, so one
transaction (one node of a Redis Cluster) changes a hash and appends the
update: the hashes are always what the log, applied in order, gives.

Each process answers lookups from its own :class:`ResidencyBook`. At its
start it loads the hashes (what is resident now), then follows the log from
the entry it saw last before loading them (the updates in between applied
again change nothing: each sets a block's presence). An update returns once
this process's follower has applied it, with every earlier one, so the
updates of one bridge, taken by different processes, apply in the order it
sent them everywhere. ``known`` is whether Redis held the instance before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..protocol.residency import ResidencyGroup, ResidencyUpdate, Resident
from ..redis_client import ERRORS, connect
from ..storage.errors import TierUnavailable
from .readback import EntryId, ReadBack
from .readback import entry_id as _id
from .readback import text as _text
from .residency import ResidencyBook, ResidencyCounters

log = logging.getLogger("kvstore.index")

#: Updates kept in the log (a process further behind loads the hashes again).
LOG_KEPT = 100_000
READ_COUNT = 1000
READ_BLOCK_MS = 100
#: Longest an update waits to be read back before it is applied here anyway.
APPLY_WAIT_S = 2.0
#: After a failed start (Redis down), how long lookups skip residency.
RETRY_S = 5.0


def _field(group: ResidencyGroup, key: str) -> str:
    return f"{group.scope_id}|{group.compat_id}|{group.medium}|{key}"


def _groups(fields: dict[str, str]) -> tuple[ResidencyGroup, ...]:
    """A hash's records as additions, by scope, compat and medium."""
    by: dict[tuple[str, str, str], list[str]] = {}
    for name in fields:
        if name == "@":
            continue
        scope, compat, medium, key = name.split("|")
        by.setdefault((scope, compat, medium), []).append(key)
    return tuple(ResidencyGroup(s, c, m, tuple(keys)) for (s, c, m), keys in by.items())


class SharedResidency:
    """The residency book of one IS process, kept equal to Redis's."""

    def __init__(
        self,
        url: str,
        prefix: str = "kvsp-index:",
        *,
        cluster: bool = False,
        max_records: int = 4_000_000,
        max_ttl_ms: int = 600_000,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self.book = ResidencyBook(max_records, max_ttl_ms)
        self.max_ttl_ms = max_ttl_ms
        self._hash_prefix = f"{prefix}{{res}}:i:"
        self.stream = f"{prefix}{{res}}:log"
        self._client: Any = connect(url, cluster=cluster, timeout_s=timeout_s)
        self._reader: Any = connect(url, cluster=cluster, timeout_s=timeout_s + 1)
        self._last = "0-0"
        self._started: asyncio.Future[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._waiting = ReadBack("residency log", APPLY_WAIT_S)
        self._closing = False
        self._failed_at = -RETRY_S

    @property
    def counters(self) -> ResidencyCounters:
        return self.book.counters

    @counters.setter
    def counters(self, counters: ResidencyCounters) -> None:
        self.book.counters = counters

    async def start(self) -> None:
        """Load what Redis holds and follow the log (once; the first call
        waits for it). A lookup before then would answer an empty book."""
        await self._start()

    def lookup(self, scope_id: str, compat_id: str, keys: Sequence[str]) -> list[Resident]:
        return self.book.lookup(scope_id, compat_id, keys)

    async def tell(self, instance_id: str, update: ResidencyUpdate) -> tuple[int, bool, int]:
        """Apply ``update`` in Redis and in the log, then here in log order:
        (the TTL granted, whether Redis knew the instance, its records)."""
        await self._start()
        ttl_ms = min(update.ttl_ms, self.max_ttl_ms)
        self.book.check_room(sum(len(g.block_keys) for g in update.add))
        key = self._hash_prefix + instance_id
        body = json.dumps(update.to_json())
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(key)
                if update.clear:
                    pipe.delete(key)
                removed = [_field(g, k) for g in update.remove for k in g.block_keys]
                if removed:
                    pipe.hdel(key, *removed)
                added = {_field(g, k): "1" for g in update.add for k in g.block_keys}
                pipe.hset(key, mapping={"@": update.instance, **added})
                pipe.pexpire(key, ttl_ms)
                pipe.hlen(key)
                pipe.xadd(
                    self.stream,
                    {"i": instance_id, "u": body},
                    maxlen=LOG_KEPT,
                    approximate=True,
                )
                answers = await pipe.execute()
        except ERRORS as exc:
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        known, records, entry = bool(answers[0]), int(answers[-2]) - 1, _id(answers[-1])
        if not await self._read_back(entry):
            self.book.apply(instance_id, update)  # the follower is stuck: at least here
        return ttl_ms, known, records

    async def close(self) -> None:
        self._closing = True
        self._waiting.cancel()
        if self._follower is not None:
            _, late = await asyncio.wait({self._follower}, timeout=2.0)
            for task in late:
                task.cancel()
        for client in (self._client, self._reader):
            with contextlib.suppress(*ERRORS, TimeoutError):
                async with asyncio.timeout(2.0):
                    await client.aclose()

    # --- start and follow --------------------------------------------------

    async def _start(self) -> None:
        if self._started is None:
            if time.monotonic() - self._failed_at < RETRY_S:
                # Redis was down a moment ago: lookups go on without
                # residency at once, not each after a connection timeout.
                raise TierUnavailable(f"index Redis at {self.url}: unavailable, retried soon")
            self._started = asyncio.ensure_future(self._load())
        try:
            await asyncio.shield(self._started)
        except BaseException:
            self._started = None
            self._failed_at = time.monotonic()
            raise

    async def _load(self) -> None:
        """The hashes (what is resident now), from the log's last entry on."""
        try:
            newest = await self._client.xrevrange(self.stream, count=1)
            self._last = _text(newest[0][0]) if newest else "0-0"
            loaded = 0
            async for raw in self._client.scan_iter(match=self._hash_prefix + "*", count=1000):
                name = _text(raw)
                fields = {_text(k): _text(v) for k, v in (await self._client.hgetall(name)).items()}
                ttl_ms = int(await self._client.pttl(name))
                if ttl_ms <= 0 or "@" not in fields:
                    continue
                update = ResidencyUpdate(fields["@"], ttl_ms, clear=True, add=_groups(fields))
                self.book.apply(name[len(self._hash_prefix) :], update)
                loaded += 1
        except ERRORS as exc:
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        self._follower = asyncio.create_task(self._follow(), name="kvstore-residency-log")
        log.info("residency: %d instance(s) loaded from Redis", loaded)

    async def _follow(self) -> None:
        while not self._closing:
            try:
                answer = await self._reader.xread(
                    {self.stream: self._last}, count=READ_COUNT, block=READ_BLOCK_MS
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("residency log %s: %s; retrying", self.stream, exc)
                await asyncio.sleep(0.5)
                continue
            for _, entries in answer or ():
                for entry_id, fields in entries:
                    self._last = _text(entry_id)
                    try:
                        update = ResidencyUpdate.from_json(json.loads(fields[b"u"]))
                        self.book.apply(_text(fields[b"i"]), update)
                    except Exception as exc:  # one bad entry never stops the rest
                        log.warning("residency log: entry %s skipped: %s", self._last, exc)
            self._waiting.reached(_id(self._last))

    async def _read_back(self, entry: EntryId) -> bool:
        return _id(self._last) >= entry or await self._waiting.wait(entry)
