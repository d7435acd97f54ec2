"""Controller rules on every state, memory and a real Redis: epochs, expiry,
the sleeping handshake, checkpoints (S1-S6, CK2, CK7)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvstore.controller.redis_state import RedisControllerState
from kvstore.controller.state import ControllerState, MemoryControllerState, SleepPolicy
from kvstore.protocol.control import InstanceStatus, Sampler, SessionCheckpoint
from kvstore.protocol.problems import (
    Conflict,
    Forbidden,
    InsufficientStorage,
    InvalidState,
    NotFound,
    StaleEpoch,
)

II1, II2 = "https://ii1.test/kvsp/", "https://ii2.test/kvsp/"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def status(instance: str = II1, epoch: int = 10, **changes: object) -> InstanceStatus:
    base = InstanceStatus(
        instance=instance,
        epoch=epoch,
        state="active",
        running=4,
        queued=1,
        batch_size=32,
        kv_utilization=0.5,
        prefill_tokens_per_s=40000,
        decode_tokens_per_s=3000,
        ttl_ms=3000,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


Make = Callable[..., ControllerState]


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Make]:
    """A factory of states of one kind; each test's Redis states share nothing."""
    made: list[ControllerState] = []
    prefix = f"t{uuid.uuid4().hex[:8]}:"

    def factory(clock: Clock | None = None, idle_for_s: float = 10.0, **rules: Any) -> Any:
        rules.setdefault("sleep_policy", SleepPolicy(idle_for_s=idle_for_s))
        if request.param == "memory":
            made.append(MemoryControllerState(clock=clock or Clock(), **rules))
        else:
            cluster = request.param == "redis-cluster"
            server: Any = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
            made.append(
                RedisControllerState(
                    server.url, prefix, clock=clock or Clock(), cluster=cluster, **rules
                )
            )
        return made[-1]

    yield factory
    for state in made:
        await state.close()


async def test_lower_epoch_is_stale(make: Make) -> None:
    # S2: the PC discards records with a lower epoch than it has seen.
    pc = make()
    assert await pc.put_status(status(epoch=10)) == "active"
    assert await pc.put_status(status(epoch=11)) == "active"
    with pytest.raises(StaleEpoch) as info:
        await pc.put_status(status(epoch=10))
    assert info.value.status == 409
    assert info.value.suffix == "kvsp-stale-epoch"


async def test_expired_record_means_failed(make: Make) -> None:
    # S1: an instance whose record expired is failed; S4: not active for work.
    clock = Clock()
    pc = make(clock)
    await pc.put_status(status(ttl_ms=3000))
    assert await pc.state_of(II1) == "active" and [s.instance for s in await pc.active()] == [II1]
    clock.now += 3.0
    assert await pc.state_of(II1) == "failed"
    assert await pc.active() == [] and await pc.failed() == [II1]
    with pytest.raises(InvalidState):
        await pc.require_active(II1)


async def test_sleeping_handshake(make: Make) -> None:
    # S3: accepted only after the configured idle time; refused otherwise.
    clock = Clock()
    pc = make(clock, idle_for_s=10)
    idle = status(running=0, queued=0)
    assert await pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "active"
    clock.now += 5
    assert await pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "active"
    clock.now += 6
    assert await pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "draining"
    assert await pc.active() == []  # S4: draining gets no new work


async def test_busy_instance_resets_its_idle_time(make: Make) -> None:
    clock = Clock()
    pc = make(clock, idle_for_s=10)
    await pc.put_status(status(running=0, queued=0))
    clock.now += 8
    await pc.put_status(status(running=3))  # busy again
    clock.now += 8
    asked = status(running=0, queued=0, requested_state="sleeping")
    assert await pc.put_status(asked) == "active"


async def test_draining_then_sleeping_until_the_pc_wakes_it(make: Make) -> None:
    # S5: draining reports sleeping when done; S6: only the PC wakes it.
    clock = Clock()
    pc = make(clock, idle_for_s=0)
    await pc.put_status(status(running=0, queued=0, requested_state="sleeping"))
    assert await pc.state_of(II1) == "draining"
    assert await pc.put_status(status(running=0, queued=0, state="sleeping")) == "sleeping"
    assert await pc.put_status(status(running=0, queued=0, state="active")) == "sleeping"
    await pc.set_state(II1, "active")  # the PC's PUT state
    assert await pc.state_of(II1) == "active"


async def test_restart_does_not_wake_a_sleeping_instance(make: Make) -> None:
    # S6: a restart (higher epoch) of an instance the PC put to sleep or was
    # draining keeps it asleep; only the PC wakes it. Others start afresh.
    pc = make(idle_for_s=0)
    await pc.put_status(status(running=0, queued=0, requested_state="sleeping"))
    assert await pc.put_status(status(epoch=11)) == "sleeping"
    assert await pc.active() == []
    await pc.set_state(II1, "active")
    assert await pc.put_status(status(epoch=12)) == "active"


def checkpoint(session: str, epoch: int, offset: int) -> SessionCheckpoint:
    return SessionCheckpoint(
        session=session,
        epoch=epoch,
        compat_id="c" * 64,
        scope_id="d" * 32,
        prompt_blocks=(),
        prompt_tail=(1, 2),
        generated=tuple(range(offset)),
        output_offset=offset,
        sampler=Sampler("greedy", seed=0, step=offset, deterministic=True),
    )


async def test_checkpoints_keep_the_highest_offset_of_the_current_epoch(make: Make) -> None:
    # CK2
    pc = make()
    session = str(uuid.uuid4())
    await pc.assign(session, II1, epoch=1)
    await pc.put_checkpoint(checkpoint(session, 1, 8), II1)
    await pc.put_checkpoint(checkpoint(session, 1, 4), II1)  # late, lower: kept the higher
    kept = (await pc.session(session)).checkpoint
    assert kept is not None and kept.output_offset == 8


async def test_resumed_session_fences_the_old_instance(make: Make) -> None:
    # CK7, SEC5: after the PC moved the session (epoch 2), the old instance's
    # messages are refused, whatever offset they carry.
    pc = make()
    session = str(uuid.uuid4())
    await pc.assign(session, II1, epoch=1)
    await pc.put_checkpoint(checkpoint(session, 1, 8), II1)
    await pc.assign(session, II2, epoch=2)
    with pytest.raises(StaleEpoch):
        await pc.put_checkpoint(checkpoint(session, 1, 64), II1)
    with pytest.raises(Forbidden):
        await pc.put_checkpoint(checkpoint(session, 2, 64), II1)  # right epoch, wrong owner
    await pc.put_checkpoint(checkpoint(session, 2, 12), II2)
    assert (await pc.session(session)).checkpoint.output_offset == 12  # type: ignore[union-attr]
    with pytest.raises(StaleEpoch):
        await pc.assign(session, II1, epoch=2)  # epochs only go up
    with pytest.raises(Conflict, match="never assigned"):  # newer, not stale
        await pc.put_checkpoint(checkpoint(session, 3, 1), II2)  # an epoch never assigned
    with pytest.raises(Conflict, match="never assigned"):  # a first checkpoint, likewise
        await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 2, 1), II2)


async def test_status_source_for_the_index_sees_active_instances_only(make: Make) -> None:
    clock = Clock()
    pc = make(clock, idle_for_s=0)
    await pc.put_status(status(II1))
    await pc.put_status(status(II2, running=0, queued=0, requested_state="sleeping"))
    assert list(await pc.statuses([II1, II2, "https://unknown.test/"])) == [II1]  # II2 drains
    clock.now += 10
    assert await pc.statuses([II1]) == {}  # expired


async def test_first_checkpoint_registers_at_epoch_one_only(make: Make) -> None:
    # An instance cannot claim an unknown session at an epoch the PC never
    # handed out (it would block every later resume).
    pc = make()
    session = str(uuid.uuid4())
    with pytest.raises(Conflict):  # never assigned: newer than current, not stale
        await pc.put_checkpoint(checkpoint(session, 2**53 - 1, 1), II2)
    await pc.put_checkpoint(checkpoint(session, 1, 1), II1)
    await pc.assign(session, II2, epoch=2)  # the PC can still move it


async def test_sessions_are_bounded(make: Make) -> None:
    pc = make(max_sessions=5, max_sessions_per_owner=3)
    for _ in range(3):
        await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II1)
    with pytest.raises(InsufficientStorage):
        await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II1)
    for _ in range(2):
        await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II2)
    with pytest.raises(InsufficientStorage) as info:
        await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II2)
    assert info.value.status == 507


async def test_sessions_of_follow_their_owner(make: Make) -> None:
    # CK5 needs the sessions of a failed instance: they move with the epoch.
    pc = make()
    one, two = str(uuid.uuid4()), str(uuid.uuid4())
    await pc.assign(one, II1)
    await pc.assign(two, II1)
    assert sorted(s.session for s in await pc.sessions_of(II1)) == sorted([one, two])
    await pc.assign(one, II2, epoch=2)
    assert [s.session for s in await pc.sessions_of(II1)] == [two]
    assert [(s.session, s.epoch) for s in await pc.sessions_of(II2)] == [(one, 2)]


# --- shared state in Redis -------------------------------------------------


async def test_a_second_pc_continues_from_redis(redis_server: Any) -> None:
    # A restarted or second PC sees the epochs, states and sessions (issue 6).
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    first = RedisControllerState(redis_server.url, prefix)
    second = RedisControllerState(redis_server.url, prefix)
    try:
        await first.put_status(status(epoch=12))
        session = str(uuid.uuid4())
        await first.put_checkpoint(checkpoint(session, 1, 5), II1)
        with pytest.raises(StaleEpoch):
            await second.put_status(status(epoch=11))  # S2 across processes
        assert [s.instance for s in await second.active()] == [II1]
        kept = (await second.session(session)).checkpoint
        assert kept is not None and kept.output_offset == 5
        with pytest.raises(Forbidden):
            await second.put_checkpoint(checkpoint(session, 1, 9), II2)
    finally:
        await first.close()
        await second.close()


async def test_concurrent_reports_keep_the_highest_epoch(redis_server: Any) -> None:
    # S2 under races: PCs handling reports of one instance at once never let
    # a lower epoch overwrite a higher one (compare-and-set, retried).
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    pcs = [RedisControllerState(redis_server.url, prefix) for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(pcs[n % 4].put_status(status(epoch=n)) for n in range(1, 41)),
            return_exceptions=True,
        )
        assert all(r == "active" or isinstance(r, StaleEpoch) for r in results)
        entry, _ = await pcs[0]._instance(II1)
        assert entry is not None and entry.highest_epoch == 40
    finally:
        for pc in pcs:
            await pc.close()


async def test_redis_clock_expires_records(redis_server: Any) -> None:
    # S1 on the Redis server's clock, the one all PC and IS processes share.
    pc = RedisControllerState(redis_server.url, f"t{uuid.uuid4().hex[:8]}:")
    try:
        await pc.put_status(status(ttl_ms=200))
        assert await pc.state_of(II1) == "active"
        await asyncio.sleep(0.3)
        assert await pc.state_of(II1) == "failed"
        assert await pc.failed() == [II1]
    finally:
        await pc.close()


async def test_unreachable_redis_is_unavailable() -> None:
    from kvstore.storage.errors import TierUnavailable

    pc = RedisControllerState("redis://127.0.0.1:1/0", timeout_s=0.5)
    with pytest.raises(TierUnavailable) as info:
        await pc.put_status(status())
    assert info.value.status == 503
    await pc.close()


async def test_an_ended_session_stays_ended(make: Make) -> None:
    # CK7: after its owner ended the session, the instance fenced off by the
    # migration cannot start it again at epoch 1 (it would be moved twice).
    pc = make()
    session = str(uuid.uuid4())
    await pc.put_checkpoint(checkpoint(session, 1, 3), II1)
    await pc.assign(session, II2, epoch=2)  # moved
    await pc.end_session(session, II2)
    with pytest.raises(StaleEpoch):
        await pc.put_checkpoint(checkpoint(session, 1, 9), II1)
    with pytest.raises(StaleEpoch):
        await pc.assign(session, II1)
    assert await pc.sessions_of(II1) == [] and await pc.sessions_of(II2) == []
    await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II1)  # new ones are fine
    # Its tombstone tells where it ended (a front end that lost the stream).
    last = await pc.ended(session)
    assert (last.owner, last.epoch) == (II2, 2)
    with pytest.raises(NotFound):
        await pc.ended(str(uuid.uuid4()))


async def test_a_restart_is_remembered_until_its_sessions_moved(make: Make) -> None:
    # S2, CK5: a higher epoch marks the instance restarted; sessions carry
    # the owner's epoch they were taken on at.
    pc = make()
    session = str(uuid.uuid4())
    await pc.put_status(status(epoch=10))
    await pc.put_checkpoint(checkpoint(session, 1, 1), II1)
    assert await pc.restarted() == []
    await pc.put_status(status(epoch=11))
    await pc.put_status(status(epoch=11))  # a later report keeps the mark
    assert await pc.restarted() == [(II1, 11)]
    assert (await pc.session(session)).owner_epoch == 10
    await pc.sessions_moved(II1, 10)  # an older epoch: still to do
    assert await pc.restarted() == [(II1, 11)]
    await pc.sessions_moved(II1, 11)
    assert await pc.restarted() == []
