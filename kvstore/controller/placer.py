"""Placing work: an IS lookup, the draft's cost per active instance, and the
prefetch directive for the chosen one (PL1, PL2, PF1, PF2).

Used by ``POST place`` and by the migration of sessions off failed
instances (CK5). The lookup asks the IS for replica shapes only (ours); an
IS that answers with records (another implementation) works the same.
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..protocol.control import Link
from ..protocol.keys import PackedKeys
from ..protocol.placement import read_us
from ..protocol.problems import KvspError
from ..protocol.records import (
    LookupRequest,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
    ReplicaShape,
)
from ..seams import Lookups
from .placement import Candidate, rank
from .state import ControllerState

log = logging.getLogger("kvstore.controller")

#: Consecutive matched keys whose replicas have these shapes, and how many.
Runs = list[tuple[tuple[ReplicaShape, ...], int]]


@dataclass(slots=True)
class Placement:
    candidates: list[Candidate]  # cheapest first
    matched: int
    index: str  # "ok", "unavailable" (placed without cache, P4) or "unused"
    runs: Runs = field(default_factory=list)
    #: The candidates' reported links (for their prefetch directives).
    links: dict[str, tuple[Link, ...]] = field(default_factory=dict)
    #: Leading blocks each instance holds in its own memory (residency).
    resident: dict[str, int] = field(default_factory=dict)
    #: Candidates that take no prefetch directive (an engine bridged by
    #: ``kvstore events``, which reports its status without the KVSP API).
    no_directives: frozenset[str] = frozenset()


def _runs(answer: LookupResponse) -> Runs:
    if answer.shapes is not None:
        return [(answer.shapes.groups[g], n) for g, n in answer.shapes.runs]
    per_key = (tuple(ReplicaShape.of(r) for r in records) for records in answer.replicas)
    return [(shapes, len(list(run))) for shapes, run in itertools.groupby(per_key)]


class Placer:
    def __init__(
        self,
        state: ControllerState,
        index: Lookups | None,
        mean_service_us: float = 0.0,
        eligible: Callable[[str, str], bool] | None = None,
    ) -> None:
        """``index``: an :class:`~kvstore.client.IndexClient`, or None (recompute
        only); ``eligible(instance, scope_id)``: whether the instance may serve
        the scope (SEC1: may write its checkpoints and replicas), all if None."""
        self.state = state
        self.index = index
        self.mean_service_us = mean_service_us
        self.eligible = eligible

    async def place(
        self,
        scope_id: str,
        compat_id: str,
        block_keys: Sequence[str],
        total_tokens: int,
        block_tokens: int,
        exclude: Collection[str] = (),
    ) -> Placement:
        """Every active instance but ``exclude``, ranked by cost (S4, PL2)."""
        runs: Runs = []
        resident: dict[str, int] = {}
        index_state = "unused"
        if self.index is not None and block_keys:
            try:
                keys = block_keys if isinstance(block_keys, PackedKeys) else tuple(block_keys)
                query = LookupRequest(scope_id, compat_id, keys, shapes_only=True)
                answer = await self.index.lookup(query)
                runs, index_state = _runs(answer), "ok"
                resident = {r.instance: r.prefix_blocks for r in answer.resident}
            except KvspError as exc:
                # The index is advisory (P4): without it, every instance
                # recomputes, and the placement still happens.
                log.warning("index lookup failed, placing without cache: %s", exc.detail)
                index_state = "unavailable"
        instances = [
            s
            for s in await self.state.active()
            if s.instance not in exclude
            and (self.eligible is None or self.eligible(s.instance, scope_id))
        ]
        candidates = rank(
            instances,
            runs,
            total_tokens=total_tokens,
            block_tokens=block_tokens,
            mean_service_us=self.mean_service_us,
            resident=resident,
        )
        links = {s.instance: s.links for s in instances}
        closed = frozenset(s.instance for s in instances if not s.accepts_directives)
        return Placement(
            candidates, sum(n for _, n in runs), index_state, runs, links, resident, closed
        )


def directive(
    placement: Placement,
    instance: str,
    links: Sequence[Link],
    block_keys: Sequence[str],
    scope_id: str,
    compat_id: str,
    *,
    deadline_ms: int,
    lease_ms: int,
    request_ref: str | None = None,
) -> PrefetchDirective | None:
    """The prefetch directive for ``instance`` (PF1, PF2): every matched block
    it does not hold, with its whole replicas' holders cheapest first over the
    ``links`` it reported (in the records' order without); None when there is
    nothing to load."""
    by_holder = {link.holder: link for link in links}

    def cost(shape: ReplicaShape) -> float:
        link = by_holder.get(shape.holder)
        return math.inf if link is None else link.rtt_us + read_us(shape, link)

    blocks: list[PrefetchBlock] = []
    keys = iter(block_keys)
    held = placement.resident.get(instance, 0)  # in its own memory already
    position = 0
    for shapes, count in placement.runs:
        run = list(itertools.islice(keys, count))[max(0, held - position) :]
        position += count
        if any(s.holder == instance for s in shapes):
            continue  # resident at the instance already
        sources = tuple(dict.fromkeys(s.holder for s in sorted(shapes, key=cost) if s.whole))
        if sources:
            blocks.extend(PrefetchBlock(key, sources) for key in run)
    if not blocks:
        return None
    return PrefetchDirective(
        directive=str(uuid.uuid4()),
        scope_id=scope_id,
        compat_id=compat_id,
        blocks=tuple(blocks),
        deadline_ms=deadline_ms,
        lease_ms=lease_ms,
        request_ref=request_ref,
    )
