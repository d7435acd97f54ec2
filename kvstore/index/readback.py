"""Writes that return once this process has read them back from a Redis
stream it follows: the replicated index's log (:mod:`.replicated`) and the
shared residency's (:mod:`.shared_residency`). Every process then applies
the entries in the log's order, its own writes included."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger("kvstore.index")

#: A stream entry ID as a comparable pair (ms, sequence).
EntryId = tuple[int, int]


def entry_id(raw: Any) -> EntryId:
    """A stream entry ID (``"<ms>-<seq>"``, text or octets) as a pair."""
    ms, _, seq = text(raw).partition("-")
    return int(ms), int(seq or 0)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ReadBack:
    """The writes of this process waiting for the follower of one stream."""

    def __init__(self, what: str, wait_s: float) -> None:
        self.what, self.wait_s = what, wait_s
        self._waiting: list[tuple[EntryId, asyncio.Future[None]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    async def wait(self, entry: EntryId) -> bool:
        """Until the follower has applied ``entry``; False after ``wait_s``
        (the caller applies it itself). The follower's failure to apply it
        (:meth:`fail`) is raised."""
        waiting = (entry, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        try:
            async with asyncio.timeout(self.wait_s):
                await waiting[1]
            return True
        except TimeoutError:
            log.warning("%s: entry %s not read back within %.0f s", self.what, entry, self.wait_s)
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiting)

    def reached(self, done: EntryId) -> None:
        """The follower applied every entry up to ``done``."""
        for entry, waiter in self._waiting:
            if entry <= done and not waiter.done():
                waiter.set_result(None)

    def fail(self, entry: EntryId, exc: BaseException) -> None:
        for waiting_id, waiter in self._waiting:
            if waiting_id == entry and not waiter.done():
                waiter.set_exception(exc)

    def cancel(self) -> None:
        for _, waiter in self._waiting:
            if not waiter.done():
                waiter.cancel()
