"""Placement cost estimates (PL1), as pure functions of records.

    fetch_us(i)     = max over sources s of ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)
    wait_us(i)      = queued(i) * mean service time at i
    cost(i)         = wait_us(i) + min( fetch_us(i) + recompute_us(unmatched), recompute_us(all) )

``8 * octets / mbit_per_s`` is microseconds. For layers a source keeps in a
tier with a ``read_mbit_per_s``, the rate is the lower of the link and the
tier (the draft names storage tiers; taking the minimum for every tier that
states a rate is the same rule and never overestimates speed).

Only a few members of a Replica Record matter here (holder, size, residency,
layer count): a :class:`ReplicaShape`. The blocks of one prompt mostly have
replicas of identical shapes, so a plan is computed over *groups* of blocks
with the same shapes, each counted once: ranking 64 instances over an 8k-key
lookup costs a few groups per instance, not 24k records.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .control import InstanceStatus, Link
from .records import ReplicaRecord, ReplicaShape, decode_shapes

__all__ = [
    "FetchPlan",
    "ReplicaShape",
    "ShapeGroups",
    "decode_shapes",
    "placement_cost",
    "plan_fetch",
    "plan_groups",
    "read_us",
    "recompute_us",
    "replica_read_us",
    "shape_groups",
    "transfer_us",
    "wait_us",
]


def transfer_us(octets: float, mbit_per_s: float) -> float:
    """Microseconds to move ``octets`` at ``mbit_per_s``."""
    return 8.0 * octets / mbit_per_s


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float:
    """Microseconds to prefill ``tokens`` (infinite when the instance reports no rate)."""
    if tokens <= 0:
        return 0.0
    if prefill_tokens_per_s <= 0:
        return math.inf
    return 1e6 * tokens / prefill_tokens_per_s


def wait_us(queued: int, mean_service_us: float) -> float:
    return queued * mean_service_us


def read_us(shape: ReplicaShape, link: Link) -> float:
    """Time to read a replica of ``shape`` over ``link``, tier by tier, without the RTT."""
    if not shape.residency:
        return transfer_us(shape.size, link.mbit_per_s)
    total_layers = sum(r.layer_count for r in shape.residency)
    us = 0.0
    for segment in shape.residency:
        rate = link.mbit_per_s
        if segment.read_mbit_per_s is not None:
            rate = min(rate, segment.read_mbit_per_s)
        # Layers of one block have equal size, so a segment's share of the
        # octets is its share of the layers.
        us += transfer_us(shape.size * segment.layer_count / total_layers, rate)
    return us


def replica_read_us(record: ReplicaRecord, link: Link) -> float:
    """Time to read one replica over ``link``, tier by tier, without the RTT."""
    return read_us(ReplicaShape.of(record), link)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """The estimate, and each source's share of it (PL1)."""

    fetch_us: float
    sources: Mapping[str, float]  # holder -> microseconds of its transfers incl. RTT


#: Blocks whose replicas have these shapes, and how many such blocks.
ShapeGroups = Iterable[tuple[Sequence[ReplicaShape], int]]


def shape_groups(
    replicas: Sequence[Sequence[ReplicaRecord]], resident: Collection[str] = ()
) -> list[tuple[tuple[ReplicaShape, ...], int]]:
    """Matched blocks grouped by the shapes of their replicas, blocks in
    ``resident`` (keys already at the instance) left out. Compute it once per
    lookup and pass it to :func:`plan_groups` for every instance."""
    counts: Counter[tuple[ReplicaShape, ...]] = Counter()
    for records in replicas:
        if records and records[0].block_key not in resident:
            counts[tuple(ReplicaShape.of(r) for r in records)] += 1
    return list(counts.items())


#: Read times already computed, by shape (identity) and link rate: ranking
#: many instances with equal links over one lookup reads each shape once.
ReadMemo = dict[tuple[int, float], "float | None"]


def plan_groups(
    groups: ShapeGroups, status: InstanceStatus, memo: ReadMemo | None = None
) -> FetchPlan | None:
    """Estimate fetch_us for instance ``status`` to load the grouped blocks.

    For each block the replica with the cheapest RTT + read over a known link
    is chosen, among replicas that hold every layer (a record whose residency
    covers fewer layers than its layer_digests list is partial); a replica
    held by the instance itself makes the block resident (free). Transfers
    from one source add up, sources proceed in parallel (the max). Returns
    None when some block has no whole replica reachable over a reported link.
    """
    links = {link.holder: link for link in status.links}
    per_source_us: dict[str, float] = {}
    # By identity: hashing a shape costs more than reading it once too often
    # (``memo`` is valid while the caller keeps the groups).
    read: ReadMemo = {} if memo is None else memo
    for shapes, count in groups:
        best: tuple[float, float, str] | None = None
        for shape in shapes:
            if shape.holder == status.instance:
                best = None
                break
            link = links.get(shape.holder)
            if link is None:
                continue
            us = read.get((id(shape), link.mbit_per_s), -1.0)
            if us == -1.0:
                us = read[(id(shape), link.mbit_per_s)] = (
                    read_us(shape, link) if shape.whole else None
                )
            if us is None:
                continue
            cost = links[shape.holder].rtt_us + us
            # Ties go to the lower holder URI: the plan does not depend on
            # the order a state lists replicas in.
            if best is None or cost < best[0] or (cost == best[0] and shape.holder < best[2]):
                best = (cost, us, shape.holder)
        else:
            if best is None:
                return None
            _, us, holder = best
            if holder not in per_source_us:
                per_source_us[holder] = links[holder].rtt_us
            per_source_us[holder] += count * us
    return FetchPlan(max(per_source_us.values(), default=0.0), per_source_us)


def plan_fetch(
    replicas: Sequence[Sequence[ReplicaRecord]],
    status: InstanceStatus,
    resident: Collection[str] = (),
) -> FetchPlan | None:
    """:func:`plan_groups` over the records of a lookup answer: ``replicas[i]``
    lists the records of matched block i."""
    return plan_groups(shape_groups(replicas, resident), status)


def placement_cost(
    *,
    fetch_us: float | None,
    matched_tokens: int,
    total_tokens: int,
    prefill_tokens_per_s: float,
    queued: int = 0,
    mean_service_us: float = 0.0,
) -> float:
    """cost(i) of PL1; ``fetch_us=None`` means the matched blocks cannot be fetched."""
    rate = prefill_tokens_per_s
    everything = recompute_us(total_tokens, rate)
    if fetch_us is None:
        loading = everything
    else:
        loading = min(fetch_us + recompute_us(total_tokens - matched_tokens, rate), everything)
    return wait_us(queued, mean_service_us) + loading
