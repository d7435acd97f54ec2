"""Placement cost estimates (PL1), as pure functions of records.

    fetch_us(i)     = max over sources s of ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)
    wait_us(i)      = queued(i) * mean service time at i
    cost(i)         = wait_us(i) + min( fetch_us(i) + recompute_us(unmatched), recompute_us(all) )

``8 * octets / mbit_per_s`` is microseconds. For layers a source keeps in a
tier with a ``read_mbit_per_s``, the rate is the lower of the link and the
tier (the draft names storage tiers; taking the minimum for every tier that
states a rate is the same rule and never overestimates speed).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .control import InstanceStatus, Link
from .records import ReplicaRecord


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


def replica_read_us(record: ReplicaRecord, link: Link) -> float:
    """Time to read one replica over ``link``, tier by tier, without the RTT."""
    if not record.residency:
        return transfer_us(record.size, link.mbit_per_s)
    total_layers = sum(r.layer_count for r in record.residency)
    us = 0.0
    for segment in record.residency:
        rate = link.mbit_per_s
        if segment.read_mbit_per_s is not None:
            rate = min(rate, segment.read_mbit_per_s)
        # Layers of one block have equal size, so a segment's share of the
        # octets is its share of the layers.
        us += transfer_us(record.size * segment.layer_count / total_layers, rate)
    return us


def _whole(record: ReplicaRecord) -> bool:
    """False for a replica known to hold only some layers of its block."""
    if record.layer_digests is None:
        return True
    return sum(r.layer_count for r in record.residency) == len(record.layer_digests)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Which holder each block would come from, and the estimate (PL1)."""

    fetch_us: float
    sources: Mapping[str, float]  # holder -> microseconds of its transfers incl. RTT
    chosen: tuple[ReplicaRecord, ...]


def replica_shapes(replicas: Sequence[Sequence[ReplicaRecord]]) -> list[list[int]]:
    """A small integer per replica for its holder, size, residency and layer
    count: replicas of one shape read equally fast from one instance. Compute
    it once per lookup and pass it to :func:`plan_fetch` for every instance."""
    ids: dict[tuple[object, ...], int] = {}
    out = []
    for records in replicas:
        row = []
        for record in records:
            shape = (
                record.holder,
                record.size,
                record.residency,
                None if record.layer_digests is None else len(record.layer_digests),
            )
            row.append(ids.setdefault(shape, len(ids)))
        out.append(row)
    return out


def plan_fetch(
    replicas: Sequence[Sequence[ReplicaRecord]],
    status: InstanceStatus,
    resident: Collection[str] = (),
    shapes: Sequence[Sequence[int]] | None = None,
) -> FetchPlan | None:
    """Estimate fetch_us for instance ``status`` to load the matched blocks.

    ``replicas[i]`` lists the records of matched block i. Blocks in ``resident``
    (block keys already at the instance) cost nothing. For each other block
    the replica with the cheapest RTT + read over a known link is chosen,
    among replicas that hold every layer (a record whose residency covers
    fewer layers than its layer_digests list is partial); transfers from one
    source add up, sources proceed in parallel (the max). Returns None when
    some block has no whole replica reachable over a reported link.
    """
    per_source_us: dict[str, float] = {}
    chosen: list[ReplicaRecord] = []
    links = {link.holder: link for link in status.links}
    # Replicas of a prompt mostly share holder, size and residency: their read
    # time is computed once per such shape (a placement ranks every instance
    # over thousands of replicas).
    if shapes is None:
        shapes = replica_shapes(replicas)
    read_us: dict[int, float | None] = {}
    for records, row in zip(replicas, shapes, strict=True):
        if not records or records[0].block_key in resident:
            continue
        best: tuple[float, float, ReplicaRecord] | None = None
        for record, shape in zip(records, row, strict=True):
            if record.holder == status.instance:
                best = None
                break
            if shape not in read_us:
                link = links.get(record.holder)
                read_us[shape] = (
                    replica_read_us(record, link) if link is not None and _whole(record) else None
                )
            read = read_us[shape]
            if read is None:
                continue
            cost = links[record.holder].rtt_us + read
            if best is None or cost < best[0]:
                best = (cost, read, record)
        else:
            if best is None:
                return None
            _, read, record = best
            if record.holder not in per_source_us:
                per_source_us[record.holder] = links[record.holder].rtt_us
            per_source_us[record.holder] += read
            chosen.append(record)
    fetch = max(per_source_us.values(), default=0.0)
    return FetchPlan(fetch, per_source_us, tuple(chosen))


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
