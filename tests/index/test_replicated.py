"""The replicated index state (issue 20): every IS process answers from its
own memory and follows the others through a log in Redis Streams. A publish
at one is visible at another within a bounded lag; a process started later
rebuilds what is still within its TTL; concurrent writers converge; with
Redis gone, lookups go on from memory and writes fail (503)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvstore.index.replicated import ReplicatedState
from kvstore.index.state import IndexFull, MemoryState
from kvstore.protocol.wire import role_id
from kvstore.storage.errors import TierUnavailable

from .test_state import COMPAT, H1, H2, SCOPE, key, parsed, record

Factory = Callable[..., ReplicatedState]


@pytest.fixture(params=["redis", "redis-cluster"])
async def states(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """IS processes' states on one log (a fresh prefix per test)."""
    server: Any = request.getfixturevalue(
        "redis_cluster" if request.param == "redis-cluster" else "redis_server"
    )
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    made: list[ReplicatedState] = []

    def make(**options: Any) -> ReplicatedState:
        made.append(
            ReplicatedState(server.url, prefix, cluster=request.param == "redis-cluster", **options)
        )
        return made[-1]

    yield make
    for state in made:
        await state.close()


async def eventually(check: Callable[[], Any], within: float = 3.0) -> float:
    """Seconds until ``check()`` (awaited) is true; fails after ``within``."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {within} s")


async def test_a_publish_at_one_is_visible_at_the_other(states: Factory) -> None:
    a, b = states(), states()
    await b.count()  # b is up (replayed, following) before a publishes
    await a.put(record(0), 60_000)
    assert (await a.lookup(SCOPE, COMPAT, [key(0)])).matched == 1  # at once where taken

    async def at_b() -> bool:
        return (await b.lookup(SCOPE, COMPAT, [key(0)])).matched == 1

    lag = await eventually(at_b)
    assert lag < 1.0, lag
    assert parsed(await b.lookup(SCOPE, COMPAT, [key(0)]))[0][0] == record(0)
    # A withdrawal at b reaches a the same way.
    assert await b.delete(role_id(H1), key(0))

    async def gone_at_a() -> bool:
        return (await a.lookup(SCOPE, COMPAT, [key(0)])).matched == 0

    await eventually(gone_at_a)
    assert not await b.delete(role_id(H1), key(0))  # nothing left to withdraw


async def test_a_process_started_later_rebuilds_what_is_unexpired(states: Factory) -> None:
    a = states()
    for n in range(50):
        await a.put(record(n), 60_000)
    await a.put(record(50), 150)  # expires before the new process starts
    await a.delete(role_id(H1), key(7))
    await asyncio.sleep(0.3)
    c = states()
    assert await c.count() == 49
    found = await c.lookup(SCOPE, COMPAT, [key(n) for n in range(7)])
    assert found.matched == 7
    assert (await c.lookup(SCOPE, COMPAT, [key(7)])).matched == 0
    assert (await c.lookup(SCOPE, COMPAT, [key(50)])).matched == 0
    assert await c.scope_of(role_id(H1), key(3)) == SCOPE


async def test_concurrent_writers_converge(states: Factory) -> None:
    # Each applies the log in its order, its own writes included: whatever
    # each wrote first, both end with the record the log has last.
    a, b = states(), states()
    await asyncio.gather(a.count(), b.count())
    for _ in range(5):
        await asyncio.gather(
            a.put(record(0, ttl_ms=1000), 1000), b.put(record(0, ttl_ms=2000), 2000)
        )
    await a.put(record(0, holder=H2), 60_000)

    async def same() -> bool:
        left = parsed(await a.lookup(SCOPE, COMPAT, [key(0)]))
        right = parsed(await b.lookup(SCOPE, COMPAT, [key(0)]))
        return bool(left) and left == right and len(left[0]) == 2

    await eventually(same)


async def test_with_redis_gone_lookups_go_on_and_writes_fail(own_redis: Any) -> None:
    a = ReplicatedState(own_redis.url, "gone:", timeout_s=0.5)
    try:
        await a.put(record(0), 60_000)
        own_redis.kill()
        assert (await a.lookup(SCOPE, COMPAT, [key(0)])).matched == 1  # from memory
        with pytest.raises(TierUnavailable):
            await a.put(record(1), 60_000)
        # Nothing was applied that the others could not see.
        assert (await a.lookup(SCOPE, COMPAT, [key(1)])).matched == 0
        with pytest.raises(TierUnavailable):
            await a.delete(role_id(H1), key(0))
        assert (await a.lookup(SCOPE, COMPAT, [key(0)])).matched == 1
    finally:
        await a.close()


async def test_a_log_reset_under_a_process_is_read_again(states: Factory) -> None:
    # Redis restarted empty (or a failover to a host whose clock is behind):
    # new entries get IDs behind what a process read. Its own writes are
    # still applied, and it notices others' when idle, reading again.
    from kvstore.index.replicated import PARTITIONS, partition_of

    a, b = states(), states()
    await asyncio.gather(a.count(), b.count())
    ahead = f"{int(time.time() * 1000) + 3_600_000}-0"
    a._last = [ahead] * PARTITIONS
    b._last = [ahead] * PARTITIONS
    await a.put(record(0), 60_000)
    assert (await a.lookup(SCOPE, COMPAT, [key(0)])).matched == 1
    assert a.applied_up_to(partition_of(key(0))) < (int(ahead.split("-")[0]), 0)

    async def at_b() -> bool:
        return (await b.lookup(SCOPE, COMPAT, [key(0)])).matched == 1

    assert await eventually(at_b, within=5.0) < 5.0


async def test_a_full_index_refuses_a_publish_and_acknowledges_nothing_it_dropped(
    states: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two IS processes of unequal capacity on one log: the smaller one skips
    # what it has no room for (and counts it), refuses a new record of its
    # own before it enters the log (507), and a write that lost its room
    # between the check and the log's answer fails rather than be answered.
    big, small = states(), states(max_records=1)
    await small.count()
    await big.put(record(0), 60_000)
    await eventually(lambda: _matched(small, 0))
    await big.put(record(1), 60_000)  # no room at small
    await eventually(lambda: _async(sum(small.skipped) == 1))
    assert (await small.lookup(SCOPE, COMPAT, [key(1)])).matched == 0
    with pytest.raises(IndexFull) as info:
        await small.put(record(2), 60_000)
    assert info.value.status == 507
    await small.put(record(0), 60_000)  # a refresh takes no room
    await asyncio.sleep(0.2)
    assert (await big.lookup(SCOPE, COMPAT, [key(2)])).matched == 0  # never logged
    # The race: the room checked, then gone by the time the entry is read.
    monkeypatch.setattr(MemoryState, "check_room", lambda self, record: None)
    with pytest.raises(IndexFull):
        await small.put(record(3), 60_000)
    await eventually(lambda: _matched(big, 3))  # the others had room


async def _matched(state: ReplicatedState, n: int) -> bool:
    return (await state.lookup(SCOPE, COMPAT, [key(n)])).matched == 1


async def _async(value: bool) -> bool:
    return value


async def test_an_is_host_with_its_clock_off_expires_and_trims_by_redis(
    states: Factory,
) -> None:
    # Time is the Redis clock of the entries' IDs (OPS2: entries carry
    # durations): an IS host an hour ahead neither keeps records alive past
    # their TTL elsewhere, nor trims the log's live entries (MINID) so that
    # a process started later would rebuild nothing.
    ahead = states(wall_clock=lambda: time.time() + 3600)
    other = states(wall_clock=lambda: time.time() - 3600)
    await other.count()
    for n in range(5):
        await ahead.put(record(n), 60_000)
    put_at = time.monotonic()
    await ahead.put(record(5, ttl_ms=2000), 2000)
    await eventually(lambda: _matched(other, 5))
    # Record 5's TTL is over, by any clock but a skewed one.
    await asyncio.sleep(put_at + 2.3 - time.monotonic())
    assert not await _matched(other, 5) and not await _matched(ahead, 5)
    later = states()
    found = await later.lookup(SCOPE, COMPAT, [key(n) for n in range(5)])
    assert found.matched == 5  # nothing live was trimmed
