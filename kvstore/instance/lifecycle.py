"""The instance's own state (S3-S6), shared by its app, sessions and reporter.

Its transitions are those of :mod:`kvstore.protocol.lifecycle`, the table the
PC applies to its record of the instance too: this object holds the state,
applies the events the instance sees, and counts the PC's changes.
"""

from __future__ import annotations

from ..protocol.lifecycle import ANSWERED, InstanceEvent, InstanceState, advance, set_by_pc


class Lifecycle:
    """The instance's state (S3-S6): ``active``, ``draining`` or ``sleeping``."""

    __slots__ = ("_state", "changes")

    def __init__(self, state: InstanceState | str = InstanceState.ACTIVE) -> None:
        self._state = InstanceState(state)
        #: Counts the PC's ``PUT state`` changes: an answer to a status report
        #: sent before the latest change must not undo it.
        self.changes = 0

    @property
    def state(self) -> InstanceState:
        return self._state

    @state.setter
    def state(self, state: InstanceState | str) -> None:
        # Assigning the state is the PC's PUT state: it, too, goes by the table.
        self.set_by_pc(state)

    def apply(self, event: InstanceEvent) -> InstanceState:
        """The state after ``event`` (:func:`~kvstore.protocol.lifecycle.advance`)."""
        self._state = advance(self._state, event)
        return self._state

    def set_by_pc(self, state: InstanceState | str) -> None:
        """The PC's ``PUT state`` (S3; S6: the only way a sleeping instance wakes)."""
        self.apply(set_by_pc(InstanceState(state)))
        self.changes += 1

    def answered(self, answer: InstanceState | str) -> None:
        """The PC's answer to a status report: the state it holds (S3), which
        never wakes a sleeping instance (S6); ``failed`` is not taken."""
        event = ANSWERED.get(InstanceState(answer))
        if event is not None:
            self.apply(event)

    def __repr__(self) -> str:
        return f"Lifecycle(state={self._state.value!r}, changes={self.changes})"
