"""Publishing the holder's replicas to an Index Service (P1-P3).

* a new replica is published at once; every held replica is refreshed with
  the same idempotent PUT every ``ttl/3`` (P2);
* a replica about to leave is withdrawn with DELETE before it goes (P3); the
  store awaits :meth:`IndexPublisher.evicting` before dropping the data.
  The publisher hears both from the store's events (it subscribes when made),
  so no role calls it: a block the instance prefetched or stored is
  published like one a client PUT;
* an unreachable IS never stops the holder from serving: failed PUTs and
  DELETEs are queued and caught up, in order, when it answers again;
* after a restart, :meth:`IndexPublisher.start` republishes what the store
  recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..background import Background
from ..client import IndexClient
from ..protocol.problems import KvspError
from ..storage import BlockRef, TieredStore

log = logging.getLogger("kvstore.holder.publisher")


@dataclass(slots=True)
class PublisherStats:
    published: int = 0
    withdrawn: int = 0
    errors: int = 0
    #: Updates the IS refused for good (4xx): dropped, not retried.
    rejected: int = 0


#: Tiers whose contents do not outlive the process.
VOLATILE_TIERS = frozenset({"device", "host"})


def _permanent(error: KvspError) -> bool:
    """A refusal retrying cannot fix (4xx other than 429); transport errors and
    5xx are worth retrying."""
    return 400 <= error.status < 500 and error.status != 429


def next_backoff(ok: bool, backoff: float, granted_ttl_ms: int) -> float:
    """The wait before the next round after a failed one: doubling from half a
    second, but never past a third of the granted TTL (P2), so that records
    come back within a refresh of the IS answering again."""
    return 0.5 if ok else min(backoff * 2, granted_ttl_ms / 3000)


class IndexPublisher(Background):
    """Keeps an Index Service's records of this holder's replicas current."""

    def __init__(
        self,
        index: IndexClient,
        store: TieredStore,
        holder_uri: str,
        ttl_ms: int,
        *,
        withdraw_timeout_s: float = 2.0,
        down_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.store = store
        self.holder_uri = holder_uri
        self.ttl_ms = ttl_ms
        self.withdraw_timeout_s = withdraw_timeout_s
        self.down_backoff_s = down_backoff_s
        self._index_down_until = 0.0
        self.clock = clock
        self.stats = PublisherStats()
        #: The smallest TTL the IS has granted (it may cap ours, P2).
        self.granted_ttl_ms = ttl_ms
        # Work the IS has not acknowledged yet: ref -> "put" | "delete"; the
        # latest intent per block wins, in the order blocks were touched.
        self._pending: OrderedDict[BlockRef, str] = OrderedDict()
        self._wake = asyncio.Event()
        self.unsubscribe = store.events.subscribe(self)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def index_reachable(self) -> bool:
        """False while the IS is treated as down (its last call failed)."""
        return self._index_down_until <= self.clock()

    async def close(self) -> None:
        """Stop hearing of the store's blocks and close the IS client."""
        self.unsubscribe()
        await self.index.close()

    def stored(self, ref: BlockRef) -> None:
        """P1: a new replica, published by the next round (at once: it is woken)."""
        self._pending[ref] = "put"
        self._pending.move_to_end(ref)
        self._wake.set()

    async def evicting(self, ref: BlockRef, reason: str = "capacity") -> None:
        """P3: withdraw ``ref`` before it leaves."""
        # P3: withdraw before the replica leaves; a slow or absent IS delays
        # the eviction by at most withdraw_timeout_s, then it is queued.
        self._pending.pop(ref, None)
        if self.clock() < self._index_down_until:
            # The IS failed us a moment ago: queue at once rather than make
            # every eviction (and the PUT that made room with it) wait out
            # the timeout.
            self._pending[ref] = "delete"
            self._wake.set()
        else:
            try:
                await asyncio.wait_for(
                    self.index.withdraw(self.holder_uri, ref.block_key), self.withdraw_timeout_s
                )
                self.stats.withdrawn += 1
            except (KvspError, TimeoutError) as exc:
                self.stats.errors += 1
                self._index_down_until = self.clock() + self.down_backoff_s
                log.warning("withdrawal of %s queued: %s", ref.block_key, exc)
                self._pending[ref] = "delete"
                self._wake.set()
            except asyncio.CancelledError:
                # Stopped before the IS answered: the DELETE is still owed.
                self._pending[ref] = "delete"
                self._wake.set()
                raise
        # The IS keeps one record per holder and block key: a copy of the same
        # key held under another scope must be advertised again.
        for other in self.store.refs_for_key(ref.block_key) - {ref}:
            self._pending[other] = "put"
            self._wake.set()

    async def _publish(self, ref: BlockRef) -> None:
        if not self.store.serves(ref):
            return  # gone or leaving meanwhile; its withdrawal is queued separately
        record = self.store.replica_record(ref, self.holder_uri, self.ttl_ms)
        granted = await self.index.publish(record)
        if isinstance(granted, int) and granted > 0:
            self.granted_ttl_ms = min(self.granted_ttl_ms, granted)
        self.stats.published += 1
        if not self.store.serves(ref):
            # Evicted (or leaving) while the PUT was in flight: its DELETE may have reached
            # the IS first, so withdraw again now that the PUT has landed.
            self._pending[ref] = "delete"

    async def flush(self) -> bool:
        """Send queued work in order; True when the queue is empty."""
        ok = await self._flush()
        if ok:
            self._index_down_until = 0.0
        return ok

    async def _flush(self) -> bool:
        while self._pending:
            ref, action = next(iter(self._pending.items()))
            try:
                if action == "put":
                    await self._publish(ref)
                else:
                    await self.index.withdraw(self.holder_uri, ref.block_key)
                    self.stats.withdrawn += 1
            except KvspError as exc:
                self.stats.errors += 1
                if _permanent(exc):
                    # Refused for good (e.g. not trusted for that scope): drop
                    # it rather than stall every later update behind it.
                    self.stats.rejected += 1
                    log.error("index refused %s of %s: %s", action, ref.block_key, exc.detail)
                    if self._pending.get(ref) == action:
                        del self._pending[ref]
                    continue
                log.warning("index unreachable, %d updates queued: %s", len(self._pending), exc)
                self._index_down_until = self.clock() + self.down_backoff_s
                return False
            if self._pending.get(ref) == action:
                del self._pending[ref]
        return True

    async def drain(self, timeout_s: float) -> bool:
        """At shutdown: send what is queued (withdrawals of blocks already
        gone, publications) within ``timeout_s``; True when all went."""
        try:
            return await asyncio.wait_for(self.flush(), timeout_s)
        except TimeoutError:
            log.warning("shutdown: %d index updates not sent in time", len(self._pending))
            return False

    async def withdraw_volatile(self, timeout_s: float = 5.0) -> int:
        """At shutdown: withdraw the records of replicas held only in memory
        tiers (device, host), which do not outlive the process; what LMDB,
        Redis or S3 hold stays published (a restart republishes it). Returns
        how many were withdrawn."""
        volatile = [
            info.ref
            for info in self.store.blocks()
            if all(r.tier in VOLATILE_TIERS for r in self.store.residency(info.ref))
        ]
        done = 0

        async def one(ref: BlockRef) -> None:
            nonlocal done
            await self.index.withdraw(self.holder_uri, ref.block_key)
            self.stats.withdrawn += 1
            done += 1

        try:
            async with asyncio.timeout(timeout_s):
                for start in range(0, len(volatile), 64):
                    results = await asyncio.gather(
                        *(one(r) for r in volatile[start : start + 64]), return_exceptions=True
                    )
                    for result in results:
                        if isinstance(result, BaseException):
                            self.stats.errors += 1
        except TimeoutError:
            log.warning(
                "shutdown: %d of %d volatile replicas withdrawn in time", done, len(volatile)
            )
        return done

    async def refresh_all(self) -> None:
        """Queue a refresh of every held replica (P2: same PUT, about every ttl/3)."""
        for info in self.store.blocks():
            self._pending.setdefault(info.ref, "put")
        await self.flush()

    async def run(self) -> None:
        next_refresh = self.clock()
        backoff = 0.5
        while True:
            try:
                if self.clock() >= next_refresh:
                    await self.refresh_all()
                    # P2: a third of the TTL the IS actually grants (it may cap ours).
                    next_refresh = self.clock() + self.granted_ttl_ms / 3000
                ok = await self.flush()
            except Exception:
                # Never let the refresher die: records would silently expire.
                log.exception("publisher round failed; retrying")
                ok = False
            backoff = next_backoff(ok, backoff, self.granted_ttl_ms)
            timeout = max(0.0, next_refresh - self.clock()) if ok else backoff
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
