"""The instance's status reports to the PC (S1-S6, R3).

Every ``ttl_ms / 3`` (S1) the instance sends its Instance Status Record with
an epoch that is its start time in milliseconds (S2: higher at every restart
without persistent state, as long as the clock does not run backward), its
load, the fill of its fastest tier as ``kv_utilization``, its prefill and
decode rates and its links to holders. It asks to sleep once idle for
``idle_s`` (S3); the PC's answer is the state it holds. A draining instance
reports ``sleeping`` once nothing runs (S5); a sleeping one stays so until
the PC sets it active (S6, through ``PUT state``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..background import Background
from ..protocol.control import InstanceStatus, Link
from ..protocol.lifecycle import InstanceEvent, InstanceState
from ..protocol.problems import KvspError
from ..seams import Controller
from ..storage import TieredStore
from .lifecycle import Lifecycle

log = logging.getLogger("kvstore.instance")


@dataclass
class Load:
    """What the instance is doing, kept up to date by its engine loop."""

    running: int = 0
    queued: int = 0
    batch_size: int = 8
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    links: Sequence[Link] = field(default_factory=tuple)


class StatusReporter(Background):
    task_name = "kvstore-status"

    def __init__(
        self,
        instance_uri: str,
        controller: Controller,
        lifecycle: Lifecycle,
        load: Load,
        store: TieredStore | None = None,
        *,
        ttl_ms: int = 3000,
        idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``controller``: a :class:`~kvstore.client.ControllerClient`;
        ``idle_s``: ask to sleep after this long idle (None: never)."""
        self.instance_uri, self.controller = instance_uri, controller
        self.lifecycle, self.load, self.store = lifecycle, load, store
        self.ttl_ms, self.idle_s, self.clock = ttl_ms, idle_s, clock
        self.epoch = int(time.time() * 1000)  # S2: the start time in ms
        self._idle_since: float | None = None
        self.reports = 0

    def status(self) -> InstanceStatus:
        load = self.load
        now = self.clock()
        idle = load.running == 0 and load.queued == 0
        self._idle_since = (self._idle_since or now) if idle else None
        if idle:
            # S5: nothing left in flight; a draining instance enters sleeping.
            self.lifecycle.apply(InstanceEvent.DRAINED)
        state = self.lifecycle.state
        requested = None
        if (
            state is InstanceState.ACTIVE
            and self.idle_s is not None
            and self._idle_since is not None
            and now - self._idle_since >= self.idle_s
        ):
            requested = "sleeping"  # S3
        utilization = 0.0
        if self.store is not None:
            fastest = self.store.tier_snapshots()[0]
            utilization = min(1.0, fastest.used / max(1, fastest.capacity))
        return InstanceStatus(
            instance=self.instance_uri,
            epoch=self.epoch,
            state=state.value,
            running=load.running,
            queued=load.queued,
            batch_size=load.batch_size,
            kv_utilization=utilization,
            prefill_tokens_per_s=load.prefill_tokens_per_s,
            decode_tokens_per_s=load.decode_tokens_per_s,
            ttl_ms=self.ttl_ms,
            links=tuple(load.links),
            requested_state=requested,
        )

    async def report(self) -> str:
        """One report; returns (and holds) the state the PC answered."""
        changes = self.lifecycle.changes
        answer: str = await self.controller.put_status(self.status())
        self.reports += 1
        if self.lifecycle.changes != changes:
            return answer  # the PC set the state meanwhile: that one stands
        # The PC's state wins (S3: draining accepts a sleep request), but only
        # the PC's PUT state wakes a sleeping instance (S6).
        self.lifecycle.answered(answer)
        return answer

    async def run(self) -> None:
        while True:
            try:
                await self.report()
            except KvspError as exc:
                log.warning("status report to the PC failed: %s", exc.detail)
            await asyncio.sleep(self.ttl_ms / 3000)  # S1: at most ttl/3 apart
