"""Choosing an instance for a request (PL1, PL2): the draft's cost, per candidate.

    cost(i) = wait_us(i) + min( fetch_us(i) + recompute_us(unmatched, i),
                                recompute_us(all, i) )

``fetch_us`` comes from :func:`kvstore.protocol.placement.plan_groups` over
the replica records a lookup returned and the instance's reported links;
``wait_us`` is the instance's queue times a mean service time. Only active
instances are candidates (S4); the cheapest wins, ties to the least loaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol.control import InstanceStatus, Link
from ..protocol.placement import (
    FetchPlan,
    ReadMemo,
    ReplicaShape,
    placement_cost,
    plan_groups,
    recompute_us,
    wait_us,
)
from ..protocol.problems import InvalidState


@dataclass(frozen=True, slots=True)
class Candidate:
    instance: str
    wait_us: float
    fetch_us: float | None
    recompute_us: float
    cost_us: float

    def to_json(self) -> dict[str, Any]:
        # JSON has no infinity: an estimate that cannot be made is null.
        def finite(value: float | None) -> float | None:
            return value if value is not None and math.isfinite(value) else None

        return {
            "instance": self.instance,
            "wait_us": finite(self.wait_us),
            "fetch_us": finite(self.fetch_us),
            "recompute_us": finite(self.recompute_us),
            "cost_us": finite(self.cost_us),
        }


def rank(
    instances: Sequence[InstanceStatus],
    groups: Sequence[tuple[Sequence[ReplicaShape], int]],
    *,
    total_tokens: int,
    block_tokens: int,
    mean_service_us: float,
) -> list[Candidate]:
    """Every active instance with its estimates, cheapest first (PL2).

    ``groups``: the matched blocks grouped by the shapes of their replicas
    (:func:`~kvstore.protocol.placement.shape_groups` of a lookup's records,
    or :meth:`~kvstore.protocol.records.ShapeRuns.counts` of a shapes-only
    answer)."""
    matched = sum(count for _, count in groups)
    matched_tokens = min(matched * block_tokens, total_tokens)
    out = []
    memo: ReadMemo = {}
    # A plan depends on the instance only through its links, unless it holds
    # some of the blocks itself: instances with the same links (a rack's,
    # a pool's) share one plan.
    holding = {shape.holder for shapes, _ in groups for shape in shapes}
    plans: dict[tuple[Link, ...], FetchPlan | None] = {}
    for status in instances:
        plan = None
        if matched and status.instance in holding:
            plan = plan_groups(groups, status, memo)
        elif matched:
            if status.links in plans:
                plan = plans[status.links]
            else:
                plan = plans[status.links] = plan_groups(groups, status, memo)
        fetch = plan.fetch_us if plan is not None else (0.0 if not matched else None)
        cost = placement_cost(
            fetch_us=fetch,
            matched_tokens=matched_tokens,
            total_tokens=total_tokens,
            prefill_tokens_per_s=status.prefill_tokens_per_s,
            queued=status.queued,
            mean_service_us=mean_service_us,
        )
        out.append(
            Candidate(
                instance=status.instance,
                wait_us=wait_us(status.queued, mean_service_us),
                fetch_us=fetch,
                recompute_us=recompute_us(total_tokens, status.prefill_tokens_per_s),
                cost_us=cost,
            )
        )
    by_load = {s.instance: (s.queued, s.running) for s in instances}
    return sorted(out, key=lambda c: (c.cost_us, by_load[c.instance], c.instance))


def choose(candidates: Sequence[Candidate]) -> Candidate:
    if not candidates:
        raise InvalidState("no active instance can take the request (S4)")
    return candidates[0]
