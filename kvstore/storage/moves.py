"""Optional work of the store that no request waits for (promotions): each in
a task of its own, a bounded number at once; beyond the bound new work is
refused (dropped, never queued behind a slow tier); a stop cancels what runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("kvstore.storage")


class Moves:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stopped = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    def start(self, work: Callable[[], Coroutine[Any, Any, None]], name: str) -> bool:
        """Run ``work()`` in the background; False if stopped or at the bound."""
        if self.stopped or len(self._tasks) >= self.limit:
            return False
        task = asyncio.get_running_loop().create_task(work(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return True

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def settle(self) -> None:
        """Wait for the work started so far, and what it starts."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Nothing starts from now on; what runs is cancelled."""
        self.stopped = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
