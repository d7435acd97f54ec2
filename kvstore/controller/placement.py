"""Choosing an instance for a request (PL1, PL2): the draft's cost, per candidate.

    cost(i) = wait_us(i) + min( fetch_us(i) + recompute_us(unmatched, i),
                                recompute_us(all, i) )

``fetch_us`` comes from :func:`kvstore.protocol.placement.plan_groups` over
the replica records a lookup returned and the instance's reported links;
``wait_us`` is the instance's queue times a mean service time. Only active
instances are candidates (S4); the cheapest wins, ties to the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

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


class Candidate(NamedTuple):
    """One active instance's estimates (PL1). A named tuple: a placement
    makes one per active instance, and a frozen dataclass's constructor was
    a sixth of a 64-instance placement."""

    instance: str
    wait_us: float
    fetch_us: float | None
    recompute_us: float
    cost_us: float

    def to_json(self) -> dict[str, Any]:
        # JSON has no infinity: an estimate that cannot be made is null
        # (x - x is 0 exactly for finite x: NaN for infinities and NaN).
        wait, fetch, recompute, cost = self.wait_us, self.fetch_us, self.recompute_us, self.cost_us
        return {
            "instance": self.instance,
            "wait_us": wait if wait - wait == 0 else None,
            "fetch_us": fetch if fetch is not None and fetch - fetch == 0 else None,
            "recompute_us": recompute if recompute - recompute == 0 else None,
            "cost_us": cost if cost - cost == 0 else None,
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
    memo: ReadMemo = {}
    # A plan depends on the instance only through its links, unless it holds
    # some of the blocks itself: instances with the same links (a rack's,
    # a pool's) share one plan.
    holding = {shape.holder for shapes, _ in groups for shape in shapes}
    plans: dict[tuple[Link, ...], float | None] = {}
    keyed = []
    for status in instances:
        fetch: float | None = 0.0
        if matched:
            links = status.links
            if status.instance in holding:
                fetch = _fetch_us(plan_groups(groups, status, memo))
            elif links in plans:
                fetch = plans[links]
            else:
                fetch = plans[links] = _fetch_us(plan_groups(groups, status, memo))
        rate, queued = status.prefill_tokens_per_s, status.queued
        cost = placement_cost(
            fetch_us=fetch,
            matched_tokens=matched_tokens,
            total_tokens=total_tokens,
            prefill_tokens_per_s=rate,
            queued=queued,
            mean_service_us=mean_service_us,
        )
        candidate = Candidate(
            status.instance,
            wait_us(queued, mean_service_us),
            fetch,
            recompute_us(total_tokens, rate),
            cost,
        )
        # Cheapest first, ties to the least loaded, then by name.
        keyed.append(((cost, queued, status.running, status.instance), candidate))
    keyed.sort(key=_first)
    return [candidate for _, candidate in keyed]


def _first(item: tuple[Any, Candidate]) -> Any:
    return item[0]


def _fetch_us(plan: FetchPlan | None) -> float | None:
    return None if plan is None else plan.fetch_us


def choose(candidates: Sequence[Candidate]) -> Candidate:
    if not candidates:
        raise InvalidState("no active instance can take the request (S4)")
    return candidates[0]
