"""``kvstore bench events``: the bridge of vLLM's KV events (issue 38).

* **Applied per second**: one bridge decoding and applying ``BlockStored``
  messages of 16-token blocks, chained (64 blocks a message, each message
  continuing the last one's chain), against the HMAC chain alone over the
  same tokens (``BlockKeyChain``, what ``kvstore keys`` computes): the
  bridge's own cost above the Block Keys it must compute. Goal: 50,000
  blocks/s.
* **Publish-to-visible lag**: a publisher made as vLLM's (PUB and ROUTER
  over ipc) sends chained ``BlockStored`` messages at a steady rate for a
  few seconds; the bridge (``flush_ms`` 20) tells an Index Service in a
  process of its own (plain HTTP on loopback); each message's lag runs from
  its event time to the IS acknowledging the update that carried it. p50
  and p99 against one IS round trip of an empty update measured in the
  same run; goal: p99 under 100 ms.
* **Placements per second with residency**: the PC and an IS in one
  process, 64 instances, 8k-key prompts with 3 replicas each, every
  instance resident on a prefix of its own, 1, 4 and 16 at once, against
  the same placements with no residency records.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..protocol.keys import BlockKeyChain
from . import Result

B = 16
PER_MESSAGE = 64
#: Blocks per second one bridge should apply (issue 38).
APPLY_GOAL = 50_000.0
#: The p99 of publish-to-visible lag to stay under, milliseconds.
LAG_GOAL_MS = 100.0
SCOPE_KEY = bytes(range(32))


def _messages(count: int) -> list[bytes]:
    """``count`` msgpack payloads of chained BlockStored events."""
    import msgpack

    out = []
    parent: int | None = None
    for m in range(count):
        hashes = list(range(m * PER_MESSAGE + 1, (m + 1) * PER_MESSAGE + 1))
        tokens = [(7 * i + m) % 50_000 for i in range(PER_MESSAGE * B)]
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": B,
            "medium": "GPU",
        }
        out.append(msgpack.packb([time.time(), [event], 0]))
        parent = hashes[-1]
    return out


def _applied_rows(quick: bool) -> list[Result]:
    from ..fleet.bridge import Bridge
    from ..fleet.vllm_events import decode_batch
    from .index import COMPAT

    count = 100 if quick else 1000
    payloads = _messages(count)
    bridge = Bridge({"": SCOPE_KEY}, COMPAT, B, max_blocks=count * PER_MESSAGE)
    started = time.perf_counter()
    for payload in payloads:
        bridge.apply(decode_batch(payload).events)
    applied = count * PER_MESSAGE / (time.perf_counter() - started)
    assert bridge.counters.blocks_stored == count * PER_MESSAGE
    tokens = [decode_batch(p).events[0].token_ids for p in payloads]  # type: ignore[union-attr]
    chain = BlockKeyChain(SCOPE_KEY, bytes.fromhex(COMPAT), B)
    started = time.perf_counter()
    for run in tokens:
        chain.extend(run)
    hmac_only = count * PER_MESSAGE / (time.perf_counter() - started)
    label = f"bridge: BlockStored applied, {B}-token blocks chained, {PER_MESSAGE} a message"
    return [
        Result(label, "blocks/s", applied, "the Block Key chain alone (HMAC)", hmac_only),
        Result(label, "blocks/s", applied, goal=APPLY_GOAL),
    ]


class Publisher:
    """vLLM's ZmqEventPublisher's wire behaviour (PUB, and a ROUTER replay
    buffer) over ipc in ``directory``, driven by the caller (this bench, and
    tests that drop a message or restart the numbering)."""

    def __init__(self, context: Any, directory: Path, buffer: int = 10_000) -> None:
        import zmq

        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        self.endpoint, self.replay = f"ipc://{directory}/pub", f"ipc://{directory}/replay"
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay)
        self.seq = 0
        self.replays = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.serving = asyncio.create_task(self._replays())

    async def send(self, payload: bytes, drop: bool = False) -> int:
        """Number and buffer ``payload``; send it unless ``drop`` (as a slow
        subscriber's high-water mark would lose it). Its sequence."""
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As a restarted engine: numbered from 0 again, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    async def _replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    frames = [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    await self.router.send_multipart(frames)
            end = (-1).to_bytes(8, "big", signed=True)
            await self.router.send_multipart([client, b"", b"", end, b""])

    def close(self) -> None:
        self.serving.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def _lag_rows(quick: bool, index_uri: str, directory: Path) -> list[Result]:
    import msgpack
    import zmq.asyncio

    from ..client import IndexClient
    from ..fleet.bridge import Bridge
    from ..fleet.service import EventBridge
    from ..protocol.residency import ResidencyUpdate
    from .index import COMPAT

    pod = "http://vllm-0.bench:8000/"
    context = zmq.asyncio.Context()
    publisher = Publisher(context, directory)
    payloads = _messages(400 if quick else 4000)
    events = [msgpack.unpackb(p)[1] for p in payloads]
    rate = 2_000 if quick else 10_000  # blocks per second
    seconds = 2.0 if quick else 5.0
    try:
        async with IndexClient(index_uri, timeout_s=10) as index:
            rtts = []
            for _ in range(50):
                started = time.perf_counter()
                await index.tell_residency(ResidencyUpdate(pod, 30_000))
                rtts.append(time.perf_counter() - started)
            service = EventBridge(
                Bridge({"": SCOPE_KEY}, COMPAT, B, max_blocks=len(payloads) * PER_MESSAGE),
                index,
                pod,
                endpoint=publisher.endpoint,
                replay_endpoint=publisher.replay,
                context=context,
            )
            running = asyncio.create_task(service.run())
            while service.expected is None:  # the SUB socket joins
                await publisher.send(msgpack.packb([time.time(), [], 0]))
                await asyncio.sleep(0.02)
            service.recent_lags.clear()
            interval = PER_MESSAGE / rate
            started = time.perf_counter()
            sent = 0
            while time.perf_counter() - started < seconds and sent < len(events):
                await publisher.send(msgpack.packb([time.time(), events[sent], 0]))
                sent += 1
                await asyncio.sleep(max(0.0, started + sent * interval - time.perf_counter()))
            deadline = time.perf_counter() + 5
            while len(service.recent_lags) < sent and time.perf_counter() < deadline:
                await asyncio.sleep(0.02)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            lags = sorted(service.recent_lags)
    finally:
        publisher.close()
        context.term()
    if not lags:
        raise RuntimeError("no update reached the index")
    p50 = statistics.median(lags) * 1000
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1000
    rtt = statistics.median(rtts) * 1000
    label = f"publish-to-visible lag at the IS, {rate} blocks/s, flush_ms 20"
    return [
        Result(label + ", p50", "ms", p50, "one IS round trip (empty update, p50)", rtt),
        Result(label + ", p99", "ms", p99, "one IS round trip (empty update, p50)", rtt),
        Result(label + ", p99", "ms", p99, goal=LAG_GOAL_MS),
    ]


async def _placement_rows(quick: bool) -> list[Result]:
    from ..controller.app import create_app
    from ..controller.state import MemoryControllerState
    from ..index import MemoryState
    from ..index.local import LocalIndex
    from ..index.residency import ResidencyBook
    from ..protocol.residency import ResidencyGroup, ResidencyUpdate
    from ..protocol.wire import role_id
    from ..security import Policy
    from ..settings import ControllerSettings
    from .controller import HOLDERS, _rate, _status
    from .index import COMPAT, SCOPE, _call, _record

    size = 8192
    keys = [f"{n:064x}" for n in range(size)]
    state = MemoryState()
    for key in keys:
        for holder in HOLDERS[:3]:
            await state.put(_record(key, holder), 600_000)
    pc = MemoryControllerState()
    statuses = [_status(n) for n in range(64)]
    for status in statuses:
        await pc.put_status(status)
    book = ResidencyBook()
    for n, status in enumerate(statuses):  # each a prefix of its own length
        held = tuple(keys[: 64 * (n + 1)])
        group = ResidencyGroup(SCOPE, COMPAT, "GPU", held)
        book.apply(
            role_id(status.instance), ResidencyUpdate(status.instance, 600_000, add=(group,))
        )
    policy = Policy.from_json(
        {
            "principals": {
                "anonymous": {"read_scopes": ["*"]},
                **{
                    f"ii{n}": {"roles": ["instance"], "instance": s.instance, "write_scopes": ["*"]}
                    for n, s in enumerate(statuses)
                },
            }
        }
    )
    settings = ControllerSettings(
        "http://bench/pc/",
        allow_anonymous=True,
        max_place_keys=size,
        max_json_octets=16 << 20,
        block_tokens={COMPAT: B},
        mean_service_ms=2.0,
    )
    body = json.dumps({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": keys}).encode()
    seconds = 1.0 if quick else 3.0
    rates: dict[tuple[str, int], float] = {}
    for name, residency in (("without", None), ("with", book)):
        app = create_app(settings, pc, policy, LocalIndex(state, residency=residency))
        answer = json.loads(await _call(app, body, path="/pc/place"))
        assert answer["matched"] == size, answer
        warm = [c for c in answer["candidates"] if c.get("resident_tokens")]
        assert (len(warm) == 64) == (residency is not None), answer["candidates"][:2]

        async def place(app: Any = app) -> None:
            await _call(app, body, path="/pc/place", keep=False)

        for in_flight in (1, 4, 16):
            rates[name, in_flight] = await _rate(place, seconds, in_flight)
    label = f"placements, {size}-key prompts, 64 instances each resident on a prefix"
    return [
        Result(
            f"{label}, {n} at once",
            "placements/s",
            rates["with", n],
            "the same with no residency records",
            rates["without", n],
        )
        for n in (1, 4, 16)
    ]


async def _run(quick: bool) -> list[Result]:
    from .controller import _index_process

    results = _applied_rows(quick)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-events-") as tmp:
        process, index_uri = _index_process(Path(tmp), 8192)
        try:
            results += await _lag_rows(quick, index_uri, Path(tmp))
        finally:
            process.terminate()
            process.wait(timeout=20)
    results += await _placement_rows(quick)
    return results


def run(quick: bool = False) -> list[Result]:
    return asyncio.run(_run(quick))
