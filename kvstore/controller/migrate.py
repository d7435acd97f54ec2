"""Moving the sessions of failed instances (CK5, CK7, SEC5).

Every ``interval_s`` the PC looks for instances whose status expired (S1),
and for instances that restarted (a higher epoch, S2) while owning sessions
of their earlier process. For each session such an instance lost it picks a new instance as for any
request (:class:`~.placer.Placer`, the prompt's blocks from the latest
checkpoint), raises the session's epoch while assigning it there, which
fences the failed instance (its checkpoints now carry an old epoch, CK7),
and sends ``POST sessions/{session}/resume`` with the checkpoint and the new
epoch. If that instance does not take it, the next candidate gets the next
epoch. Several PCs over one Redis may race for a session: the epoch's
compare-and-set lets one of them move it.

A session without a checkpoint cannot be resumed (the PC never saw its
prompt), nor one idle for ``session_idle_s`` (finished without being ended):
both are forgotten, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from ..background import Background
from ..protocol.control import ResumeRequest
from ..protocol.problems import InsufficientStorage, KvspError, StaleEpoch
from .placer import Placer
from .rules import SessionEntry
from .state import ControllerState

log = logging.getLogger("kvstore.controller")


@dataclass(slots=True)
class MigrationCounters:
    """OPS1: migrations."""

    migrations: int = 0
    migrations_failed: int = 0
    sessions_dropped: int = 0


class Migrator(Background):
    task_name = "kvstore-migrator"

    def __init__(
        self,
        state: ControllerState,
        placer: Placer,
        instances: Any,
        block_tokens: dict[str, int],
        *,
        interval_s: float = 0.5,
        session_idle_s: float = 600.0,
        attempts: int = 3,
        counters: MigrationCounters | None = None,
    ) -> None:
        """``instances``: an :class:`~kvstore.client.InstanceClient`."""
        self.state, self.placer, self.instances = state, placer, instances
        self.block_tokens = block_tokens
        self.interval_s, self.session_idle_s, self.attempts = interval_s, session_idle_s, attempts
        self.counters = counters or MigrationCounters()

    async def run_once(self) -> int:
        """One round over the failed and the restarted instances; the number
        of sessions moved."""
        moved = 0
        failed = await self.state.failed()
        for instance in failed:
            for entry in await self.state.sessions_of(instance):
                moved += await self.migrate(entry, set(failed))
        # S2, CK5: a new process (a higher epoch) has not the sessions its
        # predecessor owned; those it took on since are its own.
        for instance, epoch in await self.state.restarted():
            unmoved = self.counters.migrations_failed
            for entry in await self.state.sessions_of(instance):
                if entry.owner_epoch < epoch:
                    moved += await self.migrate(entry, set(failed))
            if self.counters.migrations_failed == unmoved:  # else: next round again
                await self.state.sessions_moved(instance, epoch)
        return moved

    async def migrate(self, entry: SessionEntry, failed: set[str]) -> int:
        checkpoint = entry.checkpoint
        now = await self.state.now()
        if checkpoint is None or now - entry.touched > self.session_idle_s:
            log.warning("session %s of failed %s cannot be resumed (%s); forgotten",
                        entry.session, entry.owner,
                        "no checkpoint" if checkpoint is None else "idle")  # fmt: skip
            with contextlib.suppress(KvspError):
                await self.state.end_session(entry.session, entry.owner)
            self.counters.sessions_dropped += 1
            return 0
        block_tokens = self.block_tokens.get(checkpoint.compat_id, 0)
        total = len(checkpoint.prompt_blocks) * block_tokens + len(checkpoint.prompt_tail)
        placement = await self.placer.place(
            checkpoint.scope_id, checkpoint.compat_id, checkpoint.prompt_blocks,
            total + checkpoint.output_offset, block_tokens or 1, exclude=failed,
        )  # fmt: skip
        epoch = entry.epoch
        for candidate in placement.candidates[: self.attempts]:
            epoch += 1
            try:
                # CK5, CK7: the new epoch fences the failed instance first.
                moved = await self.state.assign(
                    entry.session, candidate.instance, epoch, keep_touched=True
                )  # (a move is no sign of the session's life: its checkpoints are)
            except StaleEpoch:
                return 0  # another PC moved it meanwhile, or it ended
            except InsufficientStorage as exc:
                epoch -= 1
                log.warning("%s cannot take session %s: %s", candidate.instance,
                            entry.session, exc.detail)  # fmt: skip
                continue
            # The checkpoint as the move found it: the failed instance may
            # have checkpointed since this round read the session (CK3).
            latest = moved.checkpoint or checkpoint
            try:
                await self.instances.resume(candidate.instance, ResumeRequest(epoch, latest))
            except KvspError as exc:
                log.warning("resume of %s at %s failed: %s", entry.session,
                            candidate.instance, exc.detail)  # fmt: skip
                continue
            log.warning("session %s moved from %s to %s at epoch %d", entry.session,
                        entry.owner, candidate.instance, epoch)  # fmt: skip
            self.counters.migrations += 1
            return 1
        self.counters.migrations_failed += 1
        log.error("session %s of failed %s: no instance took it", entry.session, entry.owner)
        if epoch > entry.epoch:
            # Back with the failed owner (fenced by the newer epoch) so that
            # the next round tries again, rather than left with a refuser.
            with contextlib.suppress(KvspError):
                await self.state.assign(
                    entry.session, entry.owner, epoch + 1,
                    owner_epoch=entry.owner_epoch, keep_touched=True,
                )  # fmt: skip
        return 0

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
            except KvspError as exc:
                log.warning("migration round failed: %s", exc.detail)
            except Exception:
                log.exception("migration round failed")
            await asyncio.sleep(self.interval_s)
