"""The instance's own state (S3-S6), shared by its app, sessions and reporter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lifecycle:
    """The instance's state (S3-S6): ``active``, ``draining`` or ``sleeping``."""

    state: str = "active"
    #: Counts the PC's ``PUT state`` changes: an answer to a status report
    #: sent before the latest change must not undo it.
    changes: int = 0

    def set_by_pc(self, state: str) -> None:
        self.state = state
        self.changes += 1
