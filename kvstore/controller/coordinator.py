"""Resharding a sequence-sharded context from map version v to v+1 (RS2-RS6).

The PC computes each member's plan (:func:`.reshard.plan_reshard`: ranges
that stay are retained, never moved, RS3), marks the reshard in progress in
its state (one at a time per map; version v stays authoritative, RS5), and
sends every instance of either version its plan (``POST reshard``). An
instance answers 200 once it has loaded its ``fetch`` ranges (RS4). When all
have answered within ``deadline_ms`` the PC makes v+1 current and sends
``{"map", "commit": v+1}`` to all (RS5: they then release what moved away);
otherwise it sends ``{"map", "abort": v+1}`` (RS6: they drop what they
fetched) and v stays. A member that misses the commit or abort is reported,
not retried here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from ..protocol.control import ReshardAbort, ReshardCommit, ReshardMessage, ShardMap
from ..protocol.problems import BadGateway, KvspError
from ..seams import Instances
from .reshard import plan_reshard
from .state import ControllerState

log = logging.getLogger("kvstore.controller")


@dataclass(slots=True)
class ReshardOutcome:
    map: str
    version: int  # the version current after the reshard
    committed: bool
    acknowledged: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # member -> why
    unreached: dict[str, str] = field(default_factory=dict)  # missed the commit/abort

    def to_json(self) -> dict[str, Any]:
        return {
            "map": self.map,
            "version": self.version,
            "committed": self.committed,
            "acknowledged": self.acknowledged,
            "missing": self.missing,
            "unreached": self.unreached,
        }


class ReshardCoordinator:
    def __init__(self, state: ControllerState, instances: Instances) -> None:
        """``instances``: an :class:`~kvstore.client.InstanceClient`."""
        self.state = state
        self.instances = instances

    async def _send_all(
        self, messages: dict[str, ReshardMessage], timeout_s: float | None = None
    ) -> dict[str, str]:
        """Send each member its message; the members that did not answer 200, and why."""

        async def one(member: str, message: ReshardMessage) -> str | None:
            try:
                await asyncio.wait_for(self.instances.reshard(member, message), timeout_s)
            except TimeoutError:
                return "no answer by the deadline"
            except KvspError as exc:
                return exc.detail
            return None

        answers = await asyncio.gather(*(one(m, msg) for m, msg in messages.items()))
        return {m: why for m, why in zip(messages, answers, strict=True) if why is not None}

    async def _abandon(self, target: ShardMap, members: list[str]) -> None:
        with contextlib.suppress(KvspError):
            await self.state.end_reshard(target, committed=False)
        abort = ReshardAbort(target.map, target.version)
        await self._send_all(dict.fromkeys(members, abort), timeout_s=10.0)

    async def reshard(self, target: ShardMap, deadline_ms: int) -> ReshardOutcome:
        entry = await self.state.shard_map(target.map)
        plans = plan_reshard(entry.current, target, deadline_ms)  # RS7: 409 on a mismatch
        # Held a little past the deadline: a commit or abort is on its way.
        await self.state.begin_reshard(target, hold_s=deadline_ms / 1000 + 30)
        outcome = ReshardOutcome(target.map, entry.current.version, committed=False)
        try:
            missing = await self._send_all(dict(plans), timeout_s=deadline_ms / 1000)
        except BaseException:
            # RS6 also when cancelled: members drop what they fetched for v+1.
            await asyncio.shield(self._abandon(target, list(plans)))
            raise
        outcome.acknowledged = sorted(set(plans) - set(missing))
        outcome.missing = missing
        committed = not missing
        await self.state.end_reshard(target, committed=committed)
        final: ReshardMessage = (
            ReshardCommit(target.map, target.version)
            if committed
            else ReshardAbort(target.map, target.version)
        )
        outcome.unreached = await self._send_all(dict.fromkeys(plans, final), timeout_s=10.0)
        outcome.committed = committed
        outcome.version = target.version if committed else entry.current.version
        log.info(
            "map %s: reshard to %d %s",
            target.map,
            target.version,
            "committed" if committed else f"aborted ({sorted(missing)})",
        )
        return outcome


class ReshardAborted(BadGateway):
    title = "Reshard aborted"
