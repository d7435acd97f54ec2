"""Reshard plans (RS1-RS3): what each instance does to move from map v to v+1.

Pure computation over two Shard Maps of one context:

* a token range assigned to the same instance in both versions is in that
  instance's ``retain`` and is never transferred (RS3);
* every other range of v+1 is fetched by its new owner from the instance
  that holds it in v (split at the boundaries of v's shards);
* a range an instance holds in v and not in v+1 is in its ``release``, to be
  dropped after the commit (RS5).
"""

from __future__ import annotations

import itertools

from ..protocol.control import RangeFetch, ReshardPlan, ShardMap
from ..protocol.problems import PlanConflict

Range = tuple[int, int]


def _intersect(a: Range, b: Range) -> Range | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def _merge(ranges: list[Range]) -> list[Range]:
    out: list[Range] = []
    for start, end in sorted(ranges):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _check(shard_map: ShardMap) -> None:
    """RS1: half-open, contiguous, non-overlapping, non-empty (a map built in
    code is not validated the way ``ShardMap.from_json`` validates one)."""
    if not shard_map.shards:
        raise PlanConflict(f"map {shard_map.map} v{shard_map.version} has no shards")
    for shard in shard_map.shards:
        if shard.start >= shard.end:
            raise PlanConflict(f"shard [{shard.start}, {shard.end}) is empty or reversed")
    for prev, nxt in itertools.pairwise(shard_map.shards):
        if nxt.start != prev.end:
            raise PlanConflict(f"map {shard_map.map} v{shard_map.version} is not contiguous")


def plan_reshard(current: ShardMap, target: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """The plan for every instance of either version, keyed by instance URI."""
    _check(current)
    _check(target)
    if target.map != current.map:
        raise PlanConflict(f"maps differ: {current.map} vs {target.map}")
    if target.version != current.version + 1:
        raise PlanConflict(
            f"map {current.map} is at version {current.version}; cannot plan to {target.version}"
        )
    if (current.shards[0].start, current.shards[-1].end) != (
        target.shards[0].start,
        target.shards[-1].end,
    ):
        raise PlanConflict("both versions must cover the same tokens")
    retain: dict[str, list[Range]] = {}
    fetch: dict[str, list[RangeFetch]] = {}
    release: dict[str, list[Range]] = {}
    for new in target.shards:
        for old in current.shards:
            overlap = _intersect((new.start, new.end), (old.start, old.end))
            if overlap is None:
                continue
            if old.instance == new.instance:
                retain.setdefault(new.instance, []).append(overlap)  # RS3: stays in place
            else:
                fetch.setdefault(new.instance, []).append(RangeFetch(*overlap, old.instance))
                release.setdefault(old.instance, []).append(overlap)
    members = {s.instance for s in current.shards} | {s.instance for s in target.shards}
    return {
        member: ReshardPlan(
            map=current.map,
            from_version=current.version,
            to_version=target.version,
            deadline_ms=deadline_ms,
            retain=tuple(_merge(retain.get(member, []))),
            fetch=tuple(sorted(fetch.get(member, []), key=lambda f: (f.start, f.end))),
            release=tuple(_merge(release.get(member, []))),
        )
        for member in sorted(members)
    }
