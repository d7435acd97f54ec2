"""The IndexState contract, on memory and on a real Redis (P2, L1, OPS3)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvstore.index import state as state_module
from kvstore.index.redis_state import RedisState
from kvstore.index.replicated import ReplicatedState
from kvstore.index.state import Hits, IndexFull, IndexState, MemoryState
from kvstore.native import PyKeyTable, py_walk
from kvstore.protocol.keys import PackedKeys
from kvstore.protocol.placement import ReplicaShape, decode_shapes
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
        block_key=key(n),
        compat_id=COMPAT,
        scope_id=scope,
        holder=holder,
        codec=1,
        size=2 << 20,
        digest="sha-256:" + "0" * 64,
        residency=(Residency("host", 0, 31),),
        ttl_ms=ttl_ms,
    )


def parsed(found: Hits) -> list[list[ReplicaRecord]]:
    groups = found.records()
    assert len(groups) == found.matched
    return [[ReplicaRecord.from_json(r) for r in group] for group in groups]


@pytest.fixture(params=["memory", "memory-python", "redis", "redis-cluster", "replicated"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[IndexState]:
    if request.param.startswith("memory"):
        if request.param == "memory-python":  # the loops of kvstore.native in Python
            request.getfixturevalue("monkeypatch").setattr(state_module, "walk", py_walk)
            yield MemoryState(_groups=PyKeyTable())  # type: ignore[arg-type]
            return
        yield MemoryState()
        return
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    if request.param == "replicated":  # memory, followed through a log in Redis
        replicated = ReplicatedState(request.getfixturevalue("redis_server").url, prefix)
        yield replicated
        await replicated.close()
        return
    cluster = request.param == "redis-cluster"  # a real one: 3 masters, 3 replicas
    server: Any = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    s = RedisState(url=server.url, prefix=prefix, cluster=cluster)
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
    assert found.matched == 2 and len(parsed(found)) == 2
    assert (await state.lookup(SCOPE, COMPAT, [key(2), key(3)])).matched == 0


async def test_other_scopes_and_compat_ids_are_not_returned(state: IndexState) -> None:
    # L3 at the state level: records of another scope never match.
    await state.put(record(0, scope=OTHER_SCOPE), 60_000)
    assert (await state.lookup(SCOPE, COMPAT, [key(0)])).matched == 0
    assert (await state.lookup(OTHER_SCOPE, "0" * 64, [key(0)])).matched == 0
    assert (await state.lookup(OTHER_SCOPE, COMPAT, [key(0)])).matched == 1
    # Asked again for the first scope after the other was answered (and cached).
    assert (await state.lookup(SCOPE, COMPAT, [key(0)])).chunks == []


async def test_refresh_is_idempotent_and_withdraw_removes(state: IndexState) -> None:
    # P2: the same PUT refreshes; DELETE withdraws.
    await state.put(record(0), 60_000)
    await state.put(record(0), 60_000)
    assert [len(g) for g in parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))] == [1]
    assert await state.count() == 1
    assert await state.delete(role_id(H1), key(0)) is True
    assert await state.delete(role_id(H1), key(0)) is False
    assert (await state.lookup(SCOPE, COMPAT, [key(0)])).matched == 0


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
    assert (await state.lookup(SCOPE, COMPAT, [key(1)])).matched == 0


async def test_long_lookup_crosses_batches(state: IndexState) -> None:
    for n in range(1200):
        await state.put(record(n), 60_000)
    found = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(1300)])
    assert found.matched == 1200
    assert [r[0].block_key for r in parsed(found)] == [key(n) for n in range(1200)]


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


async def test_answers_follow_changes_after_a_lookup(state: IndexState) -> None:
    # L1, P2: what a lookup answered (and a state may keep joined) changes
    # with every later publish, refresh, withdrawal and expiry.
    await state.put(record(0), 60_000)
    assert [r.holder for r in parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))[0]] == [H1]
    await state.put(record(0, holder=H2, ttl_ms=200), 200)
    found = parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))[0]
    assert sorted(r.holder for r in found) == [H1, H2]
    bigger = dataclasses.replace(record(0), size=4 << 20)
    await state.put(bigger, 60_000)
    found = parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))[0]
    assert bigger in found and record(0) not in found
    await asyncio.sleep(0.3)  # H2's record expires
    assert parsed(await state.lookup(SCOPE, COMPAT, [key(0)])) == [[bigger]]
    await state.delete(role_id(H1), key(0))
    assert (await state.lookup(SCOPE, COMPAT, [key(0)])).matched == 0


async def test_lookup_with_shapes(state: IndexState) -> None:
    # PL1: beside the records, the shapes placement needs, one array per key.
    for n in range(3):
        await state.put(record(n), 60_000)
    await state.put(record(1, holder=H2), 60_000)
    plain = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(4)])
    assert plain.shapes is None
    found = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(4)], shapes=True)
    assert found.shapes is not None and len(found.shapes) == found.matched == 3
    for shapes, records in zip(found.shapes, parsed(found), strict=True):
        assert decode_shapes(shapes) == tuple(ReplicaShape.of(r) for r in records)
    assert (await state.lookup(SCOPE, COMPAT, [key(9)], shapes=True)).shapes == []


async def test_one_key_under_two_scopes(state: IndexState) -> None:
    # L3: records of one block key under two scopes (a misbehaving holder, or
    # a collision) are answered each to its own scope, also after changes.
    await state.put(record(0, holder=H1), 60_000)
    await state.put(record(0, holder=H2, scope=OTHER_SCOPE), 60_000)
    assert parsed(await state.lookup(SCOPE, COMPAT, [key(0)])) == [[record(0, holder=H1)]]
    other = parsed(await state.lookup(OTHER_SCOPE, COMPAT, [key(0)]))
    assert other == [[record(0, holder=H2, scope=OTHER_SCOPE)]]
    # H1 republishes under the other scope: nothing is left under the first.
    await state.put(record(0, holder=H1, scope=OTHER_SCOPE), 60_000)
    assert (await state.lookup(SCOPE, COMPAT, [key(0)])).matched == 0
    other = parsed(await state.lookup(OTHER_SCOPE, COMPAT, [key(0)]))
    assert sorted(r.holder for r in other[0]) == [H1, H2]
    await state.delete(role_id(H2), key(0))
    assert parsed(await state.lookup(OTHER_SCOPE, COMPAT, [key(0)])) == [
        [record(0, holder=H1, scope=OTHER_SCOPE)]
    ]


async def test_expired_record_inside_a_long_lookup(state: IndexState) -> None:
    # L1, P2: a record expiring among many keys leaves its key to the
    # surviving replica, and a key with none left ends the match there.
    for n in range(700):
        await state.put(record(n), 60_000)
    await state.put(record(600, holder=H2), 60_000)
    await state.put(record(600, ttl_ms=150), 150)  # H1's copy of key 600 expires
    await state.put(record(650, ttl_ms=150), 150)  # the only copy of key 650 expires
    await asyncio.sleep(0.3)
    found = await state.lookup(SCOPE, COMPAT, [key(n) for n in range(700)], shapes=True)
    assert found.matched == 650 and found.shapes is not None and len(found.shapes) == 650
    groups = parsed(found)
    assert [r.holder for r in groups[600]] == [H2]
    assert [r.block_key for r in groups[649]] == [key(649)]


async def test_lookup_without_records(state: IndexState) -> None:
    # A shapes-only lookup (ours) moves no record octets.
    for n in range(3):
        await state.put(record(n), 60_000)
    found = await state.lookup(
        SCOPE, COMPAT, [key(n) for n in range(4)], shapes=True, records=False
    )
    assert found.matched == 3 and found.chunks == []
    assert found.shapes is not None and len(found.shapes) == 3


async def test_packed_keys_answer_as_their_hex(state: IndexState) -> None:
    # POST place's packed keys (PackedKeys) reach the state as they came: a
    # memory state walks their octets, the others read them as hex strings;
    # every answer is the one the same keys as strings get, also past a
    # change, an expiry and a key never published.
    for n in range(40):
        await state.put(record(n), 60_000)
    # Short-lived copies: long enough for four lookups on a loaded machine
    # (150 ms was not, under CI's load), short enough to wait out.
    await state.put(record(20, holder=H2, ttl_ms=1000), 1000)
    await state.put(record(30, ttl_ms=1000), 1000)  # key 30's only copy expires
    names = [key(n) for n in range(45)]
    packed = PackedKeys(b"".join(bytes.fromhex(k) for k in names))
    for _ in range(2):  # the second time from what the first lookup cached
        as_hex = await state.lookup(SCOPE, COMPAT, names, shapes=True)
        as_packed = await state.lookup(SCOPE, COMPAT, packed, shapes=True)
        assert as_packed.matched == as_hex.matched == 40
        assert as_packed.shapes == as_hex.shapes and parsed(as_packed) == parsed(as_hex)
    await asyncio.sleep(1.1)
    for _ in range(2):
        as_packed = await state.lookup(SCOPE, COMPAT, packed, shapes=True)
        assert as_packed.matched == 30
        assert [r.holder for r in parsed(as_packed)[20]] == [H1]
