"""A role's background loop (the holder's publisher, the PC's migrator)."""

from __future__ import annotations

import asyncio
import contextlib


class Background:
    """``start()`` runs ``run()`` as a task until ``stop()`` cancels it."""

    _task: asyncio.Task[None] | None = None
    task_name = "kvstore-background"

    async def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
