"""Prometheus metrics (OPS1): one registry per app, no process-wide globals.

Request metrics come from an ASGI middleware; store, lease and publisher
figures are read from their counters at scrape time by a custom collector,
so the hot path only increments integers it already keeps.

==========================================  =====================================
metric                                      meaning
==========================================  =====================================
kvstore_http_requests_total                 requests by route, method and status
kvstore_http_request_duration_seconds       request latency histogram by route
kvstore_http_received_bytes_total           request body octets received by route
kvstore_http_sent_bytes_total               response body octets by route
kvstore_tier_used_bytes                     octets stored per tier (with reservations)
kvstore_tier_reserved_bytes                 octets taken by writes under way per tier
kvstore_tier_capacity_bytes                 configured capacity per tier
kvstore_tier_degraded                       1 while a tier is marked degraded
kvstore_tier_failures_total                 failed calls per tier
kvstore_tier_arena_bytes                    a host tier's arena: octets mapped, in extents
kvstore_tier_arena_fallbacks_total          blocks kept outside the arena (none fitted)
kvstore_store_hits_total / _misses_total    block reads found / not found
kvstore_store_evictions_total               blocks evicted, by reason kind
kvstore_store_moves_total                   demotions, promotions (and dropped ones),
                                            persistent copies given up
kvstore_store_blocks                        blocks by state (writing, resident, leaving)
kvstore_digest_failures_total               stored data failing its integrity check
kvstore_lease_rejections_total              lease requests refused by quota (LE3)
kvstore_leases                              unexpired leases
kvstore_publish_total                       records published / withdrawn / errors
kvstore_publish_pending                     updates the IS has not acknowledged yet
kvstore_store_recovering                    1 while a restart's recovery is under way
kvstore_store_recovery_blocks               its blocks listed, scanned, adopted
process_*, python_gc_*, python_info         the process (one scrape of all roles)
==========================================  =====================================

On ``kvstore serve``'s combined listener, ``/metrics`` is every role of the
process in one exposition, each role's samples labelled ``role`` (holder,
index, pc, instance), with the process's own collectors once
(:func:`render_roles`); ``{base}metrics`` is one role's alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from .logs import ACCESS, ACCESS_TEXT
from .seams import PublisherStatsSource, Snapshots
from .tls import PEER, principal_from_scope

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

access = logging.getLogger(ACCESS)

# Label values come from a fixed set: a client-chosen method name must not
# create a new time series per request (unbounded memory).
_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"})


class _StoreCollector(Collector):
    """The store's snapshot, and its publisher's counters, at scrape time."""

    def __init__(self, store: Snapshots, publisher: PublisherStatsSource | None) -> None:
        self.store = store
        self.publisher = publisher

    def collect(self) -> Iterator[Any]:
        snap = self.store.snapshot()
        # A tier is its registry name and its position in the chain (two
        # LMDB tiers are two series): tier="host", position="0".
        where = ["tier", "position"]
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Octets stored", labels=where)
        capacity = GaugeMetricFamily(
            "kvstore_tier_capacity_bytes", "Configured capacity", labels=where
        )
        reserved = GaugeMetricFamily(
            "kvstore_tier_reserved_bytes", "Octets taken by writes under way", labels=where
        )
        degraded = GaugeMetricFamily("kvstore_tier_degraded", "Tier degraded", labels=where)
        failures = CounterMetricFamily("kvstore_tier_failures", "Failed tier calls", labels=where)
        arena = GaugeMetricFamily(
            "kvstore_tier_arena_bytes", "Host tier arena octets", labels=[*where, "state"]
        )
        fallbacks = CounterMetricFamily(
            "kvstore_tier_arena_fallbacks", "Blocks kept outside the arena", labels=where
        )
        latency = HistogramMetricFamily(
            "kvstore_tier_operation_duration_seconds",
            "Tier call latency by operation (read, write, delete)",
            labels=[*where, "op"],
        )
        for index, tier_snap in enumerate(snap.tiers):
            tier = [tier_snap.kind, str(index)]
            used.add_metric(tier, tier_snap.used)
            capacity.add_metric(tier, tier_snap.capacity)
            reserved.add_metric(tier, tier_snap.reserved)
            degraded.add_metric(tier, 1 if tier_snap.degraded else 0)
            failures.add_metric(tier, tier_snap.failures)
            if tier_snap.arena is not None:
                mapped, in_extents, outside = tier_snap.arena
                arena.add_metric([*tier, "mapped"], mapped)
                arena.add_metric([*tier, "in_extents"], in_extents)
                fallbacks.add_metric(tier, outside)
            for op, (buckets, total_s) in tier_snap.latency.items():
                latency.add_metric([*tier, op], buckets, total_s)
        yield from (used, capacity, reserved, degraded, failures, arena, fallbacks, latency)
        yield from _scope_usage(snap.scopes)
        states = GaugeMetricFamily("kvstore_store_blocks", "Blocks by state", labels=["state"])
        for state, count in snap.blocks.items():
            states.add_metric([state], count)
        yield states
        yield CounterMetricFamily("kvstore_store_hits", "Block reads found", value=snap.hits)
        yield CounterMetricFamily(
            "kvstore_store_misses", "Block reads not found", value=snap.misses
        )
        evictions = CounterMetricFamily(
            "kvstore_store_evictions", "Blocks evicted", labels=["kind"]
        )
        evictions.add_metric(["capacity"], snap.evictions)
        evictions.add_metric(["fault"], snap.fault_evictions)
        evictions.add_metric(["retention"], snap.expired)
        yield evictions
        moves = CounterMetricFamily("kvstore_store_moves", "Segment moves", labels=["direction"])
        moves.add_metric(["demotion"], snap.demotions)
        moves.add_metric(["promotion"], snap.promotions)
        # A persistent copy given up for room (the block stays in a faster tier).
        moves.add_metric(["copy_dropped"], snap.copies_dropped)
        # Hits not promoted (bound reached, block busy, no room without waiting).
        moves.add_metric(["promotion_dropped"], snap.promotions_dropped)
        # PUT segments written below a full tier that drains in the background.
        moves.add_metric(["put_fell_through"], snap.puts_fell_through)
        yield moves
        yield CounterMetricFamily(
            "kvstore_digest_failures", "Integrity check failures", value=snap.integrity_failures
        )
        yield CounterMetricFamily(
            "kvstore_lease_rejections", "Lease requests refused", value=snap.lease_rejections
        )
        yield GaugeMetricFamily("kvstore_leases", "Unexpired leases", value=snap.leases)
        if snap.recovery is not None:
            # A restart serves at once and recovers in the background.
            progress = snap.recovery
            yield GaugeMetricFamily(
                "kvstore_store_recovering",
                "A restart's recovery is under way",
                value=int(progress.active),
            )
            found = GaugeMetricFamily(
                "kvstore_store_recovery_blocks", "Restart recovery's blocks", labels=["stage"]
            )
            found.add_metric(["listed"], progress.listed)
            found.add_metric(["scanned"], progress.scanned)
            found.add_metric(["adopted"], progress.adopted)
            yield found
        if self.publisher is not None:
            stats = self.publisher.stats
            published = CounterMetricFamily("kvstore_publish", "Index updates", labels=["outcome"])
            published.add_metric(["published"], stats.published)
            published.add_metric(["withdrawn"], stats.withdrawn)
            published.add_metric(["error"], stats.errors)
            yield published
            # Updates the IS has not acknowledged yet (a backlog grows while
            # it is unreachable; they are sent, in order, once it answers).
            yield GaugeMetricFamily(
                "kvstore_publish_pending", "Index updates waiting", value=self.publisher.pending
            )


#: Scopes (tenants) shown by name in kvstore_scope_*: the largest by KV
#: octets; the rest are summed as scope="other" (a bounded series count).
SCOPES_SHOWN = 50


def _scope_usage(scopes: dict[str, tuple[int, int]]) -> Iterator[Any]:
    blocks = GaugeMetricFamily(
        "kvstore_scope_blocks", "Blocks held by scope (tenant)", labels=["scope"]
    )
    octets = GaugeMetricFamily(
        "kvstore_scope_kv_bytes", "KV octets held by scope (tenant)", labels=["scope"]
    )
    ranked = sorted(scopes.items(), key=lambda item: item[1][1], reverse=True)
    for scope, (count, size) in ranked[:SCOPES_SHOWN]:
        blocks.add_metric([scope], count)
        octets.add_metric([scope], size)
    rest = ranked[SCOPES_SHOWN:]
    if rest:
        blocks.add_metric(["other"], sum(n for _, (n, _) in rest))
        octets.add_metric(["other"], sum(size for _, (_, size) in rest))
    yield from (blocks, octets)


class CountersCollector(Collector):
    """Every integer field of a dataclass of counters as ``<prefix>_<field>_total``."""

    def __init__(self, prefix: str, counters: Any) -> None:
        self.prefix = prefix
        self.counters = counters

    def collect(self) -> Iterator[Any]:
        for name in self.counters.__dataclass_fields__:
            value = getattr(self.counters, name)
            if isinstance(value, int):
                yield CounterMetricFamily(f"{self.prefix}_{name}", name.replace("_", " "), value)


class Metrics:
    """A registry plus the request instruments of one app."""

    def __init__(
        self,
        store: Snapshots | None = None,
        publisher: PublisherStatsSource | None = None,
        counters: Any = None,
        counters_prefix: str = "kvstore",
    ) -> None:
        self.registry = CollectorRegistry()
        #: Labels every sample carries (set for a worker by ``kvstore serve``).
        self.labels: dict[str, str] = {}
        labels = ["route", "method", "status"]
        self.requests = Counter(
            "kvstore_http_requests", "HTTP requests", labels, registry=self.registry
        )
        self.latency = Histogram(
            "kvstore_http_request_duration_seconds",
            "Request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )
        self.received = Counter(
            "kvstore_http_received_bytes",
            "Request body octets received",
            ["route"],
            registry=self.registry,
        )
        self.sent = Counter(
            "kvstore_http_sent_bytes", "Response body octets", ["route"], registry=self.registry
        )
        if store is not None:
            self.registry.register(_StoreCollector(store, publisher))
        if counters is not None:
            self.registry.register(CountersCollector(counters_prefix, counters))

    def render(self) -> bytes:
        if not self.labels:
            return generate_latest(self.registry)
        return generate_latest(_Labelled(self.registry, self.labels))


class _Roles:
    """Several roles' registries as one: each family once, its samples from
    every role labelled ``role`` (the same names, e.g. the request counters,
    are one family), then the process's own collectors."""

    def __init__(self, roles: Sequence[tuple[str, Metrics]]) -> None:
        self.roles = roles

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for role, metrics in self.roles:
            source: Any = _Labelled(metrics.registry, {**metrics.labels, "role": role})
            for family in source.collect():
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                else:
                    merged.samples.extend(family.samples)
        yield from families.values()
        # The process: CPU, memory, open files, start time; the collector's
        # passes; the interpreter (prometheus_client's default collectors).
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
            yield from collector.collect()


def render_roles(roles: Sequence[tuple[str, Metrics]]) -> bytes:
    """One exposition of ``roles`` ((name, metrics) pairs), each sample
    labelled with its role, plus ``process_*`` and ``python_gc_*``."""
    return generate_latest(_Roles(roles))


#: Where :class:`MetricsMiddleware` keeps a request's count of body octets
#: received in the ASGI scope; the body reader (:func:`kvstore.http.read_body`)
#: adds to it as chunks arrive.
RECEIVED = "kvstore.received_octets"


class Received:
    """Octets of a request body received so far."""

    __slots__ = ("octets",)

    def __init__(self) -> None:
        self.octets = 0


class _Labelled:
    """A registry's metrics with ``labels`` added to every sample (a
    worker's ``worker="<i>"``, docs/workers.md); applied at scrape time."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            family.samples = [
                s._replace(labels={**s.labels, **self.labels}) for s in family.samples
            ]
            yield family


class MetricsMiddleware:
    """Counts requests, latency and body octets by route (the matched endpoint)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        sent = 0
        # Octets received, counted by the body reader as they arrive (not the
        # declared Content-Length: a refused request declaring a terabyte
        # sent nothing; a chunked one declares none). Wrapping receive()
        # instead would add a coroutine hop to each of the ~130 messages of
        # a 2 MiB TLS upload.
        counted = scope[RECEIVED] = Received()

        async def counting_send(message: Any) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            endpoint = scope.get("endpoint")
            route = getattr(endpoint, "__name__", "unmatched")
            m = self.metrics
            method = scope["method"] if scope["method"] in _METHODS else "other"
            m.requests.labels(route, method, str(status)).inc()
            took = time.perf_counter() - start
            m.latency.labels(route).observe(took)
            received = counted.octets
            m.received.labels(route).inc(received)
            m.sent.labels(route).inc(sent)
            if access.isEnabledFor(logging.INFO):
                _access_line(scope, status, received, sent, took)


def _access_line(scope: Any, status: int, received: int, sent: int, seconds: float) -> None:
    """The access log's line (kvstore.logs): paths carry block keys and
    scope ids, never a scope key; bodies are never logged."""
    extensions = scope.get("extensions") or {}
    peer = extensions.get(PEER)
    if peer is None:
        client = scope.get("client")
        peer = client[0] if client else "-"
    fields = (
        scope["method"],
        scope["path"],
        status,
        received,
        sent,
        1000 * seconds,
        principal_from_scope(scope) or "-",
        peer,
    )
    access.info(ACCESS_TEXT, *fields, extra={"access": fields})
