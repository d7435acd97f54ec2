"""``kvstore bench soak``: a holder process under mixed traffic, for a while.

N clients PUT new blocks, GET random acknowledged ones and take and release
leases against one holder process (``kvstore serve --roles holder``, plain
HTTP on loopback) whose host tier is far smaller than what is written, so
blocks are demoted to LMDB all along. LMDB is sized to keep everything: an
acknowledged block that cannot be read back at the end is lost.

Reported: operations per second (and its ratio to the first tenth of the
run: does it hold up?), p50 and p99 latency per kind, errors, lost blocks,
and the holder's resident anonymous memory over time (RssAnon: LMDB's mapped
file pages are page cache) against its bound (the host tier's capacity plus
a fixed overhead). :func:`soak` returns the figures
for the CI test, which asserts zero errors, zero lost blocks and bounded
memory.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..protocol import container as kc
from . import Result
from .holder import _port, _wait

COMPAT = "c" * 64
SCOPE = "d" * 32
BLOCK_SECTION = 16 << 10  # 8 layers x 2 x 16 KiB: ~256 KiB a block
HOST_OCTETS = 16 << 20
OVERHEAD_OCTETS = 128 << 20  # Python, uvicorn, the libraries: measured ~50 MiB anonymous


@dataclass
class SoakReport:
    seconds: float
    clients: int
    operations: int = 0
    errors: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    rss: list[tuple[float, int]] = field(default_factory=list)
    first_tenth_ops: int = 0
    acknowledged: int = 0
    bound_octets: int = HOST_OCTETS + OVERHEAD_OCTETS

    @property
    def peak_rss(self) -> int:
        return max((r for _, r in self.rss), default=0)

    def percentile(self, kind: str, q: float) -> float:
        values = sorted(self.latencies.get(kind, []))
        if not values:
            return 0.0
        return values[min(len(values) - 1, int(q * len(values)))]


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            # Anonymous memory: LMDB's file pages (mmap) are page cache the
            # kernel reclaims, not the holder's own.
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _block(n: int) -> bytes:
    rng = random.Random(n)
    layer = [(rng.randbytes(BLOCK_SECTION), rng.randbytes(BLOCK_SECTION)) for _ in range(8)]
    return bytes(kc.encode(layer, token_count=4))


async def soak(seconds: float = 30.0, clients: int = 8, root: Path | None = None) -> SoakReport:
    from ..client import HolderClient

    report = SoakReport(seconds, clients)
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as tmp:
        where = root or Path(tmp)
        port = _port()
        uri = f"http://127.0.0.1:{port}/kvsp/"
        (where / "policy.json").write_text(
            json.dumps({"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}})
        )
        (where / "soak.toml").write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {port}\ninsecure_http = true\n'
            f'[holder]\nuri = "{uri}"\npolicy = "policy.json"\n'
            "[storage]\nlease_max_octets_per_client = 4194304\nlease_max_ttl_ms = 2000\n"
            f'[[storage.tiers]]\nbackend = "host"\ncapacity = {HOST_OCTETS}\n'
            '[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 4294967296\npath = "lmdb"\n'
            "map_size = 5368709120\n"
        )
        log = (where / "holder.log").open("wb")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--roles",
                "holder",
                "--config",
                str(where / "soak.toml"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait(port, process)
            acked: dict[int, str] = {}  # n -> block key
            counter = iter(range(10**9))
            started = time.monotonic()
            stop_at = started + seconds

            async def sample() -> None:
                while time.monotonic() < stop_at:
                    report.rss.append((time.monotonic() - started, _rss(process.pid)))
                    await asyncio.sleep(0.5)

            async def client(me: int, http: HolderClient) -> None:
                rng = random.Random(me)
                while time.monotonic() < stop_at:
                    roll = rng.random()
                    begin = time.perf_counter()
                    try:
                        if roll < 0.35 or not acked:
                            kind = "put"
                            n = next(counter)
                            key = f"{n:064x}"
                            await http.put_block(uri, COMPAT, SCOPE, key, _block(n))
                            acked[n] = key
                        elif roll < 0.85:
                            kind = "get"
                            n = rng.choice(list(acked))
                            body = await http.get_block(uri, COMPAT, SCOPE, acked[n])
                            if body != _block(n):
                                report.errors.append(f"block {n} served altered")
                        else:
                            kind = "lease"
                            n = rng.choice(list(acked))
                            grant = await http.lease(uri, [acked[n]], 1000)
                            await http.release_lease(uri, grant.lease)
                    except Exception as exc:
                        report.errors.append(f"{kind}: {exc!r}"[:300])
                        continue
                    report.latencies.setdefault(kind, []).append(time.perf_counter() - begin)
                    report.operations += 1
                    if time.monotonic() - started < seconds / 10:
                        report.first_tenth_ops += 1

            async with HolderClient(timeout_s=30) as http:
                await asyncio.gather(sample(), *(client(i, http) for i in range(clients)))
                report.acknowledged = len(acked)
                # Nothing acknowledged is lost: every block is read back.
                for n, key in acked.items():
                    try:
                        if await http.get_block(uri, COMPAT, SCOPE, key) != _block(n):
                            report.lost.append(f"{n}: altered")
                    except Exception as exc:
                        report.lost.append(f"{n}: {exc!r}"[:200])
        finally:
            process.terminate()
            process.wait(timeout=30)
            log.close()
    return report


def report_rows(report: SoakReport, duration: float, clients: int) -> list[Result]:
    """The soak's rows: the rate against its own first tenth, the bounds as
    plain figures with their goals, each kind's p99 against its p50."""
    rate = report.operations / duration
    first = report.first_tenth_ops / (duration / 10)
    label = f"soak: operations/s, {clients} clients, {duration:.0f} s"
    results = [
        Result(label, "ops/s", rate, "the run's first tenth", first)
        if first > 0
        else Result(label, "ops/s", rate),
        Result("soak: errors", "count", float(len(report.errors)), goal=0, direction="lower"),
        Result(
            f"soak: acknowledged blocks lost, of {report.acknowledged}",
            "count",
            float(len(report.lost)),
            goal=0,
            direction="lower",
        ),
        # The bound is a goal, not a measurement: a plain figure against it.
        Result(
            "soak: peak holder RssAnon (goal: host tier + overhead)",
            "MiB",
            report.peak_rss / 2**20,
            goal=report.bound_octets / 2**20,
            direction="lower",
        ),
    ]
    for kind in ("put", "get", "lease"):
        if not report.latencies.get(kind):
            continue  # none done: no figure to show
        p99, p50 = (1000 * report.percentile(kind, q) for q in (0.99, 0.5))
        results.append(
            Result(f"soak: {kind} p99", "ms", p99, f"{kind} p50", p50)
            if p50 > 0
            else Result(f"soak: {kind} p99", "ms", p99)
        )
    return results


def run(quick: bool = False, seconds: float | None = None, clients: int = 8) -> list[Result]:
    duration = seconds or (10.0 if quick else 60.0)
    report = asyncio.run(soak(duration, clients))
    results = report_rows(report, duration, clients)
    if report.errors:
        print("\n".join(report.errors[:10]), file=sys.stderr)
    return results
