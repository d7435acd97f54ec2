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
import re
import secrets
import socket
from collections.abc import Iterable

from ..background import Background
from .errors import TierUnavailable
from .tier import StorageInUse, Tier

log = logging.getLogger("kvstore.storage")


def _pid_namespace() -> int:
    """This process's pid namespace (Linux), 0 where it cannot be known."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_name(what: str = "") -> str:
    """This process, as a refusal names it to the operator of a second one:
    pid, host, what it serves; then a token (pids repeat across containers)
    and its pid namespace (see :func:`stale`)."""
    serving = f", {what}" if what else ""
    name = (
        f"pid {os.getpid()} on {socket.gethostname()}{serving} "
        f"[{secrets.token_hex(4)} {_pid_namespace()}]"
    )
    _ours.add(name)
    return name


#: The owner names made by this process: a record naming our pid is another
#: store of this very process when it is one of these, else a previous
#: incarnation's (a container restarted with the same pid).
_ours: set[str] = set()


_OWNER = re.compile(r"pid (\d+) on ([^\s,]+).* \[[0-9a-f]+ (\d+)\]")


def stale(owner: str) -> bool:
    """An owner record that may be taken over before its TTL lapses: written
    on this host, in this pid namespace, by a process that is gone, or by
    this very pid (a container restarted: its previous incarnation). So a
    holder restarted after a crash is not refused for ``owner_ttl_s``. A
    record from elsewhere, or one that cannot be read so, waits its TTL."""
    found = _OWNER.fullmatch(owner)
    namespace = _pid_namespace()
    if found is None or found[2] != socket.gethostname() or not namespace:
        return False
    if int(found[3]) != namespace:
        return False  # another pid namespace (a container beside us): its pids are not ours
    pid = int(found[1])
    if pid == os.getpid():
        return owner not in _ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False  # alive (another user's), or no pid of this system
    return False


class Ownership(Background):
    """The claims of a store's persistent tiers (of ``tiers``), renewed every ``ttl_s`` / 3."""

    task_name = "kvstore-ownership"

    def __init__(self, tiers: Iterable[Tier], owner: str, ttl_s: float = 30.0) -> None:
        if ttl_s <= 0:
            raise ValueError("the owner record's TTL must be positive")
        self.owner, self.ttl_s = owner, ttl_s
        self.tiers: list[Tier] = [tier for tier in tiers if tier.persistent]
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
