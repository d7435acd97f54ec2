"""Tier I/O for the store's paths: deadlines, health accounting, sealing,
quiet deletes. Composed into the store and its placement (not inherited).

Every call into a tier goes through :meth:`TierIO.call`, the one place that
records a tier's failures and recoveries (STYLE 8).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from ..logs import describe
from ..protocol._bytes import BytesLike
from .crypto import SegmentSealer
from .errors import TierUnavailable
from .records import StoreStats, TierSlot
from .types import BlockRef

log = logging.getLogger("kvstore.storage")

#: Segments at least this large are hashed, sealed and checked in a worker
#: thread: hashlib, zlib and AES-GCM release the GIL, so the event loop keeps
#: serving and a second core does the work.
OFFLOAD_OCTETS = 256 * 1024


class TierIO:
    def __init__(
        self,
        slots: list[TierSlot],
        sealer: SegmentSealer,
        stats: StoreStats,
        retry_after_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.slots = slots
        self.sealer = sealer
        self.stats = stats
        #: How long a tier that failed is skipped before it is asked again.
        self.retry_after_s = retry_after_s
        self.clock = clock
        #: Changes given up on that may still land: (tier, key) -> the call.
        self._late: dict[tuple[int, str], asyncio.Future[object]] = {}

    def degraded(self, index: int) -> bool:
        """Tier ``index`` failed within its retry window: not asked, not written."""
        return self.slots[index].degraded_until > self.clock()

    async def call(
        self,
        slot: TierSlot,
        call: Awaitable[object],
        changes: Sequence[str] = (),
        op: str = "",
    ) -> BytesLike | None:
        """Run a tier operation within the tier's deadline; record failures and
        successes (one place, STYLE 8). A call past its deadline is the tier
        being unavailable: degraded like any failure, so the next calls skip
        it at once instead of each waiting the deadline out.

        ``changes``: the keys the call writes or deletes. A call given up on
        (past its deadline, or its caller cancelled) may still land: a thread
        (LMDB's) cannot be stopped, a request sent to Redis or S3 may still be
        applied. Until it ends, another change of those keys in that tier is
        refused (TierUnavailable), so that a late delete or put never lands on
        what a newer incarnation of the block wrote there.

        ``op``: what its time is counted as in the tier's latency (``read``,
        ``write``, ``delete``); by default a call with ``changes`` writes and
        one without reads. A call past its deadline counts the deadline."""
        deadline = slot.tier.deadline_s
        refusal = None
        if slot.degraded_until > self.clock():
            # Failed a moment ago: not asked again until its retry time, so
            # one request never waits out a hung tier's deadline twice.
            refusal = (
                f"{slot.kind}: unavailable ({slot.last_error}); retried after "
                f"{slot.degraded_until - self.clock():.1f} s"
            )
        elif late := [k for k in changes if (id(slot), k) in self._late]:
            refusal = f"{slot.kind}: an earlier change of {late[0]} is still under way"
        if refusal is not None:
            if inspect.iscoroutine(call):
                call.close()  # made by the caller, never to run
            raise TierUnavailable(refusal, tier=slot.kind)
        started = time.perf_counter()
        try:
            if deadline is None:
                result = await call  # memory: nothing lands late
            elif not changes:
                # A read given up on changes nothing when it ends late: no
                # task to keep, the wait is just cut (the hot GET path).
                try:
                    async with asyncio.timeout(deadline):
                        result = await call
                except TimeoutError:
                    raise TierUnavailable(
                        f"{slot.kind}: no answer within its deadline of {deadline:g} s",
                        tier=slot.kind,
                    ) from None
            else:
                task = asyncio.ensure_future(call)
                try:
                    done, _ = await asyncio.wait({task}, timeout=deadline)
                finally:
                    if not task.done():
                        self._given_up(slot, task, changes)
                if not done:
                    raise TierUnavailable(
                        f"{slot.kind}: no answer within its deadline of {deadline:g} s",
                        tier=slot.kind,
                    )
                result = task.result()
        except TierUnavailable as exc:
            slot.failures += 1
            slot.last_error = exc.detail
            slot.degraded_until = self.clock() + self.retry_after_s
            self.stats.tier_errors += 1
            log.warning("tier %s unavailable: %s", slot.kind, exc.detail)
            raise
        finally:
            slot.latency[op or ("write" if changes else "read")].observe(
                time.perf_counter() - started
            )
        if slot.degraded_until:
            log.info("tier %s recovered", slot.kind)
            slot.degraded_until = 0.0
        return result  # type: ignore[return-value]

    def _given_up(
        self, slot: TierSlot, task: asyncio.Future[object], changes: Sequence[str]
    ) -> None:
        """A call nobody waits for any more: its keys stay fenced until it ends."""
        fenced = [(id(slot), key) for key in changes]
        for name in fenced:
            self._late[name] = task

        def ended(done: asyncio.Future[object]) -> None:
            for name in fenced:
                if self._late.get(name) is done:
                    del self._late[name]
            failed = None if done.cancelled() else done.exception()
            if failed is not None:
                log.info("a %s call given up on ended: %s", slot.kind, describe(failed))

        task.add_done_callback(ended)

    async def delete_quietly(self, slot: TierSlot, *keys: str) -> None:
        """Delete ``keys`` from a tier (one batch call for several); a failure
        is logged, not raised. A change of those keys given up on earlier is
        waited for first (a little): deleted before it landed, it would
        leave an orphan behind."""
        late = {t for k in keys if (t := self._late.get((id(slot), k))) is not None}
        if late:
            await asyncio.wait(late, timeout=slot.tier.deadline_s)
        try:
            if len(keys) == 1:
                await self.call(slot, slot.tier.delete(keys[0]), keys, "delete")
            elif keys:
                await self.call(slot, slot.tier.delete_many(keys), keys, "delete")
        except Exception as exc:
            # The data is already unaccounted for; an orphan costs space, not
            # correctness (recover() finds and re-adopts it at the next start).
            log.warning(
                "could not delete %s from %s (%s); it stays orphaned",
                ", ".join(keys),
                slot.kind,
                exc,
            )

    async def stored_form(
        self, slot: TierSlot, ref: BlockRef, first: int, last: int, plain: BytesLike
    ) -> BytesLike:
        """What a tier stores for a segment: a persistent tier's is sealed or
        checksummed (see :mod:`.crypto`), so that what it gives back is checked
        against what was written, even after a restart."""
        if not slot.tier.persistent:
            return plain
        name = ref.segment_name(first, last)
        # Large segments are sealed off the event loop (AES-GCM, zstd, the checksum).
        if len(memoryview(plain)) >= OFFLOAD_OCTETS:
            return await asyncio.to_thread(self.sealer.seal, name, plain)
        return self.sealer.seal(name, plain)
