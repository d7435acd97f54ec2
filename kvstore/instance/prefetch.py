"""Carrying out prefetch directives (PF1-PF5).

A directive runs in the background (it never blocks admitted work, PF1).
For each block in order it does not hold, the instance takes a lease of
``lease_ms`` at one listed source so the block is not evicted meanwhile
(LE1, LE2), fetches it (the holder streams its layers in ascending order),
verifies it (Repr-Digest; with the replica's record from the IS, every
layer digest and the replica digest, BL6), places it in its own tiers,
publishes its new replica, and releases the lease. A source that fails
(404, a digest mismatch, unreachable) is a miss: the next source is tried
(P4, BL8). At the deadline it stops and reports ``partial`` (PF4); the
request then recomputes the rest. Pending directives are bounded (PF5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.container import decode
from ..protocol.control import Link
from ..protocol.problems import (
    BadRequest,
    DigestMismatch,
    KvspError,
    LeaseQuota,
    NotFound,
    PreconditionFailed,
)
from ..protocol.records import LookupRequest, PrefetchDirective, PrefetchStatus, ReplicaRecord
from ..seams import Holders, Lookups
from ..storage import BlockRef, TieredStore

log = logging.getLogger("kvstore.instance")


MAX_METERS = 256


@dataclass
class LinkMeter:
    """A holder's round trip and transfer rate, as moving averages: the
    lease request's time is one round trip; a block's GET is one more plus
    its octets at the link's rate."""

    rtt_s: float = 0.0
    mbit_per_s: float = 0.0
    samples: int = 0

    def observe(self, rtt_s: float, get_s: float, octets: int) -> None:
        if get_s <= rtt_s or rtt_s <= 0:
            return  # the lease paid for the connection: no rate to tell
        weight = 1.0 if self.samples == 0 else 0.2
        self.rtt_s += weight * (rtt_s - self.rtt_s)
        # At least a tenth of the GET is transfer: no rate beyond ten times
        # what the whole GET shows.
        transfer = max(get_s - rtt_s, get_s / 10)
        self.mbit_per_s += weight * (8 * octets / transfer / 1e6 - self.mbit_per_s)
        self.samples += 1

    def link(self, holder: str) -> Link:
        return Link(holder, max(self.mbit_per_s, 1e-3), self.rtt_s * 1e6)


class TooManyDirectives(LeaseQuota):
    """PF5, SEC3: the quota of pending directives (429)."""

    title = "Too many pending directives"


@dataclass
class DirectiveRun:
    directive_id: str
    #: The directive while it runs (dropped after: a finished run keeps only
    #: its status, so kept runs stay small).
    directive: PrefetchDirective | None
    state: str = "pending"
    loaded: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    #: What the directive was, to tell a repeat from another one under its id.
    fingerprint: int = 0
    #: The PC's ``request_ref``: the request it was sent ahead of.
    request_ref: str | None = None

    def status(self) -> PrefetchStatus:
        return PrefetchStatus(self.directive_id, self.state, tuple(self.loaded))


class Prefetcher:
    def __init__(
        self,
        store: TieredStore,
        holders: Holders,
        *,
        index: Lookups | None = None,
        max_pending: int = 16,
        keep: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``holders``: a :class:`~kvstore.client.HolderClient` (a block
        placed in ``store`` is published by the holder's publisher, which
        hears of it from the store's events, P1); ``index``:
        an :class:`~kvstore.client.IndexClient` for the records that let every
        layer be verified (BL6), or None (Repr-Digest only)."""
        self.store, self.holders, self.index = store, holders, index
        self.max_pending, self.keep, self.clock = max_pending, keep, clock
        self.runs: OrderedDict[str, DirectiveRun] = OrderedDict()
        #: Measured rtt and rate per holder (what status reports as links).
        self.meters: dict[str, LinkMeter] = {}

    @property
    def pending(self) -> int:
        return sum(1 for r in self.runs.values() if r.state == "pending")

    def submit(self, directive: PrefetchDirective) -> DirectiveRun:
        """Start a directive (the same one again is the same run)."""
        known = self.runs.get(directive.directive)
        fingerprint = hash(directive)
        if known is not None:
            if known.fingerprint != fingerprint:
                raise BadRequest("the directive id names another directive already")
            return known
        if self.pending >= self.max_pending:
            raise TooManyDirectives(f"{self.max_pending} directives are pending (PF5)")
        while len(self.runs) >= self.keep:  # bounded: finished runs go first
            finished = next((k for k, r in self.runs.items() if r.state != "pending"), None)
            if finished is None:
                break
            del self.runs[finished]
        run = self.runs[directive.directive] = DirectiveRun(
            directive.directive,
            directive,
            fingerprint=fingerprint,
            request_ref=directive.request_ref,
        )
        run.task = asyncio.create_task(self._run(run), name=f"prefetch-{directive.directive}")
        return run

    def status(self, directive_id: str) -> PrefetchStatus:
        run = self.runs.get(directive_id)
        if run is None:
            raise NotFound("unknown directive")
        return run.status()

    async def settled(self, request_ref: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the pending directives sent ahead
        of the request ``request_ref``: its prefix is then in the tiers."""
        tasks = [
            r.task
            for r in self.runs.values()
            if r.request_ref == request_ref and r.state == "pending" and r.task is not None
        ]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def load(
        self,
        scope_id: str,
        compat_id: str,
        keys: Sequence[str],
        *,
        deadline_s: float,
        lease_ms: int = 2000,
    ) -> int:
        """Make the longest prefix of ``keys`` resident here: blocks held
        already, then those the IS lists (each from the first of its holders
        that serves it, verified, placed and published as a directive's).
        Returns how many leading keys are resident. Without an IS, only what
        is held counts."""
        held = 0
        for key in keys:
            if BlockRef(compat_id, scope_id, key) not in self.store:
                break
            held += 1
        if held == len(keys) or self.index is None:
            return held
        loaded: list[str] = []
        try:
            async with asyncio.timeout(deadline_s):
                rest = tuple(keys[held:])
                answer = await self.index.lookup(LookupRequest(scope_id, compat_id, rest))
                for key, group in zip(rest[: answer.matched], answer.replicas, strict=False):
                    ref = BlockRef(compat_id, scope_id, key)
                    if ref in self.store:
                        loaded.append(key)
                        continue
                    records = {(r.block_key, r.holder): r for r in group}
                    before = len(loaded)
                    await self._fetch(
                        ref, tuple(r.holder for r in group), records, lease_ms, loaded
                    )
                    if len(loaded) == before:
                        break  # the chain stops at the first block not loaded
        except TimeoutError:
            log.info("loading %d blocks: deadline after %d", len(keys) - held, len(loaded))
        except KvspError as exc:
            log.info("loading %d blocks: %s", len(keys) - held, exc.detail)
        return held + len(loaded)

    def links(self) -> tuple[Link, ...]:
        """The measured path to each holder fetched from (R3 ``links``)."""
        return tuple(meter.link(holder) for holder, meter in self.meters.items())

    async def close(self) -> None:
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()
        for run in self.runs.values():
            if run.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await run.task

    async def _records(self, directive: PrefetchDirective) -> dict[tuple[str, str], ReplicaRecord]:
        if self.index is None or not directive.blocks:
            return {}
        keys = tuple(b.block_key for b in directive.blocks)
        try:
            answer = await self.index.lookup(
                LookupRequest(directive.scope_id, directive.compat_id, keys)
            )
        except KvspError as exc:
            log.info("no records for directive %s: %s", directive.directive, exc.detail)
            return {}
        return {(r.block_key, r.holder): r for group in answer.replicas for r in group}

    async def _run(self, run: DirectiveRun) -> None:
        directive = run.directive
        assert directive is not None
        try:
            await self._blocks(run, directive)
        finally:
            run.directive = None  # only the status is kept

    async def _blocks(self, run: DirectiveRun, directive: PrefetchDirective) -> None:
        try:
            async with asyncio.timeout(directive.deadline_ms / 1000):
                records = await self._records(directive)
                for block in directive.blocks:
                    ref = BlockRef(directive.compat_id, directive.scope_id, block.block_key)
                    if ref in self.store:
                        run.loaded.append(block.block_key)
                    else:
                        await self._fetch(
                            ref, block.sources, records, directive.lease_ms, run.loaded
                        )
        except TimeoutError:
            # PF4: stop at the deadline; the rest is recomputed.
            log.info(
                "directive %s: deadline after %d of %d blocks",
                directive.directive,
                len(run.loaded),
                len(directive.blocks),
            )
            run.state = "partial"
            return
        except Exception:
            log.exception("directive %s failed", directive.directive)
            run.state = "failed"
            return
        if len(run.loaded) == len(directive.blocks):
            run.state = "complete"
        else:
            run.state = "partial" if run.loaded else "failed"

    async def _release(self, source: str, lease_id: str) -> None:
        with contextlib.suppress(KvspError, TimeoutError):
            await asyncio.wait_for(self.holders.release_lease(source, lease_id), 5.0)

    async def _fetch(
        self,
        ref: BlockRef,
        sources: tuple[str, ...],
        records: dict[tuple[str, str], ReplicaRecord],
        lease_ms: int,
        loaded: list[str],
    ) -> None:
        for source in sources:
            record = records.get((ref.block_key, source))
            if self.index is not None and record is None:
                # BL6: with an index, only replicas whose record lets every
                # layer be checked are taken (a Repr-Digest alone is the
                # holder's word for whatever it sends).
                continue
            started = self.clock()
            try:
                grant = await self.holders.lease(
                    source,
                    [ref.block_key],
                    lease_ms,
                    scope_id=ref.scope_id,
                    compat_id=ref.compat_id,
                )
            except KvspError as exc:
                log.info("no lease for %s at %s: %s", ref.block_key[:12], source, exc.detail)
                continue
            leased = self.clock()
            try:
                body = await self.holders.get_block(
                    source, ref.compat_id, ref.scope_id, ref.block_key, record=record
                )
                meter = self.meters.get(source)
                if meter is None and len(self.meters) < MAX_METERS:
                    meter = self.meters[source] = LinkMeter()
                if meter is not None:
                    meter.observe(leased - started, self.clock() - leased, len(body))
                if record is not None and decode(body).codec != record.codec:
                    # The layer digests describe the record's codec only.
                    raise DigestMismatch("the holder answered in another codec")
                with contextlib.suppress(PreconditionFailed):  # placed meanwhile
                    await self.store.put(ref, body)  # P1: published as the store tells
                loaded.append(ref.block_key)
                return
            except KvspError as exc:
                # P4, BL8: a miss at this source; the next one may have it.
                log.info("block %s from %s: %s", ref.block_key[:12], source, exc.detail)
            finally:
                # Even when the deadline cancels this fetch, the lease goes.
                await asyncio.shield(asyncio.ensure_future(self._release(source, grant.lease)))
