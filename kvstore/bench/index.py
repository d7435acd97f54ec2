"""``kvstore bench index``: lookup latency and throughput, publish rate.

Prompts of 1k, 8k and 64k block keys, 3 replicas each, on the memory and the
Redis state. Lookups go through the whole ASGI app (request parsing, scope
check, answer assembly) called directly, without an HTTP client in the way.
Baselines in the same run: as many Redis EXISTS in one redis-py pipeline
(the issue's), and, for the Redis state, a raw HVALS pipeline fetching the
same records (the octets a lookup must move: about 60 MB at 8k keys). The
publish rate, the p99 and the throughput have nothing in the run doing the
same work: they are plain figures, the 8k-key p99 with the goals of issue 20
(5 ms in memory, 10 ms where IS processes share state). Then the replicated
state (two IS processes on one log in Redis Streams): lookups at either, the
replay at start and the publish-to-visible lag, on the Redis given and on a
3-master Redis Cluster with a replica each, started for the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import statistics
import time
import uuid
from typing import Any

from ..protocol.records import ReplicaRecord, Residency
from . import Result

COMPAT = hashlib.sha256(b"bench-index").hexdigest()
SCOPE = "c" * 32
HOLDERS = [f"https://h{i}.bench/kvsp/" for i in range(3)]
#: The goals of issue 20: p99 of an 8k-key lookup (ms) in memory, and at
#: either of two IS processes sharing state (no goal for other sizes).
P99_GOAL_MS = {8192: 5.0}
SHARED_P99_GOAL_MS = {8192: 10.0}


def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least ``q`` of them at or below
    it (the largest of fewer than 100 samples for q = 0.99)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def lookup_rows(
    label: str,
    size: int,
    latencies_s: list[float],
    baselines_ms: dict[str, float],
    goals_ms: dict[int, float] = P99_GOAL_MS,
) -> list[Result]:
    """A lookup size's rows: p50 against each same-run baseline (lower is
    better), then p99 and throughput as plain figures."""
    p50 = statistics.median(latencies_s) * 1000
    p99 = percentile(latencies_s, 0.99) * 1000
    rows = [Result(f"{label}, p50", "ms", p50, name, base) for name, base in baselines_ms.items()]
    if not rows:
        rows.append(Result(f"{label}, p50", "ms", p50))
    rows.append(Result(f"{label}, p99", "ms", p99, goal=goals_ms.get(size)))
    rows.append(Result(f"{label}, throughput", "keys/s", size / (p50 / 1000)))
    return rows


def _record(block_key: str, holder: str) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(f"{block_key}{i}".encode()).hexdigest() for i in range(32))
    digest = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    return ReplicaRecord(
        block_key=block_key,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=2 << 20,
        digest="sha-256:" + digest,
        layer_digests=digests,
        residency=(Residency("device", 0, 15), Residency("host", 16, 31, 400000.0)),
        ttl_ms=600_000,
    )


async def _call(
    app: Any,
    body: bytes,
    keep: bool = True,
    path: str = "/is/lookup",
    content_type: bytes = b"application/kvsp+json",
) -> bytes:
    """One POST (a lookup) through the ASGI app, no client library in between.

    Like a server writing each message out, the harness lets go of each
    message unless ``keep`` (the answer is checked once, after the timing)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("bench", 80),
        "client": ("b", 1),
        "root_path": "",
    }
    sent = [False]
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
        elif message["type"] == "http.response.body" and keep:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return b"".join(chunks)


async def _bench_state(
    name: str,
    state: Any,
    redis_url: str | None,
    sizes: list[int],
    rounds: int,
    publish: bool = True,
    cluster: bool = False,
    goals_ms: dict[int, float] = P99_GOAL_MS,
) -> list[Result]:
    from ..index import IndexSettings, create_app
    from ..security import Policy

    policy = Policy.from_json({"principals": {"anonymous": {"read_scopes": ["*"]}}})
    settings = IndexSettings(
        "http://bench/is/",
        max_lookup_keys=max(sizes),
        max_json_octets=16 << 20,
        allow_anonymous=True,
    )
    app = create_app(settings, state, policy)
    keys = [hashlib.sha256(f"k{n}".encode()).hexdigest() for n in range(max(sizes))]
    records = [_record(k, h) for k in keys for h in HOLDERS]
    results = []
    if publish:
        start = time.perf_counter()
        gate = asyncio.Semaphore(16)  # as holders publish: many at once

        async def one(record: Any) -> None:
            async with gate:
                await state.put(record, 600_000)

        await asyncio.gather(*(one(r) for r in records))
        publish_rate = len(records) / (time.perf_counter() - start)
        results.append(Result(f"publish, {name} state, 16 at once", "records/s", publish_rate))
    raw_client = None
    if redis_url:
        from ..redis_client import connect

        raw_client = connect(redis_url, cluster=cluster, timeout_s=120)
    for size in sizes:
        body = json.dumps(
            {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": keys[:size]}
        ).encode()
        # The first lookup after the publishes joins each key's records into
        # the group later lookups answer from (the memory states): its own
        # row, not the first sample of the steady state's p99.
        t = time.perf_counter()
        await _call(app, body, keep=False)
        first_ms = (time.perf_counter() - t) * 1000
        latencies = []
        for _ in range(rounds):
            t = time.perf_counter()
            await _call(app, body, keep=False)
            latencies.append(time.perf_counter() - t)
        answer = json.loads(await _call(app, body))
        assert answer["matched"] == size and len(answer["replicas"][-1]) == len(HOLDERS)
        baselines: dict[str, float] = {}
        if raw_client is not None:
            base = []
            for _ in range(rounds):
                t = time.perf_counter()
                async with raw_client.pipeline(transaction=False) as pipe:
                    for k in keys[:size]:
                        pipe.exists(k)
                    await pipe.execute()
                base.append(time.perf_counter() - t)
            baselines["redis-py EXISTS pipeline p50"] = statistics.median(base) * 1000
        if raw_client is not None and name == "redis":
            # The same records' octets fetched raw (what a lookup must move).
            fetch = []
            for _ in range(rounds):
                t = time.perf_counter()
                async with raw_client.pipeline(transaction=False) as pipe:
                    for k in keys[:size]:
                        pipe.hvals(f"{state.prefix}{{{k}}}:v")
                    await pipe.execute()
                fetch.append(time.perf_counter() - t)
            baselines["raw HVALS pipeline, same records"] = statistics.median(fetch) * 1000
        label = f"lookup {size // 1024}k keys x3, {name}"
        results.append(Result(f"{label}, the first after publishing", "ms", first_ms))
        results += lookup_rows(label, size, latencies, baselines, goals_ms)
        # What a placement asks (shapes_only, ours): the matched count and
        # the replicas' shapes, not ~60 MB of records (whose copy alone is
        # about 5 ms here at 8k keys).
        shapes_body = json.dumps(
            {"scope_id": SCOPE, "compat_id": COMPAT, "shapes_only": True, "block_keys": keys[:size]}
        ).encode()
        shaped = []
        for _ in range(rounds):
            t = time.perf_counter()
            await _call(app, shapes_body, keep=False)
            shaped.append(time.perf_counter() - t)
        results += lookup_rows(f"{label}, shapes only", size, shaped, {}, goals_ms)
    if raw_client is not None:
        await raw_client.aclose()
    if publish:
        await state.close()
    return results


#: Publish-to-visible lag to stay under, p99 (ms), issue 20.
LAG_GOAL_MS = 100.0


async def _bench_replicated(
    redis_url: str, sizes: list[int], rounds: int, cluster: bool = False
) -> list[Result]:
    """Two IS processes' replicated states on one log: lookups at either
    (the second one started after the records were published: it rebuilt
    them from the log) and the lag from a publish at one to a lookup at the
    other seeing it; with ``cluster``, the log on a Redis Cluster."""
    from ..index.replicated import ReplicatedState
    from ..redis_client import connect

    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    where = ", 3-master cluster" if cluster else ""
    first = ReplicatedState(redis_url, prefix, cluster=cluster)
    second = None
    try:
        results = await _bench_state(
            f"replicated{where}, the publishing IS",
            first,
            redis_url,
            sizes,
            rounds,
            publish=True,
            cluster=cluster,
            goals_ms=SHARED_P99_GOAL_MS,
        )
        first = ReplicatedState(redis_url, prefix, cluster=cluster)  # (the one above is closed)
        second = ReplicatedState(redis_url, prefix, cluster=cluster)
        start = time.perf_counter()
        rebuilt = await second.count()
        took = time.perf_counter() - start
        results.append(Result(f"replay of {rebuilt} records at start{where}", "s", took))
        results += await _bench_state(
            f"replicated{where}, another IS",
            second,
            redis_url,
            sizes,
            rounds,
            publish=False,
            cluster=cluster,
            goals_ms=SHARED_P99_GOAL_MS,
        )
        await first.count()
        lags = []
        for n in range(200 if rounds > 5 else 50):
            record = _record(hashlib.sha256(f"lag{n}".encode()).hexdigest(), HOLDERS[0])
            t = time.perf_counter()
            await first.put(record, 600_000)
            while (
                await second.lookup(SCOPE, COMPAT, [record.block_key], records=False)
            ).matched == 0:
                await asyncio.sleep(0.0005)
            lags.append((time.perf_counter() - t) * 1000)
        lags.sort()
        label = f"publish at one IS to visible at the other{where}"
        results.append(Result(f"{label}, p50", "ms", lags[len(lags) // 2]))
        results.append(Result(f"{label}, p99", "ms", percentile(lags, 0.99), goal=LAG_GOAL_MS))
        return results
    finally:
        await first.close()
        if second is not None:
            await second.close()
        client = connect(redis_url, cluster=cluster)
        for stream in first.streams:  # all a replicated state writes
            await client.delete(stream)
        await client.aclose()


async def _run(quick: bool, redis_url: str | None, start_cluster: bool = True) -> list[Result]:
    from ..index.state import MemoryState

    sizes = [1024, 8192] if quick else [1024, 8192, 65536]
    rounds = 5 if quick else 30
    results = await _bench_state("memory", MemoryState(), redis_url, sizes, rounds)
    if redis_url:
        from ..index.redis_state import RedisState

        prefix = f"bench-{uuid.uuid4().hex[:8]}:"
        state = RedisState(redis_url, prefix)
        try:
            results += await _bench_state(
                "redis", state, redis_url, sizes, max(3, rounds // 3), goals_ms=SHARED_P99_GOAL_MS
            )
        finally:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(redis_url)
            async for k in client.scan_iter(match=prefix + "*", count=1000):
                await client.delete(k)
            await client.aclose()
        results += await _bench_replicated(redis_url, [s for s in sizes if s <= 8192], rounds)
    if redis_url and start_cluster:
        results += await _cluster_rows(quick, rounds)
    return results


async def _cluster_rows(quick: bool, rounds: int) -> list[Result]:
    """The replicated state's rows with its log on a 3-master Redis Cluster
    started here (each master with a replica), as a deployment of several
    nodes has it (issue 20)."""
    from . import redis_cluster

    if not redis_cluster.available():
        # Not a figure that can be made here; said, not dropped.
        print("bench index: redis-server or redis-cli missing: no 3-master cluster rows")
        return []
    cluster = redis_cluster.start_cluster()
    try:
        sizes = [1024] if quick else [8192]
        return await _bench_replicated(cluster.url, sizes, max(5, rounds // 2), cluster=True)
    finally:
        cluster.stop()


def run(
    quick: bool = False,
    redis_url: str | None = "redis://127.0.0.1:6379/0",
    start_cluster: bool = True,
) -> list[Result]:
    """Every row; with ``start_cluster`` (and Redis's binaries here) also the
    replicated state over a 3-master Redis Cluster started for the run."""
    return asyncio.run(_run(quick, redis_url, start_cluster))
