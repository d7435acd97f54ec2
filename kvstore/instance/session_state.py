"""The life of a session at an instance, as one table (STYLE 13, h11 ``_state.py``).

Everything that changes a :class:`~kvstore.instance.session.Session`'s state
goes through :func:`advance`. The states are spelled on the wire as their
values (``GET sessions/{id}``), and how a session ended names the last event
of its token stream (``done``, ``moved``, ``error``)::

    state     meaning                                          event at the end
    RUNNING   restoring its sequence, decoding, or waiting     -
              for the PC to acknowledge a checkpoint (CK3)
    DONE      its output is complete                           done
    MOVED     a newer epoch owns it, elsewhere or here (CK7)   moved
    FAILED    it stopped on an error; its client was told      error

Transitions (a session is born RUNNING, by ``POST generate`` or by a resume
at a new epoch, CK5)::

    RUNNING --FINISHED--> DONE      max_tokens or a stop token reached (or the
                                    resumed checkpoint had ended already)
    RUNNING --FENCED----> MOVED     CK7: the PC refused a checkpoint for its
                                    epoch, or a resume here took it over at a
                                    higher epoch
    RUNNING --FAILED----> FAILED    an engine or load error, the PC refusing
                                    its checkpoints, no acknowledgement in time

A session ends once: the table has no event out of DONE, MOVED or FAILED,
and none back to RUNNING. In particular a session that moved (CK7) never
runs again here: taking it back is a resume at a higher epoch, which makes a
new record (CK5), and the record it replaces is fenced. A late fence or
failure of a session that ended already is dropped by its owner
(:class:`~kvstore.instance.sessions.Sessions`), which tests :data:`ENDED`.
"""

from __future__ import annotations

import enum


class SessionState(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    MOVED = "moved"
    FAILED = "failed"


class SessionEvent(enum.Enum):
    FINISHED = "finished"
    FENCED = "fenced"
    FAILED = "failed"


_TRANSITIONS: dict[tuple[SessionState, SessionEvent], SessionState] = {
    (SessionState.RUNNING, SessionEvent.FINISHED): SessionState.DONE,
    (SessionState.RUNNING, SessionEvent.FENCED): SessionState.MOVED,  # CK7
    (SessionState.RUNNING, SessionEvent.FAILED): SessionState.FAILED,
}

#: A session in one of these is over: followers get its end, it counts no
#: more against ``max_sessions``, and nothing changes it any more.
ENDED = frozenset({SessionState.DONE, SessionState.MOVED, SessionState.FAILED})


class SessionStateError(RuntimeError):
    """A transition the table does not have: a bug in the instance, never input."""


def advance(state: SessionState, event: SessionEvent) -> SessionState:
    """The state after ``event``; :class:`SessionStateError` if it cannot happen there."""
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        raise SessionStateError(
            f"a session that is {state.value} cannot be {event.value}"
        ) from None
