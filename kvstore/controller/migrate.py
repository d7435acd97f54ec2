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

A session no instance took is tried again with an exponential backoff
(``retry_base_s`` doubling up to ``retry_cap_s``, with jitter, so that PCs
and sessions do not retry in step), not every round. Its first failure is
logged as an error; later ones only at debug, with a summary of the
sessions still waiting every ``summary_every_s`` (a failed instance used to
write an error line every half second for as long as ``session_idle_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..background import Background
from ..protocol.control import ResumeRequest, SessionCheckpoint
from ..protocol.problems import InsufficientStorage, KvspError, StaleEpoch
from ..seams import Instances
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


@dataclass(slots=True)
class _Retry:
    """A session no instance took yet: when it is due again."""

    failures: int
    since: float
    due: float


class Migrator(Background):
    task_name = "kvstore-migrator"

    def __init__(
        self,
        state: ControllerState,
        placer: Placer,
        instances: Instances,
        block_tokens: dict[str, int],
        *,
        interval_s: float = 0.5,
        session_idle_s: float = 600.0,
        attempts: int = 3,
        counters: MigrationCounters | None = None,
        retry_base_s: float = 1.0,
        retry_cap_s: float = 60.0,
        summary_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        """``instances``: an :class:`~kvstore.client.InstanceClient`."""
        self.state, self.placer, self.instances = state, placer, instances
        self.block_tokens = block_tokens
        self.interval_s, self.session_idle_s, self.attempts = interval_s, session_idle_s, attempts
        self.counters = counters or MigrationCounters()
        self.retry_base_s, self.retry_cap_s = retry_base_s, retry_cap_s
        self.summary_every_s, self.clock, self.jitter = summary_every_s, clock, jitter
        self._retry: dict[str, _Retry] = {}
        self._summarized: float | None = None  # when the last summary was logged

    async def run_once(self) -> int:
        """One round over the failed and the restarted instances; the number
        of sessions moved."""
        moved = 0
        seen: set[str] = set()
        failed = await self.state.failed()
        for instance in failed:
            for entry in await self.state.sessions_of(instance):
                seen.add(entry.session)
                moved += await self._consider(entry, set(failed))
        # S2, CK5: a new process (a higher epoch) has not the sessions its
        # predecessor owned; those it took on since are its own.
        for instance, epoch in await self.state.restarted():
            left = False
            for entry in await self.state.sessions_of(instance):
                if entry.owner_epoch < epoch:
                    seen.add(entry.session)
                    moved += await self._consider(entry, set(failed))
                    left = left or entry.session in self._retry
            if not left:  # else: again once due
                await self.state.sessions_moved(instance, epoch)
        # Sessions that ended, or that another PC moved, wait no more.
        for session in self._retry.keys() - seen:
            del self._retry[session]
        self._summarize()
        return moved

    async def _consider(self, entry: SessionEntry, failed: set[str]) -> int:
        """Forget a session that cannot be resumed, else move it once due."""
        checkpoint = entry.checkpoint
        now = await self.state.now()
        if checkpoint is None or now - entry.touched > self.session_idle_s:
            log.warning(
                "session %s of failed %s cannot be resumed (%s); forgotten",
                entry.session,
                entry.owner,
                "no checkpoint" if checkpoint is None else "idle",
            )
            with contextlib.suppress(KvspError):
                await self.state.end_session(entry.session, entry.owner)
            self.counters.sessions_dropped += 1
            self._retry.pop(entry.session, None)
            return 0
        retry = self._retry.get(entry.session)
        if retry is not None and self.clock() < retry.due:
            return 0
        return await self.migrate(entry, checkpoint, failed)

    def _failed(self, entry: SessionEntry) -> None:
        now = self.clock()
        retry = self._retry.get(entry.session)
        if retry is None:
            retry = self._retry[entry.session] = _Retry(0, now, now)
            if self._summarized is None:
                self._summarized = now  # the first summary one period later
            log.error(
                "session %s of failed %s: no instance took it; trying again with a "
                "backoff of up to %.0f s",
                entry.session,
                entry.owner,
                self.retry_cap_s,
            )
        else:
            log.debug(
                "session %s: no instance took it (%d times)", entry.session, retry.failures + 1
            )
        retry.failures += 1
        # Exponential with a cap and "equal jitter": between half and all of it.
        delay = min(self.retry_cap_s, self.retry_base_s * 2 ** (retry.failures - 1))
        retry.due = now + delay * (0.5 + self.jitter() / 2)

    def _summarize(self) -> None:
        now = self.clock()
        if not self._retry:
            self._summarized = None
        elif self._summarized is not None and now - self._summarized >= self.summary_every_s:
            self._summarized = now
            oldest = min(r.since for r in self._retry.values())
            log.warning(
                "%d session(s) of failed instances wait for an instance to take "
                "them, the oldest for %.0f s (%d tries in all)",
                len(self._retry),
                now - oldest,
                sum(r.failures for r in self._retry.values()),
            )

    async def migrate(
        self, entry: SessionEntry, checkpoint: SessionCheckpoint, failed: set[str]
    ) -> int:
        """Move a session to a new instance, resumed from ``checkpoint``."""
        # A session that failed before says why at debug only (_failed).
        say = log.debug if entry.session in self._retry else log.warning
        block_tokens = self.block_tokens.get(checkpoint.compat_id, 0)
        total = len(checkpoint.prompt_blocks) * block_tokens + len(checkpoint.prompt_tail)
        placement = await self.placer.place(
            checkpoint.scope_id,
            checkpoint.compat_id,
            checkpoint.prompt_blocks,
            total + checkpoint.output_offset,
            block_tokens or 1,
            exclude=failed,
        )
        epoch = entry.epoch
        for candidate in placement.candidates[: self.attempts]:
            epoch += 1
            try:
                # CK5, CK7: the new epoch fences the failed instance first.
                moved = await self.state.assign(
                    entry.session, candidate.instance, epoch, keep_touched=True
                )  # (a move is no sign of the session's life: its checkpoints are)
            except StaleEpoch:
                self._retry.pop(entry.session, None)
                return 0  # another PC moved it meanwhile, or it ended
            except InsufficientStorage as exc:
                epoch -= 1
                say("%s cannot take session %s: %s", candidate.instance, entry.session, exc.detail)
                continue
            # The checkpoint as the move found it: the failed instance may
            # have checkpointed since this round read the session (CK3).
            latest = moved.checkpoint or checkpoint
            try:
                await self.instances.resume(candidate.instance, ResumeRequest(epoch, latest))
            except KvspError as exc:
                say("resume of %s at %s failed: %s", entry.session, candidate.instance, exc.detail)
                continue
            retry = self._retry.pop(entry.session, None)
            log.warning(
                "session %s moved from %s to %s at epoch %d%s",
                entry.session,
                entry.owner,
                candidate.instance,
                epoch,
                f" after {retry.failures} failed tries" if retry else "",
            )
            self.counters.migrations += 1
            return 1
        self.counters.migrations_failed += 1
        self._failed(entry)
        if epoch > entry.epoch:
            # Back with the failed owner (fenced by the newer epoch) so that
            # the next round tries again, rather than left with a refuser.
            with contextlib.suppress(KvspError):
                await self.state.assign(
                    entry.session,
                    entry.owner,
                    epoch + 1,
                    owner_epoch=entry.owner_epoch,
                    keep_touched=True,
                )
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
