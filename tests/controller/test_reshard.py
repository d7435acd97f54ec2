"""Reshard plans (RS1-RS3, RS7), including the draft's example."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.controller.reshard import plan_reshard
from kvstore.protocol.control import RangeFetch, Shard, ShardMap
from kvstore.protocol.problems import PlanConflict

II1, II2, II3 = (f"https://ii{i}.example/kvsp/" for i in (1, 2, 3))


def shard_map(version: int, *shards: tuple[int, int, str]) -> ShardMap:
    return ShardMap("c3f8e1", version, tuple(Shard(a, b, i) for a, b, i in shards))


# The draft's map, version 4.
V4 = shard_map(4, (0, 32768, II1), (32768, 65536, II2), (65536, 98304, II3))


def test_the_drafts_example() -> None:
    # v5 moves tokens 32768-49152 to ii1: ii1 retains 0-32768 and fetches that
    # range from ii2 (the draft's plan for ii1), ii2 releases it after commit.
    v5 = shard_map(5, (0, 49152, II1), (49152, 65536, II2), (65536, 98304, II3))
    plans = plan_reshard(V4, v5, deadline_ms=200)
    ii1 = plans[II1]
    assert ii1.to_json() == {
        "map": "c3f8e1",
        "from": 4,
        "to": 5,
        "deadline_ms": 200,
        "retain": [[0, 32768]],
        "fetch": [{"tokens": [32768, 49152], "from": II2}],
        "release": [],
    }
    assert plans[II2].retain == ((49152, 65536),)
    assert plans[II2].release == ((32768, 49152),)
    assert plans[II2].fetch == ()
    assert plans[II3].retain == ((65536, 98304),) and not plans[II3].fetch


def test_growing_the_group_fetches_only_what_moves() -> None:
    v5 = shard_map(
        5, (0, 16384, II1), (16384, 32768, II3), (32768, 65536, II2), (65536, 98304, II3)
    )
    plans = plan_reshard(V4, v5, 100)
    assert plans[II3].fetch == (RangeFetch(16384, 32768, II1),)
    assert plans[II3].retain == ((65536, 98304),)
    assert plans[II1].release == ((16384, 32768),)


@pytest.mark.parametrize(
    "target",
    [
        shard_map(6, (0, 98304, II1)),  # skips a version
        shard_map(4, (0, 98304, II1)),  # same version
        shard_map(5, (0, 90000, II1)),  # covers other tokens
        ShardMap("other", 5, (Shard(0, 98304, II1),)),
        shard_map(5, (0, 10000, II1), (20000, 98304, II2)),  # a gap: tokens owned by nobody
        shard_map(5, (0, 50000, II1), (40000, 98304, II2)),  # an overlap
    ],
)
def test_plans_that_do_not_match_the_current_version(target: ShardMap) -> None:
    # RS7: kvsp-plan-conflict (409).
    with pytest.raises(PlanConflict) as info:
        plan_reshard(V4, target, 100)
    assert info.value.status == 409


@given(
    cuts=st.lists(st.integers(1, 99), unique=True, max_size=5),
    owners_old=st.lists(st.sampled_from([II1, II2, II3]), min_size=6, max_size=6),
    new_cuts=st.lists(st.integers(1, 99), unique=True, max_size=5),
    owners_new=st.lists(st.sampled_from([II1, II2, II3]), min_size=6, max_size=6),
)
def test_every_token_is_retained_or_fetched_exactly_once(
    cuts: list[int], owners_old: list[str], new_cuts: list[int], owners_new: list[str]
) -> None:
    # RS3 as a property: after the plan, each new owner has each of its tokens
    # exactly once, and a token never moves between an instance and itself.
    def build(version: int, points: list[int], owners: list[str]) -> ShardMap:
        edges = [0, *sorted(points), 100]
        return shard_map(
            version, *((a, b, owners[i]) for i, (a, b) in enumerate(itertools.pairwise(edges)))
        )

    old, new = build(1, cuts, owners_old), build(2, new_cuts, owners_new)
    plans = plan_reshard(old, new, 100)
    for shard in new.shards:
        plan = plans[shard.instance]
        covered = [0] * 100
        for a, b in plan.retain:
            for t in range(a, b):
                covered[t] += 1
        for f in plan.fetch:
            assert f.source != shard.instance
            for t in range(f.start, f.end):
                covered[t] += 1
        assert all(covered[t] == 1 for t in range(shard.start, shard.end))
