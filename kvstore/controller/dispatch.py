"""Where a request goes, and what the PC does about it (PL1-PL3, PF1).

The placer ranks the active instances by cost (PL1). :class:`Dispatch` holds
the policy around that ranking, so that ``POST place`` only parses and
answers:

* **start** (PL3): when no instance fits (none active, or the cheapest costs
  more than ``start_above_ms``) and a starter is configured, an instance is
  started and the request goes there, if the policy lets it serve the scope;
* **choose**: otherwise the cheapest candidate (409 when there is none, S4);
* **prefetch** (PL2, PF1): with ``prefetch`` on and blocks matched, the
  chosen instance gets a directive to load them at once, unless it stopped
  being active since it was ranked (S4). Advisory: a refused directive leaves
  the placement as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..protocol.control import Link
from ..protocol.problems import KvspError
from ..protocol.records import LookupRequest
from ..seams import Instances
from ..settings import ControllerSettings
from .migrate import MigrationCounters
from .placement import choose
from .placer import Placement, Placer, directive
from .starter import InstanceStarter
from .state import ControllerState

log = logging.getLogger("kvstore.controller")


@dataclass(slots=True)
class ControllerCounters(MigrationCounters):
    """OPS1 figures of the PC."""

    placements: int = 0
    prefetches: int = 0
    prefetch_failures: int = 0
    instances_started: int = 0


@dataclass(slots=True)
class Decision:
    """The answer of ``POST place``: the ranking, the instance, what was done."""

    placement: Placement
    instance: str
    started: bool = False
    #: The directive sent (or why none was), when prefetching is on.
    prefetch: dict[str, Any] | None = field(default=None)
    prefetched: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "matched": self.placement.matched,
            "index": self.placement.index,
            "candidates": [c.to_json() for c in self.placement.candidates],
            "instance": self.instance,
        }
        if self.started:
            out["started"] = True
        if self.prefetched:
            out["prefetch"] = self.prefetch
        return out


class Dispatch:
    """The PC's placement policy over its placer (see the module's docstring)."""

    def __init__(
        self,
        settings: ControllerSettings,
        placer: Placer,
        state: ControllerState,
        counters: ControllerCounters,
        eligible: Callable[[str, str], bool],
        *,
        instances: Instances | None = None,
        starter: InstanceStarter | None = None,
    ) -> None:
        """Policy from ``settings``: ``start_above_ms`` and the ``prefetch_*`` keys."""
        self.settings, self.placer, self.state = settings, placer, state
        self.counters, self.eligible = counters, eligible
        self.instances, self.starter = instances, starter

    def fits(self, placement: Placement) -> bool:
        """PL3: some instance runs at an acceptable cost."""
        if not placement.candidates:
            return False
        best = placement.candidates[0]
        above_ms = self.settings.start_above_ms
        return above_ms <= 0 or best.cost_us <= above_ms * 1000

    async def place(
        self, query: LookupRequest, tokens: int, block_tokens: int, request_ref: str | None
    ) -> Decision:
        placement = await self.placer.place(
            query.scope_id, query.compat_id, query.block_keys, tokens, block_tokens
        )
        instance, started = None, False
        if not self.fits(placement) and self.starter is not None:
            # PL3: nothing acceptable runs; start an instance and go there.
            launched = await self.starter.start(query.scope_id, query.compat_id, request_ref)
            self.counters.instances_started = self.starter.launched
            if launched is not None and self.eligible(launched, query.scope_id):
                instance, started = launched, True
            elif launched is not None:
                log.error("started %s may not serve scope %s (policy)", launched, query.scope_id)
        if instance is None:
            instance = choose(placement.candidates).instance  # 409 if none (S4)
        self.counters.placements += 1
        decision = Decision(placement, instance, started)
        if (
            self.instances is not None
            and self.settings.prefetch
            and placement.matched
            and instance not in placement.no_directives  # (a bridged engine has no API)
        ):
            decision.prefetched = True
            if not started and instance not in {s.instance for s in await self.state.active()}:
                # S4: it expired or began draining since it was chosen.
                decision.prefetch = {"error": "the instance is no longer active"}
            else:
                links = placement.links.get(instance, ())
                decision.prefetch = await self.send_prefetch(
                    self.instances, placement, instance, links, query, request_ref
                )
        return decision

    async def send_prefetch(
        self,
        instances: Instances,
        placement: Placement,
        instance: str,
        links: Sequence[Link],
        query: LookupRequest,
        request_ref: str | None,
    ) -> dict[str, Any] | None:
        """PL2, PF1: the chosen (active, S4) or just started (PL3) instance
        starts loading at once."""
        found = directive(
            placement,
            instance,
            links,
            query.block_keys,
            query.scope_id,
            query.compat_id,
            deadline_ms=self.settings.prefetch_deadline_ms,
            lease_ms=self.settings.prefetch_lease_ms,
            request_ref=request_ref,
        )
        if found is None:
            return None  # everything matched is resident there already
        try:
            location = await instances.prefetch(instance, found)
        except KvspError as exc:
            self.counters.prefetch_failures += 1
            log.warning("prefetch directive to %s failed: %s", instance, exc.detail)
            return {"directive": found.directive, "error": exc.detail}
        self.counters.prefetches += 1
        return {"directive": found.directive, "location": location, "blocks": len(found.blocks)}
