"""Controller rules: epochs, expiry, the sleeping handshake, checkpoints (S1-S6, CK2, CK7)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvstore.controller.state import ControllerState, SleepPolicy
from kvstore.protocol.control import InstanceStatus, Sampler, SessionCheckpoint
from kvstore.protocol.problems import Forbidden, InvalidState, StaleEpoch

II1, II2 = "https://ii1.test/kvsp/", "https://ii2.test/kvsp/"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def status(instance: str = II1, epoch: int = 10, **changes: object) -> InstanceStatus:
    base = InstanceStatus(
        instance=instance, epoch=epoch, state="active", running=4, queued=1, batch_size=32,
        kv_utilization=0.5, prefill_tokens_per_s=40000, decode_tokens_per_s=3000, ttl_ms=3000,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def state(clock: Clock | None = None, idle_for_s: float = 10.0) -> ControllerState:
    return ControllerState(SleepPolicy(idle_for_s=idle_for_s), clock=clock or Clock())


def test_lower_epoch_is_stale() -> None:
    # S2: the PC discards records with a lower epoch than it has seen.
    pc = state()
    assert pc.put_status(status(epoch=10)) == "active"
    assert pc.put_status(status(epoch=11)) == "active"
    with pytest.raises(StaleEpoch) as info:
        pc.put_status(status(epoch=10))
    assert info.value.status == 409
    assert info.value.suffix == "kvsp-stale-epoch"


def test_expired_record_means_failed() -> None:
    # S1: an instance whose record expired is failed; S4: not active for work.
    clock = Clock()
    pc = state(clock)
    pc.put_status(status(ttl_ms=3000))
    assert pc.state_of(II1) == "active" and [s.instance for s in pc.active()] == [II1]
    clock.now += 3.0
    assert pc.state_of(II1) == "failed"
    assert pc.active() == [] and pc.failed() == [II1]
    with pytest.raises(InvalidState):
        pc.require_active(II1)


def test_sleeping_handshake() -> None:
    # S3: accepted only after the configured idle time; refused otherwise.
    clock = Clock()
    pc = state(clock, idle_for_s=10)
    idle = status(running=0, queued=0)
    assert pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "active"
    clock.now += 5
    assert pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "active"
    clock.now += 6
    assert pc.put_status(dataclasses.replace(idle, requested_state="sleeping")) == "draining"
    assert pc.active() == []  # S4: draining gets no new work


def test_busy_instance_resets_its_idle_time() -> None:
    clock = Clock()
    pc = state(clock, idle_for_s=10)
    pc.put_status(status(running=0, queued=0))
    clock.now += 8
    pc.put_status(status(running=3))  # busy again
    clock.now += 8
    asked = status(running=0, queued=0, requested_state="sleeping")
    assert pc.put_status(asked) == "active"


def test_draining_then_sleeping_until_the_pc_wakes_it() -> None:
    # S5: draining reports sleeping when done; S6: only the PC wakes it.
    clock = Clock()
    pc = state(clock, idle_for_s=0)
    pc.put_status(status(running=0, queued=0, requested_state="sleeping"))
    assert pc.state_of(II1) == "draining"
    assert pc.put_status(status(running=0, queued=0, state="sleeping")) == "sleeping"
    assert pc.put_status(status(running=0, queued=0, state="active")) == "sleeping"
    pc.set_state(II1, "active")  # the PC's PUT state
    assert pc.state_of(II1) == "active"


def test_restart_does_not_wake_a_sleeping_instance() -> None:
    # S6: a restart (higher epoch) of an instance the PC put to sleep or was
    # draining keeps it asleep; only the PC wakes it. Others start afresh.
    pc = state(idle_for_s=0)
    pc.put_status(status(running=0, queued=0, requested_state="sleeping"))
    assert pc.put_status(status(epoch=11)) == "sleeping"
    assert pc.active() == []
    pc.set_state(II1, "active")
    assert pc.put_status(status(epoch=12)) == "active"


def checkpoint(session: str, epoch: int, offset: int) -> SessionCheckpoint:
    return SessionCheckpoint(
        session=session, epoch=epoch, compat_id="c" * 64, scope_id="d" * 32,
        prompt_blocks=(), prompt_tail=(1, 2), generated=tuple(range(offset)),
        output_offset=offset,
        sampler=Sampler("greedy", seed=0, step=offset, deterministic=True),
    )  # fmt: skip


def test_checkpoints_keep_the_highest_offset_of_the_current_epoch() -> None:
    # CK2
    pc = state()
    session = str(uuid.uuid4())
    pc.assign(session, II1, epoch=1)
    pc.put_checkpoint(checkpoint(session, 1, 8), II1)
    pc.put_checkpoint(checkpoint(session, 1, 4), II1)  # late, lower: kept the higher
    assert pc.sessions[session].checkpoint is not None
    assert pc.sessions[session].checkpoint.output_offset == 8


def test_resumed_session_fences_the_old_instance() -> None:
    # CK7, SEC5: after the PC moved the session (epoch 2), the old instance's
    # messages are refused, whatever offset they carry.
    pc = state()
    session = str(uuid.uuid4())
    pc.assign(session, II1, epoch=1)
    pc.put_checkpoint(checkpoint(session, 1, 8), II1)
    pc.assign(session, II2, epoch=2)
    with pytest.raises(StaleEpoch):
        pc.put_checkpoint(checkpoint(session, 1, 64), II1)
    with pytest.raises(Forbidden):
        pc.put_checkpoint(checkpoint(session, 2, 64), II1)  # right epoch, wrong owner
    pc.put_checkpoint(checkpoint(session, 2, 12), II2)
    assert pc.sessions[session].checkpoint.output_offset == 12  # type: ignore[union-attr]
    with pytest.raises(StaleEpoch):
        pc.assign(session, II1, epoch=2)  # epochs only go up
    with pytest.raises(StaleEpoch):
        pc.put_checkpoint(checkpoint(session, 3, 1), II2)  # an epoch never assigned


async def test_status_source_for_the_index_sees_active_instances_only() -> None:
    clock = Clock()
    pc = state(clock, idle_for_s=0)
    pc.put_status(status(II1))
    pc.put_status(status(II2, running=0, queued=0, requested_state="sleeping"))
    assert await pc.status(II1) is not None
    assert await pc.status(II2) is None  # draining
    clock.now += 10
    assert await pc.status(II1) is None  # expired


def test_first_checkpoint_registers_at_epoch_one_only() -> None:
    # An instance cannot claim an unknown session at an epoch the PC never
    # handed out (it would block every later resume).
    pc = state()
    session = str(uuid.uuid4())
    with pytest.raises(StaleEpoch):
        pc.put_checkpoint(checkpoint(session, 2**53 - 1, 1), II2)
    pc.put_checkpoint(checkpoint(session, 1, 1), II1)
    pc.assign(session, II2, epoch=2)  # the PC can still move it


def test_sessions_are_bounded() -> None:
    from kvstore.protocol.problems import InsufficientStorage

    pc = ControllerState(max_sessions=5, max_sessions_per_owner=3)
    for _ in range(3):
        pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II1)
    with pytest.raises(InsufficientStorage):
        pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II1)
    for _ in range(2):
        pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II2)
    with pytest.raises(InsufficientStorage) as info:
        pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), II2)
    assert info.value.status == 507
