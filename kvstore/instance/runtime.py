"""What a session runs on: the engine's worker thread and the writer of
completed blocks to the configured holders."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..holderset import HolderSet
from ..logs import describe
from ..seams import Holders
from ..storage import BlockRef
from .engine import Engine

log = logging.getLogger("kvstore.instance")


class EngineRunner:
    """Engine calls one at a time on a worker thread (PF1: the event loop
    never waits on the model)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-engine")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class BlockWriter:
    """Writes completed blocks to the configured holders in the background,
    a bounded queue ahead of them (the oldest is dropped when full).

    Each target is a holder set (:class:`.HolderSet`): a holder run with
    ``[server] workers`` lists its workers at ``GET shards`` (asked once,
    at the first write), and each block goes to one worker of each target,
    chosen by rendezvous hashing; a target of one holder is that holder."""

    def __init__(self, holders: Holders | None, targets: Sequence[str], limit: int = 256) -> None:
        self.holders, self.limit = holders, limit
        self.targets = tuple(HolderSet([t]) for t in targets)
        self.queue: asyncio.Queue[tuple[BlockRef, bytes]] = asyncio.Queue()
        self.written = self.failed = self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def write(self, ref: BlockRef, body: bytes) -> None:
        if not self.targets:
            return
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvstore-block-writer")
        while self.queue.qsize() >= self.limit:
            self.queue.get_nowait()  # output blocks only: a lost one is recomputed
            self.queue.task_done()
            self.dropped += 1
        self.queue.put_nowait((ref, body))

    async def flush(self) -> None:
        await self.queue.join()

    async def write_now(self, ref: BlockRef, body: bytes) -> None:
        """Write to every target before returning (prompt blocks: a
        checkpoint names them, so they must survive the instance)."""
        await asyncio.gather(*(self._put(target, ref, body) for target in self.targets))

    async def _put(self, target: HolderSet, ref: BlockRef, body: bytes) -> None:
        assert self.holders is not None  # targets are given with a client only
        try:
            if target.needs_discovery():
                await target.discover(self.holders)
            await target.put_block(self.holders, ref.compat_id, ref.scope_id, ref.block_key, body)
            self.written += 1  # stored, or it had the block already (BL7)
        except Exception as exc:  # the writer never dies of one holder's answer
            self.failed += 1
            detail = describe(exc)  # a KvspError: its detail
            log.warning("block %s to %s: %s", ref.block_key[:12], target.seeds[0], detail)

    async def _run(self) -> None:
        while True:
            ref, body = await self.queue.get()
            try:
                for target in self.targets:
                    await self._put(target, ref, body)
            finally:
                self.queue.task_done()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
