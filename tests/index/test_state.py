"""The IndexState contract, on memory and on a real Redis (P2, L1, OPS3)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvstore.index.redis_state import RedisState
from kvstore.index.state import IndexFull, IndexState, MemoryState
from kvstore.protocol.records import ReplicaRecord, Residency
from kvstore.protocol.wire import role_id

COMPAT = hashlib.sha256(b"c").hexdigest()
SCOPE = "a" * 32
OTHER_SCOPE = "b" * 32
H1, H2 = "https://h1.test/kvsp/", "https://h2.test/kvsp/"


def key(n: int) -> str:
    return hashlib.sha256(f"k{n}".encode()).hexdigest()


def record(n: int, holder: str = H1, scope: str = SCOPE, ttl_ms: int = 60_000) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=key(n), compat_id=COMPAT, scope_id=scope, holder=holder, codec=1,
        size=2 << 20, digest="sha-256:" + "0" * 64,
        residency=(Residency("host", 0, 31),), ttl_ms=ttl_ms,
    )  # fmt: skip


def parsed(found: list[list[bytes]]) -> list[list[ReplicaRecord]]:
    return [[ReplicaRecord.from_json(json.loads(raw)) for raw in group] for group in found]


@pytest.fixture(params=["memory", "redis", "redis-cluster-mode"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[IndexState]:
    if request.param == "memory":
        yield MemoryState()
        return
    server: Any = request.getfixturevalue("redis_server")
    s = RedisState(
        url=server.url,
        prefix=f"t{uuid.uuid4().hex[:8]}:",
        cluster=request.param == "redis-cluster-mode",
    )
    yield s
    await s.close()


async def test_publish_and_lookup(state: IndexState) -> None:
    # L1: matched counts leading keys with a replica; each lists its records.
    for n in range(3):
        await state.put(record(n), 60_000)
    await state.put(record(1, holder=H2), 60_000)
    found = parsed(await state.lookup(SCOPE, COMPAT, [key(0), key(1), key(2)]))
    assert [len(g) for g in found] == [1, 2, 1]
    assert {r.holder for r in found[1]} == {H1, H2}
    assert found[0][0] == record(0)


async def test_lookup_stops_at_the_first_miss(state: IndexState) -> None:
    # L1: keys after a miss are not matched even when they have replicas.
    for n in (0, 1, 3, 4):
        await state.put(record(n), 60_000)
    found = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(5)])
    assert len(found) == 2
    assert await state.lookup(SCOPE, COMPAT, [key(2), key(3)]) == []


async def test_other_scopes_and_compat_ids_are_not_returned(state: IndexState) -> None:
    # L3 at the state level: records of another scope never match.
    await state.put(record(0, scope=OTHER_SCOPE), 60_000)
    assert await state.lookup(SCOPE, COMPAT, [key(0)]) == []
    assert await state.lookup(OTHER_SCOPE, "0" * 64, [key(0)]) == []
    assert len(await state.lookup(OTHER_SCOPE, COMPAT, [key(0)])) == 1


async def test_refresh_is_idempotent_and_withdraw_removes(state: IndexState) -> None:
    # P2: the same PUT refreshes; DELETE withdraws.
    await state.put(record(0), 60_000)
    await state.put(record(0), 60_000)
    assert [len(g) for g in await state.lookup(SCOPE, COMPAT, [key(0)])] == [1]
    assert await state.count() == 1
    assert await state.delete(role_id(H1), key(0)) is True
    assert await state.delete(role_id(H1), key(0)) is False
    assert await state.lookup(SCOPE, COMPAT, [key(0)]) == []


async def test_scope_of_a_record(state: IndexState) -> None:
    await state.put(record(0, scope=OTHER_SCOPE), 60_000)
    assert await state.scope_of(role_id(H1), key(0)) == OTHER_SCOPE
    assert await state.scope_of(role_id(H2), key(0)) is None
    assert await state.scope_of(role_id(H1), key(1)) is None


async def test_records_expire(state: IndexState) -> None:
    # P2: a record is gone after its TTL (a dead holder's records vanish).
    await state.put(record(0), 150)
    await state.put(record(0, holder=H2), 60_000)
    await asyncio.sleep(0.3)
    found = parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))
    assert [r.holder for r in found[0]] == [H2]
    await state.put(record(1), 100)
    await asyncio.sleep(0.25)
    assert await state.lookup(SCOPE, COMPAT, [key(1)]) == []


async def test_long_lookup_crosses_batches(state: IndexState) -> None:
    for n in range(1200):
        await state.put(record(n), 60_000)
    found = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(1300)])
    assert len(found) == 1200


async def test_memory_state_is_bounded() -> None:
    state = MemoryState(max_records=2)
    await state.put(record(0), 60_000)
    await state.put(record(1), 60_000)
    await state.put(record(1), 60_000)  # a refresh is not a new record
    with pytest.raises(IndexFull) as info:
        await state.put(record(2), 60_000)
    assert info.value.status == 507
    await state.delete(role_id(H1), key(0))
    await state.put(record(2), 60_000)


async def test_memory_cap_sweeps_expired_records_first() -> None:
    now = [0.0]
    state = MemoryState(max_records=1, clock=lambda: now[0])
    await state.put(record(0), 1000)
    now[0] = 2.0
    await state.put(record(1), 1000)  # the expired record made room
    assert await state.count() == 1
