"""Choosing an instance for a request (PL1, PL2): the draft's cost, per candidate.

    cost(i) = wait_us(i) + min( fetch_us(i) + recompute_us(unmatched, i),
                                recompute_us(all, i) )

``fetch_us`` comes from :func:`kvstore.protocol.placement.plan_groups` over
the replica records a lookup returned and the instance's reported links;
``wait_us`` is the instance's queue times a mean service time. Only active
instances are candidates (S4); the cheapest wins, ties to the least loaded.

An instance that holds a prefix of the request's blocks in its own memory
(residency, kvstore.protocol.residency: a vLLM pod's GPU cache) neither
fetches nor recomputes those: they are the draft's blocks "already
resident at i", of fetch_us 0, and only the rest of the request is costed
there (docs/controller.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    #: Tokens of the request already in the instance's own memory (residency).
    resident_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        # JSON has no infinity: an estimate that cannot be made is null
        # (x - x is 0 exactly for finite x: NaN for infinities and NaN).
        wait, fetch, recompute, cost = self.wait_us, self.fetch_us, self.recompute_us, self.cost_us
        out: dict[str, Any] = {
            "instance": self.instance,
            "wait_us": wait if wait - wait == 0 else None,
            "fetch_us": fetch if fetch is not None and fetch - fetch == 0 else None,
            "recompute_us": recompute if recompute - recompute == 0 else None,
            "cost_us": cost if cost - cost == 0 else None,
        }
        if self.resident_tokens:
            out["resident_tokens"] = self.resident_tokens
        return out


def rank(
    instances: Sequence[InstanceStatus],
    groups: Sequence[tuple[Sequence[ReplicaShape], int]],
    *,
    total_tokens: int,
    block_tokens: int,
    mean_service_us: float,
    resident: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Every active instance with its estimates, cheapest first (PL2).
    ``resident``: the leading blocks each instance holds itself (residency).

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
    warm = resident or {}
    for status in instances:
        fetch: float | None = 0.0
        held = min(warm.get(status.instance, 0) * block_tokens, total_tokens)
        rest, fetched = total_tokens - held, matched_tokens
        if held:
            # Its own prefix is free: the matched blocks past it are fetched.
            beyond = _past(groups, held // block_tokens)
            fetched = min(sum(n for _, n in beyond) * block_tokens, rest)
            fetch = _fetch_us(plan_groups(beyond, status, memo)) if beyond else 0.0
        elif matched:
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
            matched_tokens=fetched,
            total_tokens=rest,
            prefill_tokens_per_s=rate,
            queued=queued,
            mean_service_us=mean_service_us,
        )
        candidate = Candidate(
            status.instance,
            wait_us(queued, mean_service_us),
            fetch,
            recompute_us(rest, rate),
            cost,
            held,
        )
        # Cheapest first, ties to the least loaded, then by name.
        keyed.append(((cost, queued, status.running, status.instance), candidate))
    keyed.sort(key=_first)
    return [candidate for _, candidate in keyed]


def _past(
    groups: Sequence[tuple[Sequence[ReplicaShape], int]], skip: int
) -> list[tuple[Sequence[ReplicaShape], int]]:
    """``groups`` without their first ``skip`` blocks."""
    out = []
    for shapes, count in groups:
        if skip >= count:
            skip -= count
            continue
        out.append((shapes, count - skip))
        skip = 0
    return out


def _first(item: tuple[Any, Candidate]) -> Any:
    return item[0]


def _fetch_us(plan: FetchPlan | None) -> float | None:
    return None if plan is None else plan.fetch_us


def choose(candidates: Sequence[Candidate]) -> Candidate:
    if not candidates:
        raise InvalidState("no active instance can take the request (S4)")
    return candidates[0]
