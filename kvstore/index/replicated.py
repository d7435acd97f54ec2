"""Index state shared by several IS processes, answered from memory
(``[index] state = "replicated"``, issue 20).

Each IS process keeps the whole index in a :class:`MemoryState` and answers
lookups from it, at memory speed. Every publish and withdrawal is appended
to a log in Redis, Redis Streams partitioned by block key
(``<prefix>{log<p>}``, one hash tag per partition, so a Redis Cluster
spreads them over its masters). Every process follows every partition and
applies what it reads, its own writes included: a write returns once its
process has read it back from the log, so the log order is the one order
every process applies a key's changes in, and all processes agree once
they have read the same entries (a write applied at once where it was taken
could be overtaken there by a later one from another process).

- **On start** a process replays each partition from its oldest entry,
  skipping records already expired, and only then answers. Entries older
  than the longest TTL are trimmed (``MINID``), so the log holds at most
  about one TTL of writes.
- **Time** is the Redis clock of each partition's node, as in the entries'
  IDs: an entry carries its record's TTL (a duration, OPS2), and expires
  at its ID's time plus that TTL. Each process reads that clock (``TIME``)
  at start and every :data:`CLOCK_CHECK_S`, and keeps its offset from its
  own: an IS host whose clock is off expires records on time all the same,
  and cannot trim entries that are still live.
- **Consistency.** The index is advisory (P4). A publish is visible at the
  process that took it when it is acknowledged, and at the others after the log lag
  (measured by ``kvstore bench index``). Until then they may answer
  without it: a miss, which the holders' refresh every ``replica_ttl_ms / 3``
  also repairs. A Redis failover can lose the last entries it
  acknowledged; those records come back at their next refresh.
- **Redis down.** Lookups go on from memory. Publishes and withdrawals
  fail (503), as with the ``redis`` state, so the holders retry them, and
  nothing is applied that the others will not see. Followers retry.

"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol.records import ReplicaRecord
from ..redis_client import ERRORS, connect, server_time
from ..storage.errors import TierUnavailable
from .readback import ReadBack
from .readback import entry_id as _id
from .state import Hits, MemoryState, record_octets

log = logging.getLogger("kvstore.index")

#: Log partitions: streams a block key is spread over (by its first octets).
PARTITIONS = 8
#: Entries read from a partition at a time, and how long a read waits (ms).
READ_COUNT = 1000
#: Applied entry IDs kept per partition (see ``ReplicatedState._recent``).
RECENT_KEPT = 4 * READ_COUNT
READ_BLOCK_MS = 100
#: How often a follower reads its partition's Redis clock again (s).
CLOCK_CHECK_S = 10.0
#: Longest a write waits to be read back before it is applied here anyway.
APPLY_WAIT_S = 2.0
#: How often an idle follower checks that the log was not reset under it (s).
RESET_CHECK_S = 1.0


def partition_of(block_key: str) -> int:
    return int(block_key[:8], 16) % PARTITIONS


class ReplicatedState:
    """The IndexState contract in memory, replicated through Redis Streams."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvsp-index:",
        *,
        cluster: bool = False,
        timeout_s: float = 5.0,
        max_records: int = 1_000_000,
        max_ttl_ms: int = 600_000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self._cluster = cluster
        self.memory = MemoryState(max_records=max_records)
        self.max_ttl_ms = max_ttl_ms
        self.wall_clock = wall_clock
        self._streams = [f"{prefix}{{log{p}}}" for p in range(PARTITIONS)]
        self._client: Any = connect(url, cluster=cluster, timeout_s=timeout_s)
        # Blocking reads on a client of their own: they hold connections.
        self._reader: Any = connect(url, cluster=cluster, timeout_s=timeout_s + 1)
        self._last = ["0-0"] * PARTITIONS
        #: Per partition, its Redis node's clock minus ours (ms).
        self._offset_ms = [0.0] * PARTITIONS
        self._followers: list[asyncio.Task[None]] = []
        self._started: asyncio.Future[None] | None = None
        self._closing = False
        #: Writes of this process waiting to be read back, by partition.
        self._waiting = [ReadBack("index log", APPLY_WAIT_S) for _ in range(PARTITIONS)]
        #: Entries applied, by partition (tests, metrics).
        self.applied = [0] * PARTITIONS
        #: Entries read but not applied (a record another IS had room for and
        #: this one has not: its max_records is smaller, or it is fuller).
        self.skipped = [0] * PARTITIONS
        #: Why recent entries were skipped, by ID (as many as ``_recent``
        #: holds): a write read back before its XADD answered fails with it.
        self._skips: list[dict[tuple[int, int], Exception]] = [{} for _ in range(PARTITIONS)]
        #: The IDs last applied per partition: a write whose entry the
        #: follower applied (with later ones) before the write's own XADD
        #: returned is found here, not taken for a log reset.
        self._recent: list[collections.deque[tuple[int, int]]] = [
            collections.deque(maxlen=RECENT_KEPT) for _ in range(PARTITIONS)
        ]

    @property
    def streams(self) -> tuple[str, ...]:
        """The Redis keys of the log, one stream per partition: all this
        state writes (an operator's or a benchmark's clean-up)."""
        return tuple(self._streams)

    # --- the IndexState contract -----------------------------------------

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        await self._start()
        # A record this process has no room for is refused before it enters
        # the log (507), not acknowledged and then dropped here.
        self.memory.check_room(record)
        raw, _ = record_octets(record)
        # A duration: the entry's ID (Redis's clock) is when it started.
        fields = {"op": "put", "r": raw, "t": ttl_ms}
        if not await self._append(record.block_key, fields):
            await self.memory.put(record, ttl_ms)  # the follower is stuck: at least here

    async def delete(self, holder_id: str, block_key: str) -> bool:
        await self._start()
        existed = await self.memory.scope_of(holder_id, block_key) is not None
        if not await self._append(block_key, {"op": "del", "h": holder_id, "k": block_key}):
            await self.memory.delete(holder_id, block_key)
        return existed

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        await self._start()
        return await self.memory.scope_of(holder_id, block_key)

    async def lookup(
        self,
        scope_id: str,
        compat_id: str,
        block_keys: Sequence[str],
        shapes: bool = False,
        records: bool = True,
    ) -> Hits:
        await self._start()
        return await self.memory.lookup(scope_id, compat_id, block_keys, shapes, records)

    async def count(self) -> int:
        await self._start()
        return await self.memory.count()

    async def close(self) -> None:
        for waiting in self._waiting:
            waiting.cancel()
        followers, self._followers = self._followers, []
        # Each follower ends after its current read (at most READ_BLOCK_MS):
        # cancelling a blocked read of redis-py's waits for its socket timeout.
        self._closing = True
        loop = asyncio.get_running_loop()
        ours = [t for t in followers if t.get_loop() is loop]
        if ours:
            _, late = await asyncio.wait(ours, timeout=2.0)
            for task in late:
                task.cancel()
        for client in (self._client, self._reader):
            with contextlib.suppress(*ERRORS, TimeoutError):
                async with asyncio.timeout(2.0):
                    await client.aclose()

    # --- the log -----------------------------------------------------------

    async def _append(self, block_key: str, fields: dict[str, Any]) -> bool:
        """Append to the key's partition and wait until this process has
        applied the entry (read back in log order); False when that took
        longer than :data:`APPLY_WAIT_S`."""
        p = partition_of(block_key)
        # What no record can need any more: older than the longest TTL.
        oldest = max(0, self._redis_ms(p) - self.max_ttl_ms)
        try:
            raw_id = await self._client.xadd(
                self._streams[p], fields, minid=f"{oldest}-0", approximate=True
            )
        except ERRORS as exc:
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        entry = _id(raw_id)
        if self.applied_up_to(p) >= entry:
            # Behind what this process read (rare: the scan of the recent
            # IDs happens only then). Applied already, while XADD's answer
            # was on its way; or, not among them, the log was reset (Redis
            # restarted empty, or failed over to a host whose clock is
            # behind): read the partition from its start.
            if entry in self._recent[p]:
                skipped = self._skips[p].get(entry)
                if skipped is not None:
                    raise skipped
                return True
            log.warning(
                "index log %s: entry %s is behind %s: the log was reset; reading it again",
                self._streams[p],
                raw_id,
                self._last[p],
            )
            self._last[p] = "0-0"
        return await self._waiting[p].wait(entry)

    def _redis_ms(self, p: int) -> int:
        """Partition ``p``'s Redis clock now, in ms (as its entry IDs are)."""
        return int(self.wall_clock() * 1000 + self._offset_ms[p])

    async def _read_clock(self, p: int) -> None:
        """The offset of partition ``p``'s Redis clock from this host's,
        from ``TIME`` at the node that serves its stream."""
        before = self.wall_clock()
        now = await server_time(self._client, self._streams[p], cluster=self._cluster)
        self._offset_ms[p] = (now - (before + self.wall_clock()) / 2) * 1000

    def applied_up_to(self, p: int) -> tuple[int, int]:
        """The ID of the last entry of partition ``p`` this process applied."""
        return _id(self._last[p])

    async def _start(self) -> None:
        """Replay the log once (the first call waits for it), then follow it."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._replay())
        await asyncio.shield(self._started)

    async def _replay(self) -> None:
        try:
            for p, stream in enumerate(self._streams):
                await self._read_clock(p)
                while True:
                    entries = await self._client.xrange(
                        stream, min=_after(self._last[p]), count=READ_COUNT
                    )
                    if not entries:
                        break
                    await self._apply(p, entries)
        except ERRORS as exc:
            self._started = None  # the next call tries again
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        except BaseException:
            self._started = None
            raise
        self._followers = [
            asyncio.create_task(self._follow(p), name=f"kvstore-index-log-{p}")
            for p in range(PARTITIONS)
        ]
        log.info("index: %d records replayed from the log", await self.memory.count())

    async def _follow(self, p: int) -> None:
        stream = self._streams[p]
        checked = clocked = time.monotonic()
        while not self._closing:
            try:
                if time.monotonic() - clocked > CLOCK_CHECK_S:
                    clocked = time.monotonic()
                    await self._read_clock(p)
                answer = await self._reader.xread(
                    {stream: self._last[p]}, count=READ_COUNT, block=READ_BLOCK_MS
                )
                for _, entries in answer or ():
                    await self._apply(p, entries)
                if not answer and time.monotonic() - checked > RESET_CHECK_S:
                    checked = time.monotonic()
                    await self._check_reset(p)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("index log %s: %s; retrying", stream, exc)
                await asyncio.sleep(0.5)
                continue
            if self._waiting[p]:
                self._waiting[p].reached(_id(self._last[p]))

    async def _check_reset(self, p: int) -> None:
        """Idle: a newest entry behind what was read means the log was reset
        under this process (its later entries would all be skipped)."""
        newest = await self._reader.xrevrange(self._streams[p], count=1)
        if newest and _id(newest[0][0]) < self.applied_up_to(p):
            log.warning("index log %s was reset; reading it again", self._streams[p])
            self._last[p] = "0-0"

    async def _apply(self, p: int, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        now_ms = self._redis_ms(p)
        for entry_id, fields in entries:
            self._last[p] = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            self._recent[p].append(_id(self._last[p]))
            self.applied[p] += 1
            try:
                op = fields.get(b"op")
                if op == b"put":
                    if b"t" in fields:  # the TTL from the entry's time
                        remaining = _id(entry_id)[0] + int(fields[b"t"]) - now_ms
                    else:  # an earlier version's entry: its writer's expiry
                        remaining = int(fields[b"x"]) - int(self.wall_clock() * 1000)
                    if remaining > 0:
                        record = ReplicaRecord.from_json(json.loads(fields[b"r"]))
                        await self.memory.put(record, remaining)
                elif op == b"del":
                    await self.memory.delete(fields[b"h"].decode(), fields[b"k"].decode())
            except Exception as exc:
                self.skipped[p] += 1
                log.warning("index log: entry %s skipped: %s", self._last[p], exc)
                # The write of this process that made the entry fails with it
                # (IndexFull: 507 to the publisher), rather than be answered;
                # also if it is read back before its XADD has answered.
                entry = _id(self._last[p])
                skips = self._skips[p]
                skips[entry] = exc
                if len(skips) > RECENT_KEPT:
                    del skips[next(iter(skips))]
                self._waiting[p].fail(entry, exc)


def _after(entry_id: str) -> str:
    """The XRANGE start just after ``entry_id`` (exclusive, Redis 6.2)."""
    return "-" if entry_id == "0-0" else "(" + entry_id


__all__ = ["PARTITIONS", "ReplicatedState", "partition_of"]
