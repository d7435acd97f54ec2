"""The session table (CK5, CK7): every transition, every refusal, a session
ends once, and one that moved never runs again."""

from __future__ import annotations

import itertools
import json

import pytest

from kvstore.instance.session import Session
from kvstore.instance.session_state import (
    ENDED,
    SessionEvent,
    SessionState,
    SessionStateError,
    advance,
)
from kvstore.protocol.control import GenerationLimits, Sampler

RUNNING, DONE, MOVED, FAILED = (
    SessionState.RUNNING,
    SessionState.DONE,
    SessionState.MOVED,
    SessionState.FAILED,
)
# Written out again here, not derived from the module: a changed rule must fail.
EXPECTED = {
    (RUNNING, SessionEvent.FINISHED): DONE,
    (RUNNING, SessionEvent.FENCED): MOVED,
    (RUNNING, SessionEvent.FAILED): FAILED,
}
REFUSED = [pair for pair in itertools.product(SessionState, SessionEvent) if pair not in EXPECTED]


def session() -> Session:
    return Session(
        id="6a1f0c5e-0b7d-4a47-9a43-6f1d8f0e2b11",
        scope_id="d" * 32,
        compat_id="c" * 64,
        epoch=1,
        sampler=Sampler("greedy", 0, 0, True),
        limits=GenerationLimits(4),
        tokens=[1, 2, 3],
        prompt_tokens=3,
        block_tokens=8,
        prompt_blocks=0,
    )


@pytest.mark.parametrize(("before", "event"), list(EXPECTED))
def test_every_transition_of_the_table(before: SessionState, event: SessionEvent) -> None:
    assert advance(before, event) is EXPECTED[(before, event)]


@pytest.mark.parametrize(("before", "event"), REFUSED)
def test_a_transition_the_table_lacks_raises(before: SessionState, event: SessionEvent) -> None:
    with pytest.raises(SessionStateError, match=f"is {before.value} cannot be {event.value}"):
        advance(before, event)


def test_a_session_that_moved_never_runs_again() -> None:
    # CK7: nothing leads out of moved, and nothing at all leads to running:
    # taking a session back here is a resume at a higher epoch, a new record (CK5).
    for event in SessionEvent:
        with pytest.raises(SessionStateError):
            advance(MOVED, event)
    reachable = {
        after
        for before, event in itertools.product(SessionState, SessionEvent)
        if (after := _after(before, event)) is not None
    }
    assert RUNNING not in reachable


def test_only_a_running_session_is_open() -> None:
    assert frozenset(SessionState) - ENDED == {RUNNING}
    assert all(_after(state, event) is None for state in ENDED for event in SessionEvent)


def test_a_record_ends_once_through_the_table() -> None:
    record = session()
    assert record.state is RUNNING and not record.finished
    record.apply(SessionEvent.FENCED, "resumed at epoch 2")
    assert record.state is MOVED and record.finished
    assert record.end() == {"event": "moved", "epoch": 1, "detail": "resumed at epoch 2"}
    with pytest.raises(SessionStateError):
        record.apply(SessionEvent.FAILED, "too late")
    assert record.state is MOVED and record.detail == "resumed at epoch 2"


@pytest.mark.parametrize(
    ("event", "state", "end"),
    [
        (SessionEvent.FINISHED, DONE, "done"),
        (SessionEvent.FENCED, MOVED, "moved"),
        (SessionEvent.FAILED, FAILED, "error"),
    ],
)
def test_each_end_on_the_wire(event: SessionEvent, state: SessionState, end: str) -> None:
    # The state is spelled as before in JSON answers; the stream's last event names the end.
    record = session()
    record.apply(event, "why")
    assert record.state is state and record.end()["event"] == end
    assert json.dumps({"state": record.state}) == json.dumps({"state": state.value})
    assert record.state == state.value


def _after(state: SessionState, event: SessionEvent) -> SessionState | None:
    try:
        return advance(state, event)
    except SessionStateError:
        return None
