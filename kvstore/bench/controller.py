"""``kvstore bench controller``: placement decisions and status updates per second.

64 active instances with links to 4 holders; prompts of 512 and 8k block
keys with 3 replicas each in an Index Service that runs as its own process
(``kvstore serve --roles index``, memory state, plain HTTP on loopback).
A placement is one ``POST place`` through the PC's whole ASGI app: request
parsing, the IS lookup over HTTP (``shapes_only``), ranking every active
instance by the draft's cost. Then the same with the IS in the PC's process
(``kvstore serve --roles pc,index``: :class:`~kvstore.index.local.LocalIndex`,
no HTTP or JSON to the IS), with the keys as a JSON list and packed (an
``application/octet-stream`` body), against the goals of issue 20.
Sequential, and with several in flight (the IS and the PC then work at
once, on two cores); in process, packed keys also 1 and 16 at once. Baseline in the same run: the
bare IS lookup the placement makes, from the same client. The goal, 1000
placements/s with 4 in flight, is an absolute figure (a plain row), and so
is the rate of status updates through ``MemoryControllerState.put_status``
(nothing in the run does the same work).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..protocol.control import InstanceStatus, Link
from ..protocol.records import LookupRequest
from . import Result
from .holder import _port, _wait
from .index import COMPAT, SCOPE, _call, _record

HOLDERS = [f"https://h{i}.bench/kvsp/" for i in range(4)]
BLOCK_TOKENS = 16
#: Placements per second to reach with this many in flight.
PLACEMENT_GOAL = (4, 1000.0)


def placement_rows(size: int, lookups_per_s: float, rates: dict[int, float]) -> list[Result]:
    """Placements/s for each number in flight against the bare lookup, then
    the goal's row as a plain figure."""
    rows = []
    for in_flight, rate in rates.items():
        label = f"placements, {size}-key prompts, 64 instances, {in_flight} at once"
        rows.append(
            Result(label, "placements/s", rate, "bare IS lookup (1 at once)", lookups_per_s)
        )
    in_flight, goal = PLACEMENT_GOAL
    if in_flight in rates:
        label = f"placements, {size}-key prompts, 64 instances, {in_flight} at once"
        rows.append(Result(label, "placements/s", rates[in_flight], goal=goal))
    return rows


def _status(n: int, epoch: int = 1) -> InstanceStatus:
    return InstanceStatus(
        instance=f"https://ii{n}.bench/kvsp/",
        epoch=epoch,
        state="active",
        running=n % 8,
        queued=n % 3,
        batch_size=32,
        kv_utilization=0.5,
        prefill_tokens_per_s=40000 + n,
        decode_tokens_per_s=3000,
        ttl_ms=600_000,
        links=tuple(Link(h, 100000.0 + 1000 * i, 10.0 + n % 5) for i, h in enumerate(HOLDERS)),
    )


def _index_process(root: Path, max_keys: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    (root / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "anonymous": {"roles": ["admin"], "read_scopes": ["*"], "write_scopes": ["*"]},
                }
            }
        )
    )
    (root / "index.toml").write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ninsecure_http = true\n'
        f'[index]\nuri = "http://127.0.0.1:{port}/is/"\npolicy = "policy.json"\n'
        f"max_lookup_keys = {max_keys}\n"
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--roles",
            "index",
            "--config",
            str(root / "index.toml"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(port, process)
    return process, f"http://127.0.0.1:{port}/is/"


async def _rate(make_call: Any, seconds: float, in_flight: int) -> float:
    """Calls per second over ``seconds``, ``in_flight`` at a time."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await make_call()
            count += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - started)


async def _run(quick: bool) -> list[Result]:
    from ..client import IndexClient
    from ..controller.app import create_app
    from ..controller.state import MemoryControllerState
    from ..security import Policy
    from ..settings import ControllerSettings

    pc = MemoryControllerState()
    statuses = [_status(n) for n in range(64)]
    start = time.perf_counter()
    rounds = 20 if quick else 200
    for _ in range(rounds):
        for status in statuses:
            await pc.put_status(status)
    updates = rounds * len(statuses) / (time.perf_counter() - start)
    results = [Result("status updates", "updates/s", updates)]

    sizes = [512] if quick else [512, 8192]
    keys = [f"{n:064x}" for n in range(max(sizes))]
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-pc-") as tmp:
        process, index_uri = _index_process(Path(tmp), max(sizes))
        try:
            async with IndexClient(index_uri) as index:
                gate = asyncio.Semaphore(64)

                async def publish(key: str, holder: str) -> None:
                    async with gate:
                        await index.publish(_record(key, holder))

                await asyncio.gather(*(publish(k, h) for k in keys for h in HOLDERS[:3]))
                policy = Policy.from_json(
                    {
                        "principals": {
                            "anonymous": {"read_scopes": ["*"]},
                            **{
                                f"ii{n}": {
                                    "roles": ["instance"],
                                    "instance": s.instance,
                                    "write_scopes": ["*"],
                                }
                                for n, s in enumerate(statuses)
                            },
                        }
                    }
                )
                settings = ControllerSettings(
                    "http://bench/pc/",
                    allow_anonymous=True,
                    max_place_keys=max(sizes),
                    max_json_octets=16 << 20,
                    block_tokens={COMPAT: BLOCK_TOKENS},
                    mean_service_ms=2.0,
                )
                app = create_app(settings, pc, policy, index)
                seconds = 1.0 if quick else 3.0
                base_of: dict[int, float] = {}
                for size in sizes:
                    body = json.dumps(
                        {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": keys[:size]}
                    ).encode()
                    answer = json.loads(await _call(app, body, path="/pc/place"))
                    assert answer["matched"] == size and answer["index"] == "ok", answer
                    query = LookupRequest(SCOPE, COMPAT, tuple(keys[:size]), shapes_only=True)

                    async def place(body: bytes = body) -> None:
                        await _call(app, body, path="/pc/place", keep=False)

                    async def lookup(query: LookupRequest = query) -> None:
                        await index.lookup(query)

                    base = await _rate(lookup, seconds, 1)
                    rates = {n: await _rate(place, seconds, n) for n in (1, 4)}
                    results += placement_rows(size, base, rates)
                    base_of[size] = rates[4]
                results += await _in_process(pc, policy, settings, keys, sizes, seconds, base_of)
        finally:
            process.terminate()
            process.wait(timeout=20)
    return results


#: Placements per second to reach, PC and IS in one process, 4 in flight,
#: by prompt size (issue 20).
IN_PROCESS_GOALS = {512: 2000.0, 8192: 1000.0}


async def _in_process(
    pc: Any,
    policy: Any,
    settings: Any,
    keys: list[str],
    sizes: list[int],
    seconds: float,
    base_of: dict[int, float],
) -> list[Result]:
    """The same placements with the IS in the PC's process (``kvstore serve
    --roles pc,index``): the lookup asked in process (:class:`LocalIndex`),
    against the placements through the IS over HTTP measured above."""
    from ..controller.app import create_app
    from ..index import MemoryState
    from ..index.local import LocalIndex

    state = MemoryState()
    for key in keys:
        for holder in HOLDERS[:3]:
            await state.put(_record(key, holder), 600_000)
    app = create_app(settings, pc, policy, LocalIndex(state))
    rows = []
    header = json.dumps({"scope_id": SCOPE, "compat_id": COMPAT}).encode()
    octets = b"application/octet-stream"
    for size in sizes:
        listed = json.dumps(
            {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": keys[:size]}
        ).encode()
        # The compact form: a JSON header line, then the keys' 32 octets each.
        packed = header + b"\n" + b"".join(bytes.fromhex(k) for k in keys[:size])
        rates = {}
        for form, body, kind in (
            ("JSON keys", listed, b"application/kvsp+json"),
            ("packed keys", packed, octets),
        ):
            answer = json.loads(await _call(app, body, path="/pc/place", content_type=kind))
            assert answer["matched"] == size and answer["index"] == "ok", answer

            async def place(body: bytes = body, kind: bytes = kind) -> None:
                await _call(app, body, path="/pc/place", keep=False, content_type=kind)

            rates[form] = await _rate(place, seconds, 4)
            if form == "packed keys":
                # One process, one loop, no I/O: more in flight only queues.
                spread = {n: await _rate(place, seconds, n) for n in (1, 16)}
        label = f"placements, {size}-key prompts, 64 instances, 4 at once, IS in process"
        rows.append(
            Result(
                label + ", JSON keys",
                "placements/s",
                rates["JSON keys"],
                "the IS over HTTP, 4 at once",
                base_of[size],
            )
        )
        rows.append(
            Result(
                label + ", packed keys",
                "placements/s",
                rates["packed keys"],
                "the same, JSON keys",
                rates["JSON keys"],
            )
        )
        best = max(rates.values())
        rows.append(
            Result(
                label + ", the faster form", "placements/s", best, goal=IN_PROCESS_GOALS.get(size)
            )
        )
        for n, rate in spread.items():
            rows.append(
                Result(
                    f"placements, {size}-key prompts, 64 instances, {n} at once, IS in process, "
                    "packed keys",
                    "placements/s",
                    rate,
                    "the same, 4 at once",
                    rates["packed keys"],
                )
            )
    return rows


def run(quick: bool = False) -> list[Result]:
    return asyncio.run(_run(quick))
