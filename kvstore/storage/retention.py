"""The retention limit (SEC4): blocks older than ``storage.retention_s`` leave
every tier, their records withdrawn first (the store's eviction hook)."""

from __future__ import annotations

import asyncio
import logging

from ..background import Background
from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


class RetentionSweeper(Background):
    task_name = "kvstore-retention"

    def __init__(self, store: TieredStore, interval_s: float | None = None) -> None:
        """Sweeps at once (what a restart recovered may be past the limit),
        then every tenth of the limit, between 1 s and a minute."""
        self.store = store
        limit = store.retention_s or 60.0
        self.interval_s = interval_s or max(1.0, min(60.0, limit / 10))

    async def run(self) -> None:
        while True:
            try:
                await self.store.expire()
            except Exception:
                log.exception("retention sweep failed; retrying")
            await asyncio.sleep(self.interval_s)
