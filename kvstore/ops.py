"""``kvstore status`` and ``kvstore top``: what a running server is doing.

Both read each role's ``{base}metrics`` (Prometheus text; the ``metrics`` or
``admin`` role is needed) and, for a Placement Controller, ``{base}instances``;
``/readyz`` of the listener says whether its tiers and IS are reachable.
``status`` prints one summary; ``top`` redraws it every second, with the
rates between its last two scrapes (requests, octets, hits, evictions...),
until ``q`` or Ctrl-C.

Without URLs both read the development server, or ``KVSTORE_URL``
(:func:`kvstore.clibase.default_urls`); ``KVSTORE_CERTS`` names the
certificate directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .logs import describe

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


@dataclass
class RoleView:
    base: str
    roles: list[str] = field(default_factory=list)
    ready: dict[str, Any] = field(default_factory=dict)
    samples: Samples = field(default_factory=dict)
    instances: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    #: When it was scraped (time.monotonic): rates divide by the difference.
    at: float = 0.0

    def value(self, name: str, **labels: str) -> float:
        found = self.samples.get(name, {})
        if not labels:
            return sum(found.values())
        return sum(
            v for k, v in found.items() if all(dict(k).get(a) == b for a, b in labels.items())
        )

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self.samples.get(name, {}).items():
            out[dict(key).get(label, "")] = out.get(dict(key).get(label, ""), 0.0) + value
        return out

    def by_tier(self, name: str) -> dict[str, float]:
        """``name``'s samples by tier, each named ``<tier>#<position>`` (two
        tiers of one kind apart); a holder older than the position label
        names them so in ``tier`` itself."""
        out: dict[str, float] = {}
        for key, value in self.samples.get(name, {}).items():
            labels = dict(key)
            tier = labels.get("tier", "")
            if "position" in labels:
                tier = f"{tier}#{labels['position']}"
            out[tier] = out.get(tier, 0.0) + value
        return out

    def tier_quantile(self, tier: str, op: str, q: float) -> float | None:
        """The upper bound of the latency bucket holding quantile ``q`` of
        ``tier``'s ``op`` calls since the process started (``tier``:
        ``<kind>#<position>``); None before any call."""
        kind, _, position = tier.partition("#")
        buckets = []
        for key, count in self.samples.get(
            "kvstore_tier_operation_duration_seconds_bucket", {}
        ).items():
            labels = dict(key)
            if (labels.get("tier"), labels.get("position", ""), labels.get("op")) == (
                kind,
                position,
                op,
            ):
                buckets.append((float(labels["le"]), count))
        buckets.sort()
        if not buckets or not buckets[-1][1]:
            return None
        wanted = q * buckets[-1][1]
        return next(le for le, count in buckets if count >= wanted)

    def summary(self) -> dict[str, Any]:
        """The figures ``status`` shows, as JSON."""
        out: dict[str, Any] = {"base": self.base, "roles": self.roles, "ready": self.ready}
        if self.error:
            out["error"] = self.error
        if "holder" in self.roles:
            used, capacity = (
                self.by_tier("kvstore_tier_used_bytes"),
                self.by_tier("kvstore_tier_capacity_bytes"),
            )
            degraded = self.by_tier("kvstore_tier_degraded")
            out["tiers"] = [
                {
                    "tier": t,
                    "used": int(used.get(t, 0)),
                    "capacity": int(c),
                    "degraded": bool(degraded.get(t)),
                    "read_p99_s": self.tier_quantile(t, "read", 0.99),
                    "write_p99_s": self.tier_quantile(t, "write", 0.99),
                }
                for t, c in capacity.items()
            ]
            hits, misses = (
                self.value("kvstore_store_hits_total"),
                self.value("kvstore_store_misses_total"),
            )
            out["hit_ratio"] = hits / (hits + misses) if hits + misses else None
            out["leases"] = int(self.value("kvstore_leases"))
            out["lease_rejections"] = int(self.value("kvstore_lease_rejections_total"))
            out["digest_failures"] = int(self.value("kvstore_digest_failures_total"))
            out["replicas_published"] = int(
                self.value("kvstore_publish_total", outcome="published")
            )
            out["replicas_withdrawn"] = int(
                self.value("kvstore_publish_total", outcome="withdrawn")
            )
        if "index" in self.roles:
            keys = self.value("kvstore_index_lookup_keys_total")
            matched = self.value("kvstore_index_lookup_matched_keys_total")
            out["lookups"] = int(self.value("kvstore_index_lookups_total"))
            out["lookup_hit_ratio"] = matched / keys if keys else None
        if "pc" in self.roles:
            out["placements"] = int(self.value("kvstore_controller_placements_total"))
            out["migrations"] = int(self.value("kvstore_controller_migrations_total"))
            out["instances"] = self.instances
        if "instance" in self.roles:
            loaded = self.value("kvstore_instance_loaded_tokens_total")
            computed = self.value("kvstore_instance_computed_tokens_total")
            out["sessions"] = int(self.value("kvstore_instance_sessions_total"))
            out["fetched_tokens"], out["recomputed_tokens"] = int(loaded), int(computed)
            out["output_tokens"] = int(self.value("kvstore_instance_output_tokens_total"))
        return out


#: What ``top`` shows per second: (name, counter, divisor, unit).
RATES = (
    ("requests", "kvstore_http_requests_total", 1.0, "req/s"),
    ("in", "kvstore_http_received_bytes_total", float(1 << 20), "MiB/s in"),
    ("out", "kvstore_http_sent_bytes_total", float(1 << 20), "MiB/s out"),
    ("hits", "kvstore_store_hits_total", 1.0, "hits/s"),
    ("misses", "kvstore_store_misses_total", 1.0, "misses/s"),
    ("evictions", "kvstore_store_evictions_total", 1.0, "evictions/s"),
    ("lookups", "kvstore_index_lookups_total", 1.0, "lookups/s"),
    ("placements", "kvstore_controller_placements_total", 1.0, "placements/s"),
    ("fetched", "kvstore_instance_loaded_tokens_total", 1.0, "tokens fetched/s"),
)


def rates(before: RoleView, after: RoleView) -> dict[str, float | None]:
    """Per second between two scrapes of one base, for each of :data:`RATES`
    the later one has; None where a counter went down (the process
    restarted between them)."""
    seconds = after.at - before.at
    out: dict[str, float | None] = {}
    if seconds <= 0 or before.error or after.error:
        return out
    for name, metric, divisor, _ in RATES:
        if metric not in after.samples:
            continue
        delta = after.value(metric) - before.value(metric)
        out[name] = delta / seconds / divisor if delta >= 0 else None
    return out


def _roles(samples: Samples) -> list[str]:
    names = " ".join(samples)
    markers = {
        "holder": "kvstore_tier_",
        "index": "kvstore_index_",
        "pc": "kvstore_controller_",
        "instance": "kvstore_instance_",
    }
    return [role for role, marker in markers.items() if marker in names]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = float(sample.value)
    return out


async def gather(bases: list[str], context: ssl.SSLContext | None) -> list[RoleView]:
    """A view of each base URI; for a holder run with ``[server] workers``,
    of every worker its ``/readyz`` lists (docs/workers.md), after it."""
    async with _session(context) as http:
        return await _gather(http, bases)


@contextlib.asynccontextmanager
async def _session(context: ssl.SSLContext | None) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(ssl=context if context is not None else False)
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        yield http


async def _gather(http: aiohttp.ClientSession, bases: list[str]) -> list[RoleView]:
    views = list(await asyncio.gather(*(_view(http, b) for b in bases)))
    seen = {v.base for v in views}
    out: list[RoleView] = []
    for view in views:
        out.append(view)
        workers = view.ready.get("workers")
        others = [
            u
            for u in (workers if isinstance(workers, dict) else ())
            if isinstance(u, str) and u not in seen
        ]
        seen.update(others)
        out += await asyncio.gather(*(_view(http, u) for u in others))
    return out


async def _view(http: aiohttp.ClientSession, base: str) -> RoleView:
    base = base if base.endswith("/") else base + "/"
    view = RoleView(base, at=time.monotonic())
    origin = "{0.scheme}://{0.netloc}/".format(urlsplit(base))
    try:
        async with http.get(urljoin(base, "metrics")) as response:
            text = await response.text()
            if response.status != 200:
                view.error = f"{response.status} from {base}metrics: {text[:200]}"
                return view
        view.samples = parse_metrics(text)
        view.roles = _roles(view.samples)
        async with http.get(urljoin(origin, "readyz")) as response:
            view.ready = json.loads(await response.text() or "{}")
        if "pc" in view.roles:
            async with http.get(urljoin(base, "instances")) as response:
                if response.status == 200:
                    view.instances = (await response.json(content_type=None))["instances"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        view.error = f"{base}: {describe(exc)}"
    return view


def _seconds(value: float | None) -> str:
    """A latency bucket's bound: "<= 2.5 ms"; "-" before any call."""
    if value is None:
        return "-"
    if value == float("inf"):
        return "> 10 s"
    return f"<= {value * 1000:g} ms" if value < 1 else f"<= {value:g} s"


def _octets(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(
    views: list[RoleView],
    speeds: dict[str, dict[str, float | None]] | None = None,
    header: str = "",
) -> Any:
    """The summary as rich renderables (a group of tables); ``speeds``:
    each base's :func:`rates` (``top``), shown under its title."""
    from rich.console import Group
    from rich.table import Table

    parts: list[Any] = [header] if header else []
    for view in views:
        s = view.summary()
        title = f"{view.base}  [{', '.join(view.roles) or '?'}]"
        if view.error:
            parts.append(f"[red]{title}: {view.error}[/red]")
            continue
        ready = s["ready"].get("status", "?")
        seat = (s["ready"].get("workers") or {}).get(view.base)
        if isinstance(seat, dict):  # one of the workers of a holder (docs/workers.md)
            title += f"  worker {seat.get('worker')}, restarts {seat.get('restarts')}"
        parts.append(
            f"[bold]{title}[/bold]  ready: {'[green]' if ready == 'ok' else '[red]'}{ready}[/]"
        )
        if speeds is not None:
            parts.append(_speed_line(speeds.get(view.base)))
        if "tiers" in s:
            table = Table("tier", "used", "capacity", "fill", "state", "read p99", "write p99")
            for tier in s["tiers"]:
                fill = tier["used"] / tier["capacity"] if tier["capacity"] else 0.0
                table.add_row(
                    tier["tier"],
                    _octets(tier["used"]),
                    _octets(tier["capacity"]),
                    f"{fill:.0%}",
                    "degraded" if tier["degraded"] else "ok",
                    _seconds(tier["read_p99_s"]),
                    _seconds(tier["write_p99_s"]),
                )
            parts.append(table)
            ratio = "-" if s["hit_ratio"] is None else f"{s['hit_ratio']:.1%}"
            parts.append(
                f"hit ratio {ratio}, leases {s['leases']} (rejected "
                f"{s['lease_rejections']}), replicas published "
                f"{s['replicas_published']} / withdrawn {s['replicas_withdrawn']}, "
                f"digest failures {s['digest_failures']}"
            )
        if "lookups" in s:
            ratio = "-" if s["lookup_hit_ratio"] is None else f"{s['lookup_hit_ratio']:.1%}"
            parts.append(f"index: {s['lookups']} lookups, key hit ratio {ratio}")
        if "placements" in s:
            parts.append(f"controller: {s['placements']} placements, {s['migrations']} migrations")
            table = Table("instance", "state", "epoch", "running", "queued", "kv", "prefill/s")
            for i in s["instances"]:
                table.add_row(
                    i["instance"],
                    i["state"],
                    str(i["epoch"]),
                    str(i["running"]),
                    str(i["queued"]),
                    f"{i['kv_utilization']:.0%}",
                    f"{i['prefill_tokens_per_s']:.0f}",
                )
            parts.append(table)
        if "sessions" in s:
            parts.append(
                f"instance: {s['sessions']} sessions, tokens fetched "
                f"{s['fetched_tokens']} / recomputed {s['recomputed_tokens']}, "
                f"output {s['output_tokens']}"
            )
    return Group(*parts)


def _speed_line(speed: dict[str, float | None] | None) -> str:
    if not speed:
        return "rates: after the next scrape"
    shown = []
    for name, _, divisor, unit in RATES:
        if name in speed:
            value = speed[name]
            figure = (
                "restarted" if value is None else f"{value:.1f}" if divisor > 1 else f"{value:.0f}"
            )
            shown.append(f"{figure} {unit}")
    return "rates: " + ", ".join(shown)


async def top(
    bases: list[str],
    context: ssl.SSLContext | None,
    interval: float = 1.0,
    rounds: int = 0,
    console: Any = None,
) -> int:
    """Redraw the summary every ``interval`` seconds, with the rates since
    the previous scrape, until ``q`` is pressed (when standard input is a
    terminal), Ctrl-C, or ``rounds`` (0: no end). The rounds drawn."""
    from rich.live import Live

    previous: dict[str, RoleView] = {}
    drawn = 0
    async with _session(context) as http:
        with Live(console=console, refresh_per_second=4, screen=False) as live, _keys() as quit_:
            while True:
                views = await _gather(http, bases)
                speeds = {v.base: rates(previous[v.base], v) for v in views if v.base in previous}
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                hint = ", q quits" if quit_ is not None else ""
                header = f"[bold]kvstore top[/bold]  {stamp}  every {interval:g} s{hint}"
                live.update(render(views, speeds, header))
                previous = {v.base: v for v in views}
                drawn += 1
                if rounds and drawn >= rounds:
                    return drawn
                if quit_ is None:
                    await asyncio.sleep(interval)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(quit_.wait(), interval)
                if quit_.is_set():
                    return drawn


@contextlib.contextmanager
def _keys() -> Iterator[asyncio.Event | None]:
    """An event set when ``q`` is typed: standard input in cbreak mode (no
    Enter needed, echo off) while ``top`` runs, restored after; None when
    standard input is not a terminal."""
    try:
        import termios
        import tty
    except ImportError:  # (not a POSIX terminal)
        yield None
        return
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()
    pressed = asyncio.Event()

    def readable() -> None:
        if os.read(fd, 64).lower().find(b"q") >= 0:
            pressed.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, readable)
    try:
        yield pressed
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
