"""How a role's background parts start and stop with its app (STYLE 14).

Every role app declares a starlette ``lifespan``: the publisher, the status
reporter, the migrator start when the app starts and stop when it stops.
``kvstore serve`` composes the role apps under one uvicorn and enters their
lifespans in one :class:`contextlib.AsyncExitStack`, so they stop in the
reverse order of their start: the users of a part before the part.

Two things only the composition knows are handed to the roles:

* :class:`Listening`: when the listener is bound. A part whose first round
  talks to a role of the same listener (the publisher republishing what was
  recovered, the status reporter's first report) starts once it listens;
  uvicorn runs the lifespan before it binds.
* :class:`Shutdown`: the one deadline of a graceful stop. The signal starts
  it; the listener's grace for in-flight requests comes first, and what is
  left goes to the roles' own stopping (spilling, withdrawing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger("kvstore.lifespan")


class Service(Protocol):
    """A background part: ``start()`` begins its loop, ``stop()`` ends it."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Listening:
    """Set once the process's listener is bound (already set by default: an
    app served by a test, or by another server, listens when it starts)."""

    def __init__(self, listening: bool = True) -> None:
        self._event = asyncio.Event()
        if listening:
            self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


class Shutdown:
    """The deadline of a graceful stop, ``grace_s`` from :meth:`begin`."""

    def __init__(self, grace_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.began: float | None = None
        self._frozen: float | None = None

    def begin(self) -> None:
        """The stop began (a signal): the first call counts."""
        if self.began is None:
            self.began = self.clock()

    def freeze(self) -> None:
        """The roles' own stopping begins: what is left now is what they
        share, however long the ones before take (the holder's spill and
        withdrawals get their part of it after the instance stopped)."""
        if self._frozen is None:
            self._frozen = self.left()

    def left(self) -> float:
        """Seconds left of the grace (all of it if the stop has not begun);
        once frozen, what was left then."""
        if self._frozen is not None:
            return self._frozen
        if self.began is None:
            return self.grace_s
        return max(0.0, self.grace_s - (self.clock() - self.began))

    def share(self, fraction: float, at_least: float = 1.0) -> float:
        """A part of what is left, but ``at_least`` seconds."""
        return max(at_least, fraction * self.left())


Step = Callable[[], Awaitable[Any]]


async def run_steps(steps: Sequence[Step], what: str = "stopping") -> None:
    """Each step in order; one failing is logged and does not skip the others."""
    for step in steps:
        try:
            await step()
        except Exception:
            log.exception("while %s", what)


@contextlib.asynccontextmanager
async def running(
    services: Sequence[Service],
    *,
    after: Listening | None = None,
    then: Sequence[Step] = (),
) -> AsyncIterator[None]:
    """Start ``services`` (once ``after`` is set), and on exit stop them in
    reverse order and run ``then``, step by step."""
    started: list[Service] = []

    def start() -> None:
        for service in services:
            service.start()
            started.append(service)

    async def start_when_listening(listening: Listening) -> None:
        await listening.wait()
        start()

    task = None
    if after is None:
        start()
    else:
        task = asyncio.create_task(start_when_listening(after), name="kvstore-start")
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await run_steps([s.stop for s in reversed(started)], "stopping background work")
        await run_steps(then)
