"""The instance's own state (S3-S6): it changes only by the table of
``kvstore.protocol.lifecycle``, the one the PC applies too; here against a PC
state in this process (its clock injected), no HTTP, no sleeps."""

from __future__ import annotations

import pytest

from kvstore.controller.state import MemoryControllerState, SleepPolicy
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.reporter import Load, StatusReporter
from kvstore.protocol.control import InstanceStatus
from kvstore.protocol.lifecycle import InstanceEvent, InstanceState, InstanceStateError

II = "https://ii.test/kvsp/"
ACTIVE, DRAINING, SLEEPING = InstanceState.ACTIVE, InstanceState.DRAINING, InstanceState.SLEEPING


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class InProcessPC:
    """The PC's status resource without HTTP: its answer is the state it holds."""

    def __init__(self, state: MemoryControllerState) -> None:
        self.state = state

    async def put_status(self, status: InstanceStatus) -> str:
        return (await self.state.put_status(status)).value


def reporter(
    pc: InProcessPC, lifecycle: Lifecycle, load: Load, clock: Clock, epoch: int
) -> StatusReporter:
    made = StatusReporter(II, pc, lifecycle, load, idle_s=5.0, clock=clock)  # type: ignore[arg-type]
    made.epoch = epoch  # S2: a restart is a higher epoch
    return made


def test_pc_changes_are_counted_and_answers_are_not() -> None:
    # A report's answer must not undo a PUT state that came meanwhile: the
    # PC's changes are counted, answers are not.
    lifecycle = Lifecycle()
    lifecycle.answered("draining")
    assert lifecycle.state is DRAINING and lifecycle.changes == 0
    lifecycle.set_by_pc("active")
    assert lifecycle.state is ACTIVE and lifecycle.changes == 1
    lifecycle.state = "draining"  # assigning is the PC's PUT state too
    assert lifecycle.state is DRAINING and lifecycle.changes == 2


def test_only_the_pcs_put_state_wakes_the_instance() -> None:
    # S6: an answer of active (or nothing in flight) leaves it asleep.
    lifecycle = Lifecycle(SLEEPING)
    lifecycle.answered("active")
    lifecycle.apply(InstanceEvent.DRAINED)
    assert lifecycle.state is SLEEPING
    lifecycle.set_by_pc(ACTIVE)
    assert lifecycle.state is ACTIVE


def test_an_answer_of_active_ends_a_drain_and_failed_is_not_taken() -> None:
    lifecycle = Lifecycle(DRAINING)
    lifecycle.answered("failed")  # S1: the PC's view of a silent instance
    assert lifecycle.state is DRAINING
    lifecycle.answered("active")
    assert lifecycle.state is ACTIVE


def test_a_change_the_table_lacks_raises_and_changes_nothing() -> None:
    lifecycle = Lifecycle(DRAINING)
    with pytest.raises(InstanceStateError):
        lifecycle.set_by_pc("failed")
    with pytest.raises(InstanceStateError):
        lifecycle.apply(InstanceEvent.SLEEP_ACCEPTED)  # the PC's decision, from active only
    assert lifecycle.state is DRAINING and lifecycle.changes == 0
    with pytest.raises(ValueError):
        Lifecycle("asleep")


def test_draining_becomes_sleeping_once_nothing_is_in_flight() -> None:
    # S5: while a session runs or waits it stays draining; then it reports sleeping.
    lifecycle, load, clock = Lifecycle(DRAINING), Load(running=1), Clock()
    made = reporter(InProcessPC(MemoryControllerState(clock=clock)), lifecycle, load, clock, 1)
    assert made.status().state == "draining"
    load.running, load.queued = 0, 2
    assert made.status().state == "draining"
    load.queued = 0
    assert made.status().state == "sleeping" and lifecycle.state is SLEEPING
    assert made.status().requested_state is None  # asleep: nothing to ask


async def test_the_handshake_then_a_restart_stays_asleep_until_the_pc_wakes_it() -> None:
    # S3, S5 at both ends of one table; S6: the restarted process starts
    # active, the PC's answer puts it to sleep, and its own report of active
    # does not wake it; only the PC's PUT state does (at the PC, then here).
    clock = Clock()
    state = MemoryControllerState(clock=clock, sleep_policy=SleepPolicy(idle_for_s=5.0))
    pc, lifecycle = InProcessPC(state), Lifecycle()
    first = reporter(pc, lifecycle, Load(), clock, epoch=1)
    assert await first.report() == "active"  # idle from now on
    clock.now += 5
    assert await first.report() == "draining" and lifecycle.state is DRAINING  # S3
    assert await first.report() == "sleeping" and lifecycle.state is SLEEPING  # S5

    restarted = Lifecycle()
    second = reporter(pc, restarted, Load(), clock, epoch=2)
    assert second.status().state == "active"
    assert await second.report() == "sleeping" and restarted.state is SLEEPING
    assert await second.report() == "sleeping" and await state.state_of(II) is SLEEPING

    await state.set_state(II, "active")
    restarted.set_by_pc("active")
    assert await second.report() == "active" and restarted.state is ACTIVE
