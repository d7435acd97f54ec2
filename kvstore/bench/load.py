"""``kvstore bench load``: a holder process under concurrent mixed traffic.

As users load a shared cache server: one holder process over mutual TLS, C
clients on keep-alive connections, half PUTs of new blocks (2 MiB, 32
layers), half GETs (a hot block, a random whole block, a random layer range
``a-b``), for a fixed time, a fresh holder per run. Tier chains:

* host only (room for everything: no eviction), the baseline;
* host (64 MiB) over LMDB;
* host (64 MiB) over LMDB (256 MiB) over Redis;
* host (64 MiB) over LMDB (256 MiB) over S3 (moto's server).

Rows, for C = 1, 4, 16: operations per second, PUT p99 and hot-GET p99 of
each chain, each as a ratio to host-only in the same run (ops/s: higher is
better; latencies: lower), and the C=1 -> C=16 gain of each chain. Goals
(issue 17): at C=16, host over LMDB >= 0.8 of host-only and host/LMDB/S3 >=
0.5; every chain's hot-GET p99 <= 2x host-only's; C=1 -> C=16 >= 1.5x with
LMDB. Each run checks what it read: a GET that returns other octets than
were PUT is an error, and errors are reported, never dropped.

The holder's CPU per operation (user + system time of its process over the
run, from ``/proc``, divided by the operations; and of its event-loop thread
alone) is compared with a bare
uvicorn app (``kvstore.bench.bare --store``) serving the same traffic over the
same mutual TLS: it keeps the bodies in a dict and checks nothing (goal: the
holder within 1.5x at C=16, host only).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol import container as kc
from . import Result
from .holder import COMPAT, SCOPE, _port, _wait

LAYERS = 32
SECTION = 32 << 10  # 32 layers x 2 x 32 KiB: 2 MiB a block
HOST_SMALL = 64 << 20
CHAINS = ("host", "host+lmdb", "host+lmdb+redis", "host+lmdb+s3")


@dataclass
class Run:
    """What C clients did against one holder for ``seconds``."""

    chain: str
    clients: int
    seconds: float
    operations: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    #: CPU seconds the server process used over the run (None: not measured).
    cpu_s: float | None = None
    #: ... and its event-loop (main) thread alone.
    loop_cpu_s: float | None = None

    @property
    def rate(self) -> float:
        return self.operations / self.seconds

    @property
    def cpu_ms_per_op(self) -> float | None:
        if self.cpu_s is None or not self.operations:
            return None
        return 1000 * self.cpu_s / self.operations

    @property
    def loop_ms_per_op(self) -> float | None:
        if self.loop_cpu_s is None or not self.operations:
            return None
        return 1000 * self.loop_cpu_s / self.operations

    def p(self, kind: str, q: float) -> float:
        """Latency quantile ``q`` of ``kind`` in ms (nearest rank); 0 without samples."""
        values = sorted(self.latencies.get(kind, []))
        if not values:
            return 0.0
        return 1000 * values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


def _tiers(chain: str, root: Path, redis_url: str, s3_endpoint: str | None, port: int) -> str:
    host = 8 << 30 if chain == "host" else HOST_SMALL
    out = f'[[storage.tiers]]\nbackend = "host"\ncapacity = {host}\n'
    if "lmdb" in chain:
        lmdb = 8 << 30 if chain == "host+lmdb" else 256 << 20
        size = (lmdb * 3) // 2 + (64 << 20)
        out += (
            f'[[storage.tiers]]\nbackend = "lmdb"\ncapacity = {lmdb}\n'
            f'path = "{root / f"lmdb-{port}"}"\nmap_size = {size}\n'
        )
    if "redis" in chain:
        out += (
            f'[[storage.tiers]]\nbackend = "redis"\ncapacity = {8 << 30}\nurl = "{redis_url}"\n'
            f'prefix = "kvstore-bench-load-{port}:"\n'
        )
    if "s3" in chain:
        out += (
            f'[[storage.tiers]]\nbackend = "s3"\ncapacity = {64 << 30}\n'
            f'bucket = "kvstore-load-{port}"\nendpoint_url = "{s3_endpoint}"\n'
            'region = "us-east-1"\naccess_key_id = "testing"\n'
            'secret_access_key = "testing"\ncreate_bucket = true\n'
        )
    return out


def _holder(root: Path, chain: str, redis_url: str, s3_endpoint: str | None) -> tuple[Any, str]:
    port = _port()
    config = root / f"load-{port}.toml"
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ncertfile = "certs/server.pem"\n'
        'keyfile = "certs/server.key"\ncafile = "certs/ca.pem"\nlog_level = "warning"\n'
        f'[holder]\nuri = "https://127.0.0.1:{port}/kvsp/"\npolicy = "policy.json"\n'
        "max_block_octets = 16777216\n" + _tiers(chain, root, redis_url, s3_endpoint, port)
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(port, process, timeout=60)
    return process, f"https://127.0.0.1:{port}/kvsp/"


def _bare(root: Path) -> tuple[Any, str]:
    """The baseline: bare uvicorn keeping the bodies, same TLS."""
    port = _port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.bench.bare",
            "--port",
            str(port),
            "--store",
            "--tls-dir",
            str(root / "certs"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(port, process, timeout=60)
    return process, f"https://127.0.0.1:{port}/kvsp/"


def _cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """User + system CPU time of a process (or one of its threads) so far
    (Linux ``/proc``), else None."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


POOL = 24  # distinct bodies, made before the clock runs: the client is not what is measured


def _pool() -> list[bytes]:
    out = []
    for n in range(POOL):
        rng = random.Random(n)
        layers = [(rng.randbytes(SECTION), rng.randbytes(SECTION)) for _ in range(LAYERS)]
        out.append(bytes(kc.encode(layers, token_count=16)))
    return out


async def _drive(chain: str, uri: str, context: Any, clients: int, seconds: float) -> Run:
    import aiohttp

    run = Run(chain, clients, seconds)
    pool = _pool()
    # A body is any container: new keys reuse the pool's bodies (the key
    # names a prefix, not octets), so the GETs still check what they get.
    bodies: dict[int, bytes] = {}
    key = {n: f"{n:064x}" for n in range(100_000)}
    url = f"{uri}blocks/{COMPAT}/{SCOPE}/"
    connector = aiohttp.TCPConnector(ssl=context, limit=clients)
    async with aiohttp.ClientSession(connector=connector) as http:
        # A hot block and a few more, before the clock runs.
        for n in range(4):
            bodies[n] = pool[n]
            async with http.put(url + key[n], data=bodies[n], headers={"If-None-Match": "*"}):
                pass
        counter = iter(range(4, 100_000))
        ranges: dict[tuple[int, int, int], bytes] = {}

        def expected(body: bytes, a: int, b: int) -> bytes:
            """Layers a-b of ``body`` as a holder sends them (kept: few bodies)."""
            key = (id(body), a, b)
            if key not in ranges:
                ranges[key] = bytes(kc.decode(body).slice(a, b).tobytes())
            return ranges[key]

        stop_at = time.monotonic() + seconds

        async def one(rng: random.Random) -> None:
            pick = rng.random()
            if pick < 0.5:
                kind, n = "put", next(counter)
                body = bodies[n] = pool[n % POOL]
                start = time.perf_counter()
                async with http.put(
                    url + key[n], data=body, headers={"If-None-Match": "*"}
                ) as answer:
                    await answer.read()
                    ok = answer.status == 201
            else:
                kind = "hot-get" if pick < 0.65 else "get" if pick < 0.85 else "range-get"
                n = 0 if kind == "hot-get" else rng.choice(list(bodies))
                a = rng.randrange(LAYERS) if kind == "range-get" else 0
                b = rng.randrange(a, LAYERS) if kind == "range-get" else LAYERS - 1
                query = f"?layers={a}-{b}" if kind == "range-get" else ""
                start = time.perf_counter()
                async with http.get(url + key[n] + query) as answer:
                    data = await answer.read()
                    if answer.status == 404:
                        ok = True  # evicted: a miss is an answer (P4)
                    else:
                        expect = expected(bodies[n], a, b) if query else bodies[n]
                        ok = answer.status == 200 and data == expect
            run.latencies.setdefault(kind, []).append(time.perf_counter() - start)
            run.operations += 1
            if not ok:
                run.errors.append(f"{kind} {n}: {answer.status}")

        async def client(me: int) -> None:
            rng = random.Random(me)
            while time.monotonic() < stop_at:
                try:
                    await one(rng)
                except (aiohttp.ClientError, OSError) as exc:
                    run.errors.append(repr(exc))

        await asyncio.gather(*(client(i) for i in range(clients)))
    return run


def _rows(runs: dict[tuple[str, int], Run], counts: tuple[int, ...]) -> list[Result]:
    out: list[Result] = []
    for clients in counts:
        base = runs.get(("host", clients))
        for chain in CHAINS:
            run = runs.get((chain, clients))
            if run is None:
                continue
            name = f"{chain}, C={clients}"
            if run.errors:
                out.append(
                    Result(f"{name}: errors", "count", len(run.errors), goal=0, direction="lower")
                )
            if chain == "host" or base is None or not base.rate:
                out.append(Result(f"{name}: ops/s", "ops/s", run.rate))
                for kind in ("put", "hot-get"):
                    if run.p(kind, 0.99):
                        out.append(Result(f"{name}: {kind} p99", "ms", run.p(kind, 0.99)))
                continue
            goal = (
                {"host+lmdb": 0.8, "host+lmdb+s3": 0.5}.get(chain)
                if clients == max(counts)
                else None
            )
            out.append(
                Result(f"{name}: ops/s", "ops/s", run.rate, "host only, same C", base.rate, goal)
            )
            for kind, kind_goal in (("put", None), ("hot-get", 2.0)):
                ours, theirs = run.p(kind, 0.99), base.p(kind, 0.99)
                judged = kind_goal if clients == max(counts) else None
                if ours and theirs:
                    out.append(
                        Result(
                            f"{name}: {kind} p99", "ms", ours, "host only, same C", theirs, judged
                        )
                    )
    for clients in counts:
        holder, bare = runs.get(("host", clients)), runs.get(("bare", clients))
        if holder is None or bare is None:
            continue
        if bare.errors:
            out.append(
                Result(
                    f"bare uvicorn, C={clients}: errors",
                    "count",
                    len(bare.errors),
                    goal=0,
                    direction="lower",
                )
            )
        per_op, bare_per_op = holder.cpu_ms_per_op, bare.cpu_ms_per_op
        if per_op and bare_per_op:
            out.append(
                Result(
                    f"host, C={clients}: holder CPU per op",
                    "ms",
                    per_op,
                    "bare uvicorn, same traffic",
                    bare_per_op,
                    1.5 if clients == max(counts) else None,
                )
            )
        loop_per_op = holder.loop_ms_per_op
        if loop_per_op and bare_per_op:
            # What the event loop itself does (TLS, HTTP, the store's
            # bookkeeping) against all a bare app does: hashing, sealing and
            # LMDB run on other threads (item 5 of issue 17).
            out.append(
                Result(
                    f"host, C={clients}: holder event-loop CPU per op",
                    "ms",
                    loop_per_op,
                    "bare uvicorn, same traffic",
                    bare_per_op,
                )
            )
    first, last = min(counts), max(counts)
    for chain in CHAINS:
        low, high = runs.get((chain, first)), runs.get((chain, last))
        if low is not None and high is not None and low.rate:
            out.append(
                Result(
                    f"{chain}: C={last} ops/s",
                    "ops/s",
                    high.rate,
                    f"C={first}",
                    low.rate,
                    1.5 if chain == "host+lmdb" else None,
                )
            )
    return out


async def _run_all(
    root: Path,
    seconds: float,
    counts: tuple[int, ...],
    redis_url: str | None,
    s3_endpoint: str | None,
    chains: tuple[str, ...],
) -> dict[tuple[str, int], Run]:
    from ..tls import client_context

    context = client_context(
        str(root / "certs" / "ca.pem"),
        str(root / "certs" / "client-bench.pem"),
        str(root / "certs" / "client-bench.key"),
    )
    runs: dict[tuple[str, int], Run] = {}
    for chain in ("bare", *chains) if "host" in chains else chains:
        if ("redis" in chain and not redis_url) or ("s3" in chain and not s3_endpoint):
            continue
        for clients in counts:
            if chain == "bare":
                process, uri = _bare(root)
            else:
                process, uri = _holder(root, chain, redis_url or "", s3_endpoint)
            try:
                pid = process.pid
                before, loop_before = _cpu_seconds(pid), _cpu_seconds(pid, pid)
                run = await _drive(chain, uri, context, clients, seconds)
                after, loop_after = _cpu_seconds(pid), _cpu_seconds(pid, pid)
                if before is not None and after is not None:
                    run.cpu_s = after - before
                if loop_before is not None and loop_after is not None:
                    run.loop_cpu_s = loop_after - loop_before
                runs[(chain, clients)] = run
            finally:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                if "redis" in chain and redis_url:
                    _forget_redis_keys(redis_url, uri)
    return runs


def _forget_redis_keys(url: str, uri: str) -> None:
    """Delete what a run left in Redis (its holder's prefix): runs add up to
    gigabytes, and a Redis that fills the machine's memory slows the next."""
    import redis

    port = uri.rsplit(":", 1)[1].split("/", 1)[0]
    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=f"kvstore-bench-load-{port}:*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


def run(
    *,
    quick: bool = False,
    seconds: float | None = None,
    redis_url: str | None = "redis://127.0.0.1:6379/0",
    start_moto: bool = True,
    chains: tuple[str, ...] = CHAINS,
) -> list[Result]:
    """Every chain at C = 1, 4, 16 (quick: 1 and 16, 3 s each; else 25 s)."""
    from ..security import create_dev_certificates
    from .store import _start_moto

    counts = (1, 16) if quick else (1, 4, 16)
    duration = seconds or (3.0 if quick else 25.0)
    moto = _start_moto() if start_moto and any("s3" in c for c in chains) else None
    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-load-") as tmp:
            root = Path(tmp)
            create_dev_certificates(root / "certs", ["bench"])
            (root / "policy.json").write_text(
                json.dumps(
                    {
                        "principals": {
                            "urn:kvstore:bench": {"read_scopes": ["*"], "write_scopes": ["*"]}
                        }
                    }
                )
            )
            runs = asyncio.run(
                _run_all(root, duration, counts, redis_url, moto[1] if moto else None, chains)
            )
    finally:
        if moto is not None:
            moto[0].terminate()
    return _rows(runs, counts)
