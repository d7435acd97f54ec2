"""The life of an inference instance, as one table (STYLE 13, h11 ``_state.py``).

The states are the "KVSP Instance States" registry (R5), spelled on the wire
as their values. Two parties hold one: the Placement Controller keeps a state
for every instance it knows (``kvstore.controller.rules``), and each instance
keeps its own (``kvstore.instance.lifecycle``). Both change it only through
:func:`advance`, over this one table; a party never sees some of the events
(only the PC hears reports, only the instance sees its sessions), but where
it sees one, it applies the same rule.

Columns: the state before the event (``absent``: the PC holds none for the
instance yet); ``-``: the table refuses the event there
(:class:`InstanceStateError`)::

    event             absent    active    draining  sleeping  failed    rule
    STARTED_ACTIVE    active    active    sleeping  sleeping  active    S2, S6
    STARTED_DRAINING  draining  draining  sleeping  sleeping  draining  S2, S6
    STARTED_SLEEPING  sleeping  sleeping  sleeping  sleeping  sleeping  S2, S6
    STARTED_FAILED    failed    failed    sleeping  sleeping  failed    S2, S6
    DRAINED           -         active    sleeping  sleeping  failed    S5
    SLEEP_ACCEPTED    -         draining  -         -         -         S3
    SET_ACTIVE        -         active    active    active    active    S3, S6
    SET_DRAINING      -         draining  draining  draining  draining  S3
    SET_SLEEPING      -         sleeping  sleeping  sleeping  sleeping  S3
    ANSWERED_ACTIVE   -         active    active    sleeping  -         S6
    EXPIRED           -         failed    failed    failed    failed    S1

The rules, row by row:

* ``STARTED_*`` (PC): a status record from a process the PC has not heard
  from, a new instance or a restart with a higher epoch (S2), by the state
  it reports. The PC takes that state, except that a restart does not wake
  an instance the PC put to sleep (S6): a draining one comes back with no
  sessions, so it is asleep.
* ``DRAINED``: nothing is in flight any more. The instance sees it (no
  session running or queued); the PC hears it as a report of ``sleeping``
  from the same process. A draining instance enters sleeping then (S5); in
  every other state the event changes nothing (at the PC: its state wins
  over what the instance says; any other report of the same process changes
  nothing either).
* ``SLEEP_ACCEPTED`` (PC): an active instance asked to sleep and has been
  idle long enough; the PC answers ``draining`` (S3). The PC considers the
  request from an active instance only.
* ``SET_*``: the PC's ``PUT state`` on the instance (S3), and at the PC the
  state it then holds. ``SET_ACTIVE`` is the only event that wakes a
  sleeping instance (S6). ``failed`` is never set: it is what the PC
  concludes of a silent instance (S1).
* The instance takes the PC's answer to a status report (:data:`ANSWERED`):
  an answer of ``draining`` or ``sleeping`` as set by the PC (its state wins,
  S3), an answer of ``active`` as ``ANSWERED_ACTIVE``: it ends a drain but
  never wakes a sleeping instance (S6), since only ``PUT state`` does.
* ``EXPIRED`` (PC): the instance's record expired, ``ttl_ms`` after it
  arrived; the PC treats it as failed (S1) until it reports again. The PC
  applies it when it reads the state; it does not store it.

``InstanceState`` is a ``str`` enum: a state compares equal to its wire
spelling, and JSON encodes it as that spelling.
"""

from __future__ import annotations

import enum


class InstanceState(enum.StrEnum):
    """The "KVSP Instance States" registry (R5)."""

    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


class InstanceEvent(enum.Enum):
    STARTED_ACTIVE = "started active"
    STARTED_DRAINING = "started draining"
    STARTED_SLEEPING = "started sleeping"
    STARTED_FAILED = "started failed"
    DRAINED = "drained"
    SLEEP_ACCEPTED = "accepted to sleep"
    SET_ACTIVE = "set active"
    SET_DRAINING = "set draining"
    SET_SLEEPING = "set sleeping"
    ANSWERED_ACTIVE = "answered active"
    EXPIRED = "expired"


_A, _D, _S, _F = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)
_X = None  # refused: no such transition
#: The columns of ``_TABLE``: the state before the event.
_BEFORE: tuple[InstanceState | None, ...] = (None, _A, _D, _S, _F)

# fmt: off
_TABLE: dict[InstanceEvent, tuple[InstanceState | None, ...]] = {
    #                                absent active draining sleeping failed
    InstanceEvent.STARTED_ACTIVE:   (_A,    _A,    _S,      _S,      _A),  # S2, S6
    InstanceEvent.STARTED_DRAINING: (_D,    _D,    _S,      _S,      _D),  # S2, S6
    InstanceEvent.STARTED_SLEEPING: (_S,    _S,    _S,      _S,      _S),  # S2, S6
    InstanceEvent.STARTED_FAILED:   (_F,    _F,    _S,      _S,      _F),  # S2, S6
    InstanceEvent.DRAINED:          (_X,    _A,    _S,      _S,      _F),  # S5
    InstanceEvent.SLEEP_ACCEPTED:   (_X,    _D,    _X,      _X,      _X),  # S3
    InstanceEvent.SET_ACTIVE:       (_X,    _A,    _A,      _A,      _A),  # S3, S6
    InstanceEvent.SET_DRAINING:     (_X,    _D,    _D,      _D,      _D),  # S3
    InstanceEvent.SET_SLEEPING:     (_X,    _S,    _S,      _S,      _S),  # S3
    InstanceEvent.ANSWERED_ACTIVE:  (_X,    _A,    _A,      _S,      _X),  # S6
    InstanceEvent.EXPIRED:          (_X,    _F,    _F,      _F,      _F),  # S1
}
# fmt: on

_TRANSITIONS: dict[tuple[InstanceState | None, InstanceEvent], InstanceState] = {
    (before, event): after
    for event, row in _TABLE.items()
    for before, after in zip(_BEFORE, row, strict=True)
    if after is not None
}

#: The event of a first status record from a process (S2), by its state.
STARTED: dict[InstanceState, InstanceEvent] = {
    _A: InstanceEvent.STARTED_ACTIVE,
    _D: InstanceEvent.STARTED_DRAINING,
    _S: InstanceEvent.STARTED_SLEEPING,
    _F: InstanceEvent.STARTED_FAILED,
}
#: The PC's ``PUT state``, by the state it sets (never ``failed``, S1).
SET_BY_PC: dict[InstanceState, InstanceEvent] = {
    _A: InstanceEvent.SET_ACTIVE,
    _D: InstanceEvent.SET_DRAINING,
    _S: InstanceEvent.SET_SLEEPING,
}
#: What an instance makes of the PC's answer to its status report (the state
#: the PC holds): the PC's state wins (S3), but an answer never wakes it
#: (S6). An answer of ``failed`` is not taken: no instance enters it (S1).
ANSWERED: dict[InstanceState, InstanceEvent] = {
    _A: InstanceEvent.ANSWERED_ACTIVE,
    _D: InstanceEvent.SET_DRAINING,
    _S: InstanceEvent.SET_SLEEPING,
}


class InstanceStateError(RuntimeError):
    """A transition the table does not have: a bug in a role, never input
    (every event a peer's input can cause is defined in every state)."""


def advance(state: InstanceState | None, event: InstanceEvent) -> InstanceState:
    """The state after ``event``; :class:`InstanceStateError` if the table
    refuses it there (``state`` None: the PC holds none for the instance)."""
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        name = "unknown to the PC" if state is None else state.value
        raise InstanceStateError(
            f"an instance that is {name} has no transition on {event.value!r}"
        ) from None


def set_by_pc(state: InstanceState) -> InstanceEvent:
    """The event of the PC's ``PUT state`` to ``state`` (S3, S6)."""
    try:
        return SET_BY_PC[state]
    except KeyError:
        raise InstanceStateError(
            f"the PC never sets an instance {state.value}: that is how it sees a silent one (S1)"
        ) from None
