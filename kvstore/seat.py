"""A worker's place in a supervised set of holder processes
(:mod:`kvstore.workers`): the board the supervisor and its workers share,
and what a worker's own process knows of it. Below both the supervisor and
:mod:`kvstore.serve`, which marks its worker up once it listens."""

from __future__ import annotations

import dataclasses
from typing import Any

STARTING, UP, STOPPING, DOWN = 0, 1, 2, 3
STATE_NAMES = ("starting", "up", "stopping", "down")


class Board:
    """What the supervisor and its workers share (memory mapped by both):
    each worker's state and its restarts."""

    def __init__(self, count: int, context: Any) -> None:
        self.states = context.RawArray("b", count)
        self.restarts = context.RawArray("i", count)


@dataclasses.dataclass(frozen=True)
class Seat:
    """A worker's place in its set, as the worker's own process sees it."""

    index: int
    uris: tuple[str, ...]
    board: Board

    def mark(self, state: int) -> None:
        self.board.states[self.index] = state

    def states(self) -> dict[str, dict[str, Any]]:
        """Every worker's state and restarts, by base URI (``/readyz``)."""
        return {
            uri: {
                "worker": i,
                "state": STATE_NAMES[self.board.states[i]],
                "restarts": self.board.restarts[i],
            }
            for i, uri in enumerate(self.uris)
        }


class SeatService:
    """The worker's own state on the board: up once it listens, stopping at the stop."""

    def __init__(self, seat: Seat) -> None:
        self.seat = seat

    def start(self) -> None:
        self.seat.mark(UP)

    async def stop(self) -> None:
        self.seat.mark(STOPPING)
