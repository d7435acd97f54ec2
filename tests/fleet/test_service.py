"""The bridge running (kvstore.fleet.service) against a ZMQ publisher made as
vLLM's is (PUB and a ROUTER replay buffer, over ipc): updates to the IS,
gaps filled by replay or voided, an engine restart, an IS that forgot."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvstore.bench.events import Publisher as BenchPublisher
from kvstore.fleet.bridge import Bridge
from kvstore.fleet.service import EventBridge
from kvstore.protocol.keys import block_keys, scope_id
from kvstore.protocol.problems import Unreachable
from kvstore.protocol.residency import ResidencyAnswer, ResidencyUpdate

COMPAT = hashlib.sha256(b"compat").hexdigest()
KEY = bytes(range(32))
SCOPE = scope_id(KEY).hex()
B = 16
POD = "https://vllm-0.test:8000/"
TOKENS = list(range(500, 500 + 8 * B))
KEYS = [k.hex() for k in block_keys(KEY, bytes.fromhex(COMPAT), TOKENS, B)]


class Publisher(BenchPublisher):
    """vLLM's publisher's wire behaviour (kvstore.bench.events), its events
    packed here."""

    def __init__(self, context: zmq.asyncio.Context, directory: Path) -> None:
        super().__init__(context, directory, buffer=100)
        self.replay_endpoint = self.replay

    async def send(self, *events: Any, drop: bool = False) -> int:  # type: ignore[override]
        payload = msgpack.packb([1.0e9 + self.seq, list(events), 0])
        return await super().send(payload, drop=drop)

    async def close(self) -> None:  # type: ignore[override]
        super().close()


class Index:
    """The IS's residency as the bridge sees it: updates applied in order."""

    index_uri = "https://index.test/is/"

    def __init__(self) -> None:
        self.updates: list[ResidencyUpdate] = []
        self.resident: set[tuple[str, str, str]] = set()
        self.known = False
        self.down = False

    async def tell_residency(self, update: ResidencyUpdate) -> ResidencyAnswer:
        if self.down:
            raise Unreachable("POST residency: cannot connect")
        self.updates.append(update)
        known, self.known = self.known, True
        if update.clear:
            self.resident.clear()
        for group in update.remove:
            self.resident -= {(group.scope_id, group.medium, k) for k in group.block_keys}
        for group in update.add:
            self.resident |= {(group.scope_id, group.medium, k) for k in group.block_keys}
        return ResidencyAnswer(update.ttl_ms, known, len(self.resident))

    def keys(self, medium: str = "GPU") -> set[str]:
        return {k for s, m, k in self.resident if m == medium and s == SCOPE}


def stored(first: int, count: int, parent: int | None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + count)),
        "parent_block_hash": parent,
        "token_ids": TOKENS[(first - 1) * B : (first - 1 + count) * B],
        "block_size": B,
        "medium": "GPU",
    }


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Publisher, Index, EventBridge]]:
    context = zmq.asyncio.Context()
    publisher = Publisher(context, tmp_path)
    index = Index()
    service = EventBridge(
        Bridge({"": KEY}, COMPAT, B),
        index,
        POD,
        endpoint=publisher.endpoint,
        replay_endpoint=publisher.replay_endpoint,
        ttl_ms=3_000,
        flush_ms=5,
        replay_timeout_s=1.0,
        context=context,
    )
    running = asyncio.create_task(service.run())
    # The SUB socket joins a moment after connecting: wait for a first message.
    for _ in range(200):
        await publisher.send({"type": "AllBlocksCleared"})
        await asyncio.sleep(0.01)
        if service.expected is not None:
            break
    assert service.expected is not None, "the subscriber never joined"
    yield publisher, index, service
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    await publisher.close()
    context.term()


async def until(condition: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the time")


async def test_events_become_residency_at_the_index(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    publisher, index, service = rig
    await publisher.send(stored(1, 2, None))
    await publisher.send(stored(3, 1, 2))
    await until(lambda: index.keys() == set(KEYS[:3]))
    assert index.updates[0].clear  # a new bridge voids what an old one told
    await publisher.send({"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"})
    await until(lambda: index.keys() == set(KEYS[:2]))
    await publisher.send({"type": "AllBlocksCleared"})
    await until(lambda: not index.resident)
    assert service.bridge.counters.cleared >= 1
    assert b"kvstore_events_blocks_stored_total 3.0" in service.metrics()
    assert b"kvstore_events_lag_seconds_count" in service.metrics()


async def test_a_gap_is_filled_from_the_replay_socket(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    publisher, index, service = rig
    await publisher.send(stored(1, 1, None))
    await publisher.send(stored(2, 1, 1), drop=True)  # the SUB socket missed it
    await publisher.send(stored(3, 1, 2))
    await until(lambda: index.keys() == set(KEYS[:3]))
    assert service.bridge.counters.gaps_replayed == 1 and publisher.replays >= 1
    assert service.bridge.counters.gaps_lost == 0


async def test_a_gap_the_replay_cannot_fill_voids_the_residency(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    publisher, index, service = rig
    await publisher.send(stored(1, 2, None))
    await until(lambda: index.keys() == set(KEYS[:2]))
    # A removal lost, and gone from the replay buffer too.
    await publisher.send({"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}, drop=True)
    publisher.buffer.clear()
    await publisher.send(stored(4, 1, None))
    await until(lambda: service.bridge.counters.gaps_lost == 1)
    # What the bridge could not follow is withdrawn; what came after, told.
    await until(lambda: KEYS[1] not in index.keys())
    assert any(u.clear for u in index.updates[1:])


async def test_an_engine_restart_voids_its_residency(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    publisher, index, service = rig
    await publisher.send(stored(1, 3, None))
    await until(lambda: index.keys() == set(KEYS[:3]))
    publisher.restart()  # numbers from 0 again, its cache empty
    await publisher.send(stored(1, 1, None))
    await until(lambda: service.bridge.counters.restarts == 1)
    await until(lambda: index.keys() == {KEYS[0]})


async def test_an_index_that_forgot_is_told_everything_and_an_outage_waits(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    publisher, index, service = rig
    await publisher.send(stored(1, 2, None))
    await until(lambda: index.keys() == set(KEYS[:2]))
    # The IS restarts (it knows nothing), then the next update reaches it.
    index.resident.clear()
    index.known = False
    await publisher.send(stored(3, 1, 2))
    await until(lambda: index.keys() == set(KEYS[:3]))
    # Unreachable for a while: the changes wait, then arrive merged.
    index.down = True
    await publisher.send(stored(4, 1, 3))
    await publisher.send({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    await until(lambda: service.update_failures >= 1)
    assert not service.ready()
    index.down = False
    await until(lambda: index.keys() == set(KEYS[1:4]))
    assert service.ready()


async def test_a_restart_the_subscriber_missed_is_told_by_the_replay(
    rig: tuple[Publisher, Index, EventBridge],
) -> None:
    # The new engine's first messages were dropped, and it numbered past
    # where the old one stopped: the sequence alone looks like a gap. The
    # replay, from messages the bridge saw, shows other payloads under
    # those numbers: another engine. Its own history is told, the old void.
    publisher, index, service = rig
    await publisher.send(stored(1, 3, None))
    await until(lambda: index.keys() == set(KEYS[:3]))
    expected = service.expected
    assert expected is not None
    publisher.restart()
    for _ in range(expected + 1):
        await publisher.send(stored(5, 1, None), drop=True)
    await publisher.send(stored(6, 1, 5))
    await until(lambda: service.bridge.counters.restarts == 1)
    new = [k.hex() for k in block_keys(KEY, bytes.fromhex(COMPAT), TOKENS[4 * B : 6 * B], B)]
    await until(lambda: index.keys() == set(new))
    assert service.bridge.counters.gaps_replayed == 0
