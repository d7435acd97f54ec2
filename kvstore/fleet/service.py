"""``kvstore events``: the bridge beside one vLLM engine, running.

It subscribes to the engine's ``ZmqEventPublisher`` and follows its
sequence numbers:

* the next one: applied;
* a gap (messages the SUB socket dropped, or sent before it connected):
  asked again from the replay socket, applied in order; what the replay
  cannot give back (no replay endpoint, or its buffer moved on) voids this
  instance's residency, since a removal may have been among them (a stale
  "resident" would steer requests to a pod that recomputes);
* a lower one: the engine restarted (it numbers from 0 again), its cache is
  empty: the residency is voided.

Changes gather for ``flush_ms`` and go to the IS as one update (a heartbeat
when nothing changed, every third of ``ttl_ms``); an IS that did not know
the instance (it restarted, or the records expired while it was away) is
sent everything again. While the IS is unreachable the changes wait,
merged, and are sent when it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..logs import Tally, describe
from ..protocol.problems import KvspError
from ..protocol.residency import ResidencyGroup, ResidencyUpdate
from .bridge import Bridge, Changes
from .vllm_events import END_OF_REPLAY, MalformedEvent, decode_batch, decode_sequence

log = logging.getLogger("kvstore.events")

#: Event times kept for the lag of the next update (the rest are dropped).
TIMES_KEPT = 10_000


class EventBridge:
    """One engine's events to one IS (see the module). ``index``: an
    :class:`~kvstore.client.IndexClient`; ``context``: a ``zmq.asyncio``
    context (the caller's, closed by it)."""

    def __init__(
        self,
        bridge: Bridge,
        index: Any,
        instance: str,
        *,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        ttl_ms: int = 30_000,
        flush_ms: int = 20,
        max_update_keys: int = 8192,
        replay_timeout_s: float = 2.0,
        context: Any = None,
    ) -> None:
        import zmq.asyncio

        self.bridge, self.index, self.instance = bridge, index, instance
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.ttl_ms, self.flush_s = ttl_ms, flush_ms / 1000
        self.max_update_keys, self.replay_timeout_s = max_update_keys, replay_timeout_s
        self.context = context or zmq.asyncio.Context.instance()
        #: What the IS has not been told yet; the first update voids what a
        #: bridge of this instance told before.
        self.pending = Changes(clear=True)
        #: Event times (the engine's clock) of the batches in ``pending``.
        self._times: list[float] = []
        self.expected: int | None = None
        #: (sequence, CRC-32 of the payload) of the last messages applied: a
        #: replay that differs from them comes from a restarted engine.
        self._recent: deque[tuple[int, int]] = deque(maxlen=64)
        #: The last message the start's replay gave (the SUB socket may bring
        #: it and those before it again); None once past it.
        self._caught_up_to: int | None = None
        self._wake = asyncio.Event()
        self.registry = CollectorRegistry()
        self.lag = Histogram(
            "kvstore_events_lag_seconds",
            "From an event's time at the engine to the IS acknowledging it",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.registry.register(_Counters(self))
        #: The last lags observed, seconds (``kvstore bench events``).
        self.recent_lags: deque[float] = deque(maxlen=100_000)
        self.updates = self.update_failures = 0
        #: The IS answered the last update (readiness).
        self.index_ok = False
        self._unreachable = Tally(log, "index %s unreachable (%d update(s) failed)")
        self._malformed = Tally(log, "%s sent %d message(s) that are not vLLM's KV events")

    # --- receiving -----------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: receive, apply, publish."""
        import zmq

        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        publishing = asyncio.create_task(self._publish_forever(), name="residency publisher")
        log.info(
            "bridging %s's KV events from %s (replay: %s) to %s",
            self.instance,
            self.endpoint,
            self.replay_endpoint or "none",
            self.index.index_uri,
        )
        try:
            if self.replay_endpoint:
                await self.catch_up()
            while True:
                frames = await sub.recv_multipart()
                await self.receive(frames)
        finally:
            publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing
            sub.close(linger=0)

    async def catch_up(self) -> None:
        """At the start: what the engine's replay buffer still holds (events
        sent before this bridge ran). Those the SUB socket brings again are
        skipped once (:attr:`_caught_up_to`)."""
        got = await self._replayed(0)
        for seq, payload in got:
            self._apply(seq, payload)
        if got:
            self._caught_up_to = got[-1][0]
            log.info("caught up: %d message(s) from the replay buffer", len(got))

    async def receive(self, frames: list[bytes]) -> None:
        """One message of the PUB socket: ``[topic, sequence, payload]``."""
        try:
            if len(frames) != 3:
                raise MalformedEvent(f"a message is 3 frames, not {len(frames)}")
            seq = decode_sequence(frames[1])
        except MalformedEvent as exc:
            self.bridge.counters.skipped["malformed"] += 1
            self._malformed(self.endpoint, str(exc))
            return
        expected = self.expected
        if self._caught_up_to is not None:
            if seq <= self._caught_up_to:
                return  # replayed at the start already
            self._caught_up_to = None
        if expected is not None and seq < expected:
            await self._restarted(seq, f"its events start again at {seq} (expected {expected})")
        elif expected is not None and seq > expected:
            await self._gap(expected, seq)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        self._recent.append((seq, zlib.crc32(payload)))
        try:
            batch = decode_batch(payload)
        except MalformedEvent as exc:
            self.bridge.counters.skipped["malformed"] += 1
            self._malformed(self.endpoint, f"message {seq}: {exc}")
            return
        changes = self.bridge.apply(batch.events)
        if changes:
            self.pending.merge(changes)
            if len(self._times) < TIMES_KEPT:
                self._times.append(batch.ts)
            self._wake.set()

    def _void(self) -> None:
        self.pending.merge(self.bridge.forget())
        self._wake.set()

    async def _replayed(self, start: int, upto: int | None = None) -> list[tuple[int, bytes]]:
        """Messages from ``start`` (to ``upto``, excluded) of the replay
        socket, in order; what it answers within ``replay_timeout_s``."""
        import zmq

        got: list[tuple[int, bytes]] = []
        if not self.replay_endpoint:
            return got
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        continue
                    seq = decode_sequence(frames[2])
                    if seq == END_OF_REPLAY:
                        break
                    if start <= seq and (upto is None or seq < upto):
                        got.append((seq, frames[3]))
        except (TimeoutError, MalformedEvent) as exc:
            log.warning("replay from %s: %s", self.replay_endpoint, describe(exc))
        finally:
            dealer.close(linger=0)
        got.sort()
        return got

    async def _restarted(self, seq: int, why: str) -> None:
        """The engine restarted: its cache is empty, the residency void; what
        its replay buffer holds before ``seq`` is its history since."""
        self.bridge.counters.restarts += 1
        log.warning("%s restarted (%s): its residency is void", self.instance, why)
        self._void()
        self._recent.clear()
        for earlier, payload in await self._replayed(0, seq):
            self._apply(earlier, payload)

    async def _gap(self, start: int, upto: int) -> None:
        """Messages [start, upto) again from the replay socket, applied. The
        replay starts at the oldest message seen recently: one that differs
        from what was seen under its number means another engine numbers
        them now (a restart the SUB socket missed). A gap it cannot fill
        voids the residency (a removal may have been lost)."""
        first = self._recent[0][0] if self._recent else start
        got = await self._replayed(first, upto)
        seen = dict(self._recent)
        if any(s in seen and seen[s] != zlib.crc32(p) for s, p in got if s < start):
            await self._restarted(upto, f"message {start - 1} is not the one seen")
            return
        missing = [(s, p) for s, p in got if s >= start]
        if [s for s, _ in missing] == list(range(start, upto)):
            self.bridge.counters.gaps_replayed += 1
            for seq, payload in missing:
                self._apply(seq, payload)
            return
        self.bridge.counters.gaps_lost += 1
        log.warning(
            "%s: events %d-%d lost (%s); its residency is void until told again",
            self.instance,
            start,
            upto - 1,
            "replay incomplete" if self.replay_endpoint else "no replay endpoint",
        )
        self._void()

    # --- publishing ----------------------------------------------------------

    async def _publish_forever(self) -> None:
        heartbeat = self.ttl_ms / 3000
        backoff = 0.1
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), heartbeat)
            self._wake.clear()
            await asyncio.sleep(self.flush_s)  # more changes join this update
            if await self.publish():
                backoff = 0.1
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, heartbeat)

    async def publish(self) -> bool:
        """Send what is pending (or a heartbeat); False if the IS did not
        take it (it stays pending, merged with what comes)."""
        changes, self.pending = self.pending, Changes()
        times, self._times = self._times, []
        try:
            for update in self._updates(changes):
                answer = await self.index.tell_residency(update)
                self.updates += 1
                if not answer.known and not update.clear:
                    # The IS forgot this instance: everything again.
                    log.info("the index did not know %s: telling it everything", self.instance)
                    self.pending = self.bridge.resident()
                    self._wake.set()
                    break
        except KvspError as exc:
            self.update_failures += 1
            self.index_ok = False
            self._unreachable(self.index.index_uri, exc.detail)
            changes.merge(self.pending)
            self.pending = changes
            # Bounded while the IS is away: the oldest times are what the
            # lag histogram would show anyway, the rest add nothing.
            self._times = (times + self._times)[:TIMES_KEPT]
            if self.pending.count() > 4 * self.bridge.max_blocks:
                self.pending = self.bridge.resident()  # bounded: the state itself
            return False
        self.index_ok = True
        now = time.time()
        for ts in times:
            lag = max(0.0, now - ts)
            self.lag.observe(lag)
            self.recent_lags.append(lag)
        return True

    def _updates(self, changes: Changes) -> Iterator[ResidencyUpdate]:
        """``changes`` as updates of at most ``max_update_keys`` keys (the
        first one carries the clear; an empty one is a heartbeat)."""
        compat = self.bridge.compat_id
        limit = self.max_update_keys
        adds, removes = (
            _groups(changes.added, compat, limit),
            _groups(changes.removed, compat, limit),
        )
        clear = changes.clear
        batch: dict[str, list[ResidencyGroup]] = {"add": [], "remove": []}
        size = 0
        for kind, group in [*(("remove", g) for g in removes), *(("add", g) for g in adds)]:
            if size + len(group.block_keys) > limit and size:
                yield self._update(clear, batch)
                clear, batch, size = False, {"add": [], "remove": []}, 0
            batch[kind].append(group)
            size += len(group.block_keys)
        yield self._update(clear, batch)

    def _update(self, clear: bool, batch: dict[str, list[ResidencyGroup]]) -> ResidencyUpdate:
        return ResidencyUpdate(
            self.instance, self.ttl_ms, clear, tuple(batch["add"]), tuple(batch["remove"])
        )

    def metrics(self) -> bytes:
        return generate_latest(self.registry)

    def ready(self) -> bool:
        return self.index_ok


def _groups(
    by: dict[tuple[str, str], list[str]], compat: str, limit: int
) -> Iterator[ResidencyGroup]:
    for (scope, medium), keys in by.items():
        for start in range(0, len(keys), limit):
            yield ResidencyGroup(scope, compat, medium, tuple(keys[start : start + limit]))


class _Counters(Collector):
    def __init__(self, service: EventBridge) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        counters = self.service.bridge.counters
        for name in (
            "received",
            "applied",
            "blocks_stored",
            "blocks_removed",
            "cleared",
            "gaps_replayed",
            "gaps_lost",
            "restarts",
        ):
            yield CounterMetricFamily(
                f"kvstore_events_{name}", f"KV events: {name}", value=getattr(counters, name)
            )
        skipped = CounterMetricFamily(
            "kvstore_events_skipped", "Blocks or events not told, by reason", labels=["reason"]
        )
        for reason, count in counters.skipped.items():
            skipped.add_metric([reason], count)
        yield skipped
        yield CounterMetricFamily(
            "kvstore_events_updates", "Residency updates the IS took", value=self.service.updates
        )
        yield CounterMetricFamily(
            "kvstore_events_update_failures",
            "Residency updates that failed",
            value=self.service.update_failures,
        )
        yield GaugeMetricFamily(
            "kvstore_events_known_blocks",
            "vLLM blocks the bridge can name",
            value=len(self.service.bridge.known),
        )
