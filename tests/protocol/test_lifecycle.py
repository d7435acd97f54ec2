"""The instance-state table (S1-S6, R5): every transition, every refusal, and
the rules the PC and the instance rely on."""

from __future__ import annotations

import json
import re

import pytest

from kvstore.protocol import lifecycle
from kvstore.protocol.control import INSTANCE_STATES, StateChange
from kvstore.protocol.lifecycle import (
    ANSWERED,
    SET_BY_PC,
    STARTED,
    InstanceEvent,
    InstanceState,
    InstanceStateError,
    advance,
    set_by_pc,
)

ACTIVE, DRAINING, SLEEPING, FAILED = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)
E = InstanceEvent
BEFORE: tuple[InstanceState | None, ...] = (None, ACTIVE, DRAINING, SLEEPING, FAILED)

# Written out again here, not derived from the module: a changed rule must
# fail a test. None: no such transition.
# fmt: off
EXPECTED: dict[InstanceEvent, tuple[InstanceState | None, ...]] = {
    #                   absent    active    draining  sleeping  failed
    E.STARTED_ACTIVE:   (ACTIVE,   ACTIVE,   SLEEPING, SLEEPING, ACTIVE),
    E.STARTED_DRAINING: (DRAINING, DRAINING, SLEEPING, SLEEPING, DRAINING),
    E.STARTED_SLEEPING: (SLEEPING, SLEEPING, SLEEPING, SLEEPING, SLEEPING),
    E.STARTED_FAILED:   (FAILED,   FAILED,   SLEEPING, SLEEPING, FAILED),
    E.DRAINED:          (None,     ACTIVE,   SLEEPING, SLEEPING, FAILED),
    E.SLEEP_ACCEPTED:   (None,     DRAINING, None,     None,     None),
    E.SET_ACTIVE:       (None,     ACTIVE,   ACTIVE,   ACTIVE,   ACTIVE),
    E.SET_DRAINING:     (None,     DRAINING, DRAINING, DRAINING, DRAINING),
    E.SET_SLEEPING:     (None,     SLEEPING, SLEEPING, SLEEPING, SLEEPING),
    E.ANSWERED_ACTIVE:  (None,     ACTIVE,   ACTIVE,   SLEEPING, None),
    E.EXPIRED:          (None,     FAILED,   FAILED,   FAILED,   FAILED),
}
# fmt: on
ALLOWED = [
    (before, event, after)
    for event, row in EXPECTED.items()
    for before, after in zip(BEFORE, row, strict=True)
    if after is not None
]
REFUSED = [
    (before, event)
    for event, row in EXPECTED.items()
    for before, after in zip(BEFORE, row, strict=True)
    if after is None
]


def test_every_event_has_a_row() -> None:
    assert set(EXPECTED) == set(InstanceEvent)


@pytest.mark.parametrize(("before", "event", "after"), ALLOWED)
def test_every_transition_of_the_table(
    before: InstanceState | None, event: InstanceEvent, after: InstanceState
) -> None:
    assert advance(before, event) is after


@pytest.mark.parametrize(("before", "event"), REFUSED)
def test_a_transition_the_table_lacks_raises(
    before: InstanceState | None, event: InstanceEvent
) -> None:
    with pytest.raises(InstanceStateError, match=re.escape(repr(event.value))) as raised:
        advance(before, event)
    assert ("unknown to the PC" if before is None else before.value) in str(raised.value)


def test_the_docstring_draws_the_table() -> None:
    # The drawing a reader trusts is the table the code applies.
    doc = lifecycle.__doc__
    assert doc is not None
    drawn: dict[str, list[str]] = {}
    for line in doc.splitlines():
        words = line.split()
        if words and words[0] in InstanceEvent.__members__:
            drawn[words[0]] = words[1:6]
    assert set(drawn) == set(InstanceEvent.__members__)
    for event, row in EXPECTED.items():
        assert drawn[event.name] == ["-" if s is None else s.value for s in row], event


def test_only_the_pc_wakes_a_sleeping_instance() -> None:
    # S6: of every event, only the PC's PUT state active leads out of sleeping
    # into active; its answer to a report, a restart, a drain do not.
    waking = {e for e in InstanceEvent if _after(SLEEPING, e) is ACTIVE}
    assert waking == {E.SET_ACTIVE}
    assert advance(SLEEPING, ANSWERED[ACTIVE]) is SLEEPING
    assert advance(SLEEPING, set_by_pc(ACTIVE)) is ACTIVE


@pytest.mark.parametrize("held", [DRAINING, SLEEPING])
@pytest.mark.parametrize("reported", list(InstanceState))
def test_a_restart_does_not_wake_an_instance_the_pc_put_to_sleep(
    held: InstanceState, reported: InstanceState
) -> None:
    # S2, S6: whatever the new process reports, it is asleep (a draining one
    # comes back with no sessions).
    assert advance(held, STARTED[reported]) is SLEEPING


@pytest.mark.parametrize("held", [None, ACTIVE, FAILED])
@pytest.mark.parametrize("reported", list(InstanceState))
def test_a_new_process_otherwise_takes_the_state_it_reports(
    held: InstanceState | None, reported: InstanceState
) -> None:
    # S2: a new instance, or a restart of one the PC did not put to sleep.
    assert advance(held, STARTED[reported]) is reported


def test_draining_becomes_sleeping_once_nothing_is_in_flight() -> None:
    # S5: only a draining instance changes when it has nothing in flight.
    assert advance(DRAINING, E.DRAINED) is SLEEPING
    for state in (ACTIVE, SLEEPING, FAILED):
        assert advance(state, E.DRAINED) is state


def test_only_an_active_instance_is_accepted_to_sleep() -> None:
    # S3: the acceptance is answered draining.
    assert advance(ACTIVE, E.SLEEP_ACCEPTED) is DRAINING
    for state in (None, DRAINING, SLEEPING, FAILED):
        with pytest.raises(InstanceStateError):
            advance(state, E.SLEEP_ACCEPTED)


def test_an_expired_record_is_failed_whatever_the_state() -> None:
    # S1
    for state in InstanceState:
        assert advance(state, E.EXPIRED) is FAILED


def test_the_pc_never_sets_failed() -> None:
    # S1: failed is the PC's view of a silent instance, not a PUT state.
    assert set(SET_BY_PC) == {ACTIVE, DRAINING, SLEEPING}
    for state, event in SET_BY_PC.items():
        assert set_by_pc(state) is event
        assert all(advance(s, event) is state for s in InstanceState)
    with pytest.raises(InstanceStateError, match="never sets an instance failed"):
        set_by_pc(FAILED)


def test_answers_the_instance_takes() -> None:
    # S3: the PC's state wins; S6: an answer of active ends a drain but never
    # wakes; an answer of failed is not a state to enter.
    assert FAILED not in ANSWERED
    assert advance(ACTIVE, ANSWERED[DRAINING]) is DRAINING
    assert advance(DRAINING, ANSWERED[ACTIVE]) is ACTIVE
    assert advance(SLEEPING, ANSWERED[ACTIVE]) is SLEEPING
    assert advance(ACTIVE, ANSWERED[SLEEPING]) is SLEEPING


def test_started_covers_every_reported_state() -> None:
    # A status record can carry any registered state (R5): none may raise.
    assert set(STARTED) == set(InstanceState)
    assert len(set(STARTED.values())) == len(InstanceState)


def test_states_are_the_registry_on_the_wire() -> None:
    # R5: the enum is the registry; a state is its wire spelling in JSON.
    assert {s.value for s in InstanceState} == INSTANCE_STATES
    assert InstanceState("draining") is DRAINING
    assert json.dumps({"state": SLEEPING}) == '{"state": "sleeping"}'
    assert StateChange(DRAINING.value).to_json() == {"state": "draining"}
    with pytest.raises(ValueError):
        InstanceState("asleep")


def _after(state: InstanceState, event: InstanceEvent) -> InstanceState | None:
    try:
        return advance(state, event)
    except InstanceStateError:
        return None
