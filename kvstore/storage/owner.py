"""One owner per storage: a holder claims every persistent tier it stores
into before it reads or writes any of it, and keeps the claims while it
runs (issue 33: a second holder on the same LMDB directory, Redis or S3
prefix evicted the first one's blocks from under it).

What a claim is belongs to each backend (:meth:`.Tier.claim`): an advisory
lock on a file in an LMDB directory, held for the process's life; an owner
record in Redis or S3, written only if absent, with a TTL renewed here every
third of it, so that a crashed owner's prefix frees itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import TYPE_CHECKING

from ..background import Background
from ..protocol.problems import TierUnavailable
from .tier import StorageInUse, Tier

if TYPE_CHECKING:
    from .manager import TieredStore

log = logging.getLogger("kvstore.storage")


def owner_name(what: str = "") -> str:
    """This process, as a refusal names it to the operator of a second one:
    pid, host, what it serves, and a token (pids repeat across containers)."""
    serving = f", {what}" if what else ""
    return f"pid {os.getpid()} on {socket.gethostname()}{serving} [{secrets.token_hex(4)}]"


class Ownership(Background):
    """The claims of one store's persistent tiers, renewed every ``ttl_s`` / 3."""

    task_name = "kvstore-ownership"

    def __init__(self, store: TieredStore, owner: str, ttl_s: float = 30.0) -> None:
        if ttl_s <= 0:
            raise ValueError("the owner record's TTL must be positive")
        self.owner, self.ttl_s = owner, ttl_s
        self.tiers: list[Tier] = [s.tier for s in store.slots if s.tier.persistent]
        self._claimed: list[Tier] = []
        #: Tiers whose claim another holder took while this one ran (logged once).
        self.lost: set[int] = set()

    async def claim(self) -> None:
        """Claim every persistent tier, or none: a refusal (:class:`StorageInUse`)
        gives back those taken and is raised, before anything is read."""
        try:
            for tier in self.tiers:
                await tier.claim(self.owner, self.ttl_s)
                self._claimed.append(tier)
        except BaseException:
            await self.release()
            raise

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            for index, tier in enumerate(self._claimed):
                try:
                    await tier.claim(self.owner, self.ttl_s)
                    self.lost.discard(index)
                except StorageInUse as exc:
                    # Paused past the TTL (a stopped VM, a debugger) and
                    # taken over: two holders on one storage. Say it loudly.
                    if index not in self.lost:
                        log.error("ownership of %s lost: %s", tier.kind, exc)
                    self.lost.add(index)
                except TierUnavailable as exc:
                    log.warning("could not renew the claim of %s: %s", tier.kind, exc.detail)

    async def release(self) -> None:
        """Give the claims back (a clean stop, or a start that failed)."""
        while self._claimed:
            tier = self._claimed.pop()
            try:
                await tier.release(self.owner)
            except TierUnavailable as exc:
                log.warning("could not release the claim of %s: %s", tier.kind, exc.detail)
