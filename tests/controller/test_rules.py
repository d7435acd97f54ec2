"""The PC's instance rules as pure functions (S1-S3, S5, S6): when each event
of the instance-state table happens. Times are passed in: no clock, no state."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvstore.controller.rules import InstanceEntry, SleepPolicy, after_set, after_status
from kvstore.protocol.control import InstanceStatus
from kvstore.protocol.lifecycle import InstanceState, InstanceStateError
from kvstore.protocol.problems import StaleEpoch, UnknownResource

II = "https://ii1.test/kvsp/"
POLICY = SleepPolicy(idle_for_s=10)
STATES = list(InstanceState)


def status(epoch: int = 10, state: str = "active", **changes: object) -> InstanceStatus:
    base = InstanceStatus(
        instance=II,
        epoch=epoch,
        state=state,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.0,
        prefill_tokens_per_s=1000,
        decode_tokens_per_s=100,
        ttl_ms=3000,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def held(state: InstanceState, epoch: int = 10) -> InstanceEntry:
    """An entry the PC holds in ``state``, recorded at time 0 (expires at 3)."""
    return dataclasses.replace(after_status(None, status(epoch), 0.0, POLICY), state=state)


@pytest.mark.parametrize("reported", STATES)
def test_a_first_report_is_taken_as_it_is(reported: InstanceState) -> None:
    # S2: an instance the PC has not heard from is in the state it reports.
    entry = after_status(None, status(state=reported.value), 0.0, POLICY)
    assert entry.state is reported and not entry.restarted


@pytest.mark.parametrize("before", [InstanceState.DRAINING, InstanceState.SLEEPING])
@pytest.mark.parametrize("reported", STATES)
def test_a_restart_keeps_an_instance_the_pc_put_to_sleep_asleep(
    before: InstanceState, reported: InstanceState
) -> None:
    # S6; CK5: the PC remembers the restart (the old process's sessions are lost).
    entry = after_status(held(before), status(epoch=11, state=reported.value), 1.0, POLICY)
    assert entry.state is InstanceState.SLEEPING and entry.restarted


@pytest.mark.parametrize("before", [InstanceState.ACTIVE, InstanceState.FAILED])
def test_a_restart_of_an_awake_instance_takes_what_it_reports(before: InstanceState) -> None:
    # S2: a new process: what the PC held was about the old one.
    entry = after_status(held(before), status(epoch=11, state="sleeping"), 1.0, POLICY)
    assert entry.state is InstanceState.SLEEPING
    entry = after_status(held(before), status(epoch=11, state="active"), 1.0, POLICY)
    assert entry.state is InstanceState.ACTIVE


@pytest.mark.parametrize("before", STATES)
@pytest.mark.parametrize("reported", STATES)
def test_a_report_of_the_same_process_changes_only_a_drain(
    before: InstanceState, reported: InstanceState
) -> None:
    # S5: a draining instance that reports sleeping is asleep; otherwise the
    # PC's state wins over the report (S6: a sleeping one does not wake).
    entry = after_status(held(before), status(state=reported.value), 1.0, POLICY)
    drained = before is InstanceState.DRAINING and reported is InstanceState.SLEEPING
    assert entry.state is (InstanceState.SLEEPING if drained else before)


def test_a_sleep_request_is_accepted_after_the_idle_time_only() -> None:
    # S3: idle since 0; asked at 9 it is refused (active), at 10 accepted.
    asked = status(requested_state="sleeping")
    entry = after_status(None, asked, 0.0, POLICY)
    entry = after_status(entry, asked, 9.0, POLICY)
    assert entry.state is InstanceState.ACTIVE and entry.idle_since == 0.0
    entry = after_status(entry, asked, 10.0, POLICY)
    assert entry.state is InstanceState.DRAINING


@pytest.mark.parametrize("before", [InstanceState.SLEEPING, InstanceState.FAILED])
def test_a_sleep_request_of_an_instance_not_active_changes_nothing(
    before: InstanceState,
) -> None:
    # S3 concerns an active instance; the table would refuse the acceptance.
    entry = held(before)
    asked = status(requested_state="sleeping")
    assert after_status(entry, asked, 100.0, POLICY).state is before


def test_a_lower_epoch_is_stale() -> None:
    # S2
    with pytest.raises(StaleEpoch):
        after_status(held(InstanceState.ACTIVE), status(epoch=9), 1.0, POLICY)


@pytest.mark.parametrize("before", STATES)
def test_an_expired_record_reads_as_failed_until_the_next_report(
    before: InstanceState,
) -> None:
    # S1: expiry is not stored; a report of the same process brings the held state back.
    entry = held(before)
    assert entry.state_at(2.9) is before
    assert entry.state_at(3.0) is InstanceState.FAILED
    assert after_status(entry, status(), 5.0, POLICY).state_at(5.0) is before


@pytest.mark.parametrize("before", STATES)
@pytest.mark.parametrize(
    "target", [InstanceState.ACTIVE, InstanceState.DRAINING, InstanceState.SLEEPING]
)
def test_the_pcs_own_state_change(before: InstanceState, target: InstanceState) -> None:
    # S3, S6: PUT state sets active (the only wake), draining or sleeping.
    entry = after_set(held(before), target)
    assert entry.state is target
    assert entry.status == held(before).status  # nothing else changes


def test_the_pc_never_sets_failed_nor_an_unknown_instance() -> None:
    with pytest.raises(InstanceStateError):
        after_set(held(InstanceState.ACTIVE), InstanceState.FAILED)
    with pytest.raises(UnknownResource):
        after_set(None, InstanceState.ACTIVE)


@pytest.mark.parametrize("state", STATES)
def test_an_entry_stores_the_wire_spelling(state: InstanceState) -> None:
    # A shared (Redis) state holds the entry as JSON: the registry's names.
    entry = held(state)
    stored = json.loads(json.dumps(entry.to_json()))
    assert stored["state"] == state.value and type(stored["state"]) is str
    assert InstanceEntry.from_json(stored) == entry
    assert InstanceEntry.from_json(stored).state is state
