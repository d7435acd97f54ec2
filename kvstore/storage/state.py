"""The life of a held block, as one table (STYLE 13, h11 ``_state.py``).

Everything that changes a block's state goes through :func:`advance`; what a
state allows is said here once, and nowhere else:

=========  ================================================  ==============
state      meaning                                           readable,
                                                             leasable,
                                                             movable
=========  ================================================  ==============
WRITING    a PUT is storing its segments; not yet            no
           acknowledged, so not served, leased, or moved
RESIDENT   acknowledged: served, leased, promoted, demoted   yes
LEAVING    being removed: withdrawn from the Index Service   no
           first (P3), then its segments deleted; its data
           is still in the tiers (``ref in store``)
GONE       nothing of it is accounted for any more           no
=========  ================================================  ==============

Transitions (a block starts absent, ``None``)::

    None --PUT--> WRITING --STORED--> RESIDENT --LEAVE--> LEAVING --DELETED--> GONE
                  WRITING --FAILED--> GONE
    None --RECOVERED--> RESIDENT                 (found in a persistent tier)

A second PUT of a key that is WRITING or LEAVING waits for it to settle:
then it is 412 if the first PUT was stored, and stored itself otherwise
(two PUTs of one key: one 201, one 412). Only a RESIDENT block may be picked
to make room, and only when nothing pins it (LE2).

Moves and removals of one block are serialized by its :class:`Claim`, never
by a store-wide lock: no tier I/O waits on an unrelated block.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any


class BlockState(enum.Enum):
    WRITING = "writing"
    RESIDENT = "resident"
    LEAVING = "leaving"
    GONE = "gone"


class Event(enum.Enum):
    PUT = "put"
    RECOVERED = "recovered"
    STORED = "stored"
    FAILED = "failed"
    LEAVE = "leave"
    DELETED = "deleted"


_TRANSITIONS: dict[tuple[BlockState | None, Event], BlockState] = {
    (None, Event.PUT): BlockState.WRITING,
    (None, Event.RECOVERED): BlockState.RESIDENT,
    (BlockState.WRITING, Event.STORED): BlockState.RESIDENT,
    (BlockState.WRITING, Event.FAILED): BlockState.GONE,
    (BlockState.RESIDENT, Event.LEAVE): BlockState.LEAVING,
    (BlockState.LEAVING, Event.DELETED): BlockState.GONE,
}

#: Served by GET and HEAD, leasable, and a candidate for moves.
SERVING = frozenset({BlockState.RESIDENT})
#: The holder still has the data (``ref in store``; the P3 hook runs then).
HELD = frozenset({BlockState.RESIDENT, BlockState.LEAVING})
#: A new PUT of the same reference waits for these to settle.
SETTLING = frozenset({BlockState.WRITING, BlockState.LEAVING})


class StateError(RuntimeError):
    """A transition the table does not have: a bug in the store, never input."""


def advance(state: BlockState | None, event: Event) -> BlockState:
    """The state after ``event``; :class:`StateError` if it cannot happen there."""
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        name = "absent" if state is None else state.value
        raise StateError(f"a block {name} cannot be {event.value}") from None


class Claim:
    """The right to move or remove one block's data, held by one task at a time.

    Re-entrant for the task that holds it (an eviction hook, or a demotion
    that finds the data it is moving lost). :meth:`try_take` never waits: the
    walk that makes room skips a claimed block rather than wait on it, so two
    tasks making room in each other's tiers cannot deadlock.
    """

    __slots__ = ("_depth", "_owner", "_waiters")

    def __init__(self) -> None:
        self._owner: asyncio.Task[Any] | None = None
        self._depth = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def taken(self) -> bool:
        return self._owner is not None

    @property
    def owned(self) -> bool:
        """Held by the running task."""
        return self._owner is not None and self._owner is asyncio.current_task()

    def try_take(self) -> bool:
        task = asyncio.current_task()
        if self._owner is None:
            self._owner, self._depth = task, 1
            return True
        if self._owner is task:
            self._depth += 1
            return True
        return False

    async def take(self) -> None:
        while not self.try_take():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def give(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._owner = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
