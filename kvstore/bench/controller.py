"""``kvstore bench controller``: placement decisions and status updates per second.

64 active instances with links to 4 holders; prompts of 512 and 8k block
keys with 3 replicas each, looked up in an in-memory Index Service state
(the records parsed as the PC receives them), then ranked by the draft's
cost (``rank``). Status updates go through ``MemoryControllerState.put_status``.
"""

from __future__ import annotations

import asyncio
import time

from ..controller.placement import choose, rank
from ..controller.state import MemoryControllerState
from ..index.state import MemoryState
from ..protocol.control import InstanceStatus, Link
from ..protocol.records import ReplicaRecord
from . import Result
from .index import COMPAT, SCOPE, _record

HOLDERS = [f"https://h{i}.bench/kvsp/" for i in range(4)]


def _status(n: int, epoch: int = 1) -> InstanceStatus:
    return InstanceStatus(
        instance=f"https://ii{n}.bench/kvsp/", epoch=epoch, state="active", running=n % 8,
        queued=n % 3, batch_size=32, kv_utilization=0.5, prefill_tokens_per_s=40000 + n,
        decode_tokens_per_s=3000, ttl_ms=60_000,
        links=tuple(Link(h, 100000.0 + 1000 * i, 10.0 + n % 5) for i, h in enumerate(HOLDERS)),
    )  # fmt: skip


async def _run(quick: bool) -> list[Result]:
    pc = MemoryControllerState()
    statuses = [_status(n) for n in range(64)]
    start = time.perf_counter()
    rounds = 20 if quick else 200
    for _ in range(rounds):
        for status in statuses:
            await pc.put_status(status)
    updates = rounds * len(statuses) / (time.perf_counter() - start)
    results = [Result("status updates", "updates/s", updates, "(none)", 0.0)]
    index = MemoryState()
    sizes = [512] if quick else [512, 8192]
    keys = [f"{n:064x}" for n in range(max(sizes))]
    for k in keys:
        for holder in HOLDERS[:3]:
            await index.put(_record(k, holder), 600_000)
    for size in sizes:
        count = 0
        started = time.perf_counter()
        deadline = started + (1.0 if quick else 3.0)
        while time.perf_counter() < deadline:
            hits = await index.lookup(SCOPE, COMPAT, keys[:size])
            replicas = [[ReplicaRecord.from_json(r) for r in g] for g in hits.records()]
            choose(rank(await pc.active(), replicas, total_tokens=size * 16, block_tokens=16,
                        mean_service_us=2000))  # fmt: skip
            count += 1
        rate = count / (time.perf_counter() - started)
        results.append(Result(f"placements, {size}-key prompts, 64 instances", "placements/s",
                              rate, "goal", 1000.0, None))  # fmt: skip
    return results


def run(quick: bool = False) -> list[Result]:
    return asyncio.run(_run(quick))
