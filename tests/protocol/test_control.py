"""Control-plane records (R1, R3, R4, R5, S3, RS1, RS2, RS5, RS6)."""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.control import (
    INSTANCE_STATES,
    InstanceStatus,
    Link,
    RangeFetch,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    Shard,
    ShardMap,
    StateChange,
    parse_reshard,
)
from kvstore.protocol.problems import InvalidRecord

from .vectors import COMPAT_ID, K0, K1, SCOPE_ID

SESSION_ID = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"
MAP_ID = "c3f8" + hashlib.sha256(b"map").hexdigest()[:56] + "e1"

# The draft's Instance Status Record example.
STATUS: dict[str, Any] = {
    "instance": "https://ii7.example/kvsp/",
    "epoch": 12,
    "state": "active",
    "running": 18,
    "queued": 3,
    "batch_size": 32,
    "kv_utilization": 0.71,
    "prefill_tokens_per_s": 42000,
    "decode_tokens_per_s": 3100,
    "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
    "requested_state": None,
    "ttl_ms": 3000,
}

# The draft's Session Checkpoint example, placeholders filled in.
CHECKPOINT: dict[str, Any] = {
    "session": SESSION_ID,
    "epoch": 1,
    "compat_id": COMPAT_ID,
    "scope_id": SCOPE_ID,
    "prompt_blocks": [K0, K1],
    "prompt_tail": [374, 264],
    "generated": [1296, 315, 279],
    "output_offset": 3,
    "sampler": {
        "method": "top-p",
        "params": {"p": 0.9},
        "seed": 7,
        "step": 3,
        "deterministic": False,
    },
}

# The draft's Shard Map example (its "c3f8...e1" map id is opaque text).
SHARD_MAP: dict[str, Any] = {
    "map": "c3f8...e1",
    "version": 4,
    "shards": [
        {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
        {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"},
        {"tokens": [65536, 98304], "instance": "https://ii3.example/kvsp/"},
    ],
}

# The draft's reshard plan example.
PLAN: dict[str, Any] = {
    "map": "c3f8...e1",
    "from": 4,
    "to": 5,
    "deadline_ms": 200,
    "retain": [[0, 32768]],
    "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}],
    "release": [],
}


def without(value: dict[str, Any], name: str) -> dict[str, Any]:
    out = copy.deepcopy(value)
    del out[name]
    return out


def with_(value: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(value)
    out.update(changes)
    return out


def assert_invalid(parse: Callable[[Any], Any], value: Any, member: str) -> None:
    """The parse fails with InvalidRecord naming ``member`` as the offending path."""
    with pytest.raises(InvalidRecord) as info:
        parse(value)
    assert str(info.value).startswith(member + ":"), str(info.value)
    assert info.value.extensions["member"] == member
    assert info.value.status == 400


# --- Instance Status Record (R3) --------------------------------------------


def test_status_draft_example() -> None:
    # R3: every member of the draft's example.
    status = InstanceStatus.from_json(STATUS)
    assert status.instance == "https://ii7.example/kvsp/"
    assert status.epoch == 12
    assert status.state == "active"
    assert (status.running, status.queued, status.batch_size) == (18, 3, 32)
    assert status.kv_utilization == pytest.approx(0.71)
    assert status.prefill_tokens_per_s == 42000
    assert status.decode_tokens_per_s == 3100
    assert status.links == (Link("https://h1.example/kvsp/", 200000.0, 12.0),)
    assert status.requested_state is None
    assert status.ttl_ms == 3000


def test_status_round_trip() -> None:
    # R3: to_json -> from_json is the identity; to_json matches the draft's example.
    status = InstanceStatus.from_json(STATUS)
    assert status.to_json() == STATUS
    assert InstanceStatus.from_json(status.to_json()) == status
    sleepy = InstanceStatus.from_json(with_(STATUS, requested_state="sleeping"))
    assert sleepy.requested_state == "sleeping"
    assert InstanceStatus.from_json(sleepy.to_json()) == sleepy


def test_status_optional_members() -> None:
    # R3: links and requested_state may be absent.
    status = InstanceStatus.from_json(without(without(STATUS, "links"), "requested_state"))
    assert status.links == ()
    assert status.requested_state is None
    assert InstanceStatus.from_json(status.to_json()) == status


def test_status_unknown_members_ignored() -> None:
    # R1
    value = with_(STATUS, gpu_temp_c=71, Epoch=99)
    value["links"][0]["jitter_us"] = 4
    assert InstanceStatus.from_json(value) == InstanceStatus.from_json(STATUS)


def test_status_member_names_case_sensitive() -> None:
    # R1: "Kv_Utilization" is not "kv_utilization".
    value = without(STATUS, "kv_utilization")
    value["Kv_Utilization"] = 0.5
    assert_invalid(InstanceStatus.from_json, value, "status.kv_utilization")


def test_status_link_to() -> None:
    # R3, PL1: the link an instance reports for a holder.
    status = InstanceStatus.from_json(STATUS)
    assert status.link_to("https://h1.example/kvsp/") == status.links[0]
    assert status.link_to("https://h2.example/kvsp/") is None


@pytest.mark.parametrize("state", sorted(INSTANCE_STATES))
def test_status_every_registered_state(state: str) -> None:
    # R5: "KVSP Instance States" registry.
    assert InstanceStatus.from_json(with_(STATUS, state=state)).state == state
    assert InstanceStatus.from_json(with_(STATUS, requested_state=state)).requested_state == state


def test_instance_state_registry() -> None:
    # R5
    assert frozenset({"active", "draining", "sleeping", "failed"}) == INSTANCE_STATES


@pytest.mark.parametrize(
    "name",
    [
        "instance",
        "epoch",
        "state",
        "running",
        "queued",
        "batch_size",
        "kv_utilization",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "ttl_ms",
    ],
)
def test_status_required_members(name: str) -> None:
    # R3
    assert_invalid(InstanceStatus.from_json, without(STATUS, name), f"status.{name}")


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"state": "busy"}, "status.state"),
        ({"state": "Active"}, "status.state"),
        ({"state": 1}, "status.state"),
        ({"requested_state": "awake"}, "status.requested_state"),
        ({"kv_utilization": 1.01}, "status.kv_utilization"),
        ({"kv_utilization": -0.1}, "status.kv_utilization"),
        ({"kv_utilization": float("nan")}, "status.kv_utilization"),
        ({"kv_utilization": "0.7"}, "status.kv_utilization"),
        ({"kv_utilization": True}, "status.kv_utilization"),
        ({"epoch": -1}, "status.epoch"),
        ({"epoch": 2**53}, "status.epoch"),
        ({"epoch": True}, "status.epoch"),
        ({"epoch": "12"}, "status.epoch"),
        ({"epoch": 12.0}, "status.epoch"),
        ({"running": -1}, "status.running"),
        ({"queued": 2**32}, "status.queued"),
        ({"batch_size": False}, "status.batch_size"),
        ({"prefill_tokens_per_s": -1}, "status.prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": float("inf")}, "status.prefill_tokens_per_s"),
        ({"decode_tokens_per_s": None}, "status.decode_tokens_per_s"),
        ({"ttl_ms": 0}, "status.ttl_ms"),
        ({"ttl_ms": 2**32}, "status.ttl_ms"),
        ({"instance": "ii7.example"}, "status.instance"),
        ({"instance": "file:///kvsp/"}, "status.instance"),
        ({"links": {}}, "status.links"),
        ({"links": ["https://h1.example/kvsp/"]}, "status.links[0]"),
        (
            {"links": [{"holder": "https://h1.example/", "mbit_per_s": 0, "rtt_us": 1}]},
            "status.links[0].mbit_per_s",
        ),
        (
            {"links": [{"holder": "https://h1.example/", "mbit_per_s": 1, "rtt_us": -1}]},
            "status.links[0].rtt_us",
        ),
        ({"links": [{"holder": "https://h1.example/", "mbit_per_s": 1}]}, "status.links[0].rtt_us"),
        ({"links": [{"holder": "h1", "mbit_per_s": 1, "rtt_us": 1}]}, "status.links[0].holder"),
        (
            {"links": [{"Holder": "https://h1.example/", "mbit_per_s": 1, "rtt_us": 1}]},
            "status.links[0].holder",
        ),
    ],
)
def test_status_invalid(changes: dict[str, Any], member: str) -> None:
    # R3, R5: wrong types, ranges, registry names, by path.
    assert_invalid(InstanceStatus.from_json, with_(STATUS, **changes), member)


def test_status_kv_utilization_bounds_inclusive() -> None:
    # R3: 0 and 1 are valid utilizations.
    assert InstanceStatus.from_json(with_(STATUS, kv_utilization=1)).kv_utilization == 1.0
    assert InstanceStatus.from_json(with_(STATUS, kv_utilization=0)).kv_utilization == 0.0


def test_status_links_bounded() -> None:
    # R3 (hostile input bound): at most 1024 links.
    links = [
        {"holder": f"https://h{i}.example/", "mbit_per_s": 1, "rtt_us": 1} for i in range(1025)
    ]
    assert_invalid(InstanceStatus.from_json, with_(STATUS, links=links), "status.links")


# --- State change (S3) ------------------------------------------------------


@pytest.mark.parametrize("state", ["draining", "active", "sleeping"])
def test_state_change_round_trip(state: str) -> None:
    # S3: the PC answers {"state": "draining"} or {"state": "active"}; PUT state carries one.
    change = StateChange.from_json({"state": state, "reason": "ignored"})  # R1
    assert change == StateChange(state)
    assert change.to_json() == {"state": state}
    assert StateChange.from_json(change.to_json()) == change


@pytest.mark.parametrize(
    "value", [{"state": "asleep"}, {"state": "DRAINING"}, {"State": "draining"}, {}, {"state": 0}]
)
def test_state_change_invalid(value: dict[str, Any]) -> None:
    # S3, R5, R1
    assert_invalid(StateChange.from_json, value, "state_change.state")


# --- Session Checkpoint (R4) ------------------------------------------------


def test_checkpoint_draft_example() -> None:
    # R4: every member of the draft's example.
    checkpoint = SessionCheckpoint.from_json(CHECKPOINT)
    assert checkpoint.session == SESSION_ID
    assert checkpoint.epoch == 1
    assert checkpoint.compat_id == COMPAT_ID
    assert checkpoint.scope_id == SCOPE_ID
    assert checkpoint.prompt_blocks == (K0, K1)
    assert checkpoint.prompt_tail == (374, 264)
    assert checkpoint.generated == (1296, 315, 279)
    assert checkpoint.output_offset == 3
    assert checkpoint.sampler == Sampler(
        method="top-p", params={"p": 0.9}, seed=7, step=3, deterministic=False
    )


def test_checkpoint_round_trip() -> None:
    # R4
    checkpoint = SessionCheckpoint.from_json(CHECKPOINT)
    assert checkpoint.to_json() == CHECKPOINT
    assert SessionCheckpoint.from_json(checkpoint.to_json()) == checkpoint


def test_checkpoint_unknown_members_ignored() -> None:
    # R1
    value = with_(CHECKPOINT, model="x", Session="not a uuid")
    value["sampler"]["temperature_schedule"] = [1, 2]
    assert SessionCheckpoint.from_json(value) == SessionCheckpoint.from_json(CHECKPOINT)


def test_checkpoint_member_names_case_sensitive() -> None:
    # R1
    value = without(CHECKPOINT, "output_offset")
    value["Output_Offset"] = 3
    assert_invalid(SessionCheckpoint.from_json, value, "checkpoint.output_offset")


def test_checkpoint_output_offset_may_exceed_generated() -> None:
    # R4: output_offset counts covered tokens; generated may list only the tail.
    checkpoint = SessionCheckpoint.from_json(with_(CHECKPOINT, output_offset=67))
    assert checkpoint.output_offset == 67
    assert SessionCheckpoint.from_json(checkpoint.to_json()) == checkpoint


def test_checkpoint_uppercase_session_normalized() -> None:
    # R4: a UUID is case-insensitive on input.
    checkpoint = SessionCheckpoint.from_json(with_(CHECKPOINT, session=SESSION_ID.upper()))
    assert checkpoint.session == SESSION_ID


def test_checkpoint_sampler_params_default_and_deterministic() -> None:
    # R4: params may be absent; deterministic and a negative seed are carried.
    value = copy.deepcopy(CHECKPOINT)
    value["sampler"] = {"method": "greedy", "seed": -5, "step": 0, "deterministic": True}
    checkpoint = SessionCheckpoint.from_json(value)
    assert checkpoint.sampler.params == {}
    assert checkpoint.sampler.deterministic is True
    assert checkpoint.sampler.seed == -5
    assert SessionCheckpoint.from_json(checkpoint.to_json()) == checkpoint


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"session": "6f1d0a9e-2c55-4d7e-9a0e"}, "checkpoint.session"),
        ({"session": "6f1d0a9e2c554d7e9a0e5b7f2f9f6a11"}, "checkpoint.session"),
        ({"session": "{" + SESSION_ID + "}"}, "checkpoint.session"),
        ({"session": "zf1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"}, "checkpoint.session"),
        ({"session": 42}, "checkpoint.session"),
        ({"epoch": -1}, "checkpoint.epoch"),
        ({"epoch": "1"}, "checkpoint.epoch"),
        ({"compat_id": COMPAT_ID.upper()}, "checkpoint.compat_id"),
        ({"scope_id": SCOPE_ID[:-1]}, "checkpoint.scope_id"),
        ({"prompt_blocks": [K0, K1[:-1]]}, "checkpoint.prompt_blocks[1]"),
        ({"prompt_tail": [374, -1]}, "checkpoint.prompt_tail[1]"),
        ({"prompt_tail": [2**32]}, "checkpoint.prompt_tail[0]"),
        ({"prompt_tail": [True]}, "checkpoint.prompt_tail[0]"),
        ({"generated": [1296, "315", 279]}, "checkpoint.generated[1]"),
        ({"generated": 1296}, "checkpoint.generated"),
        ({"output_offset": 2}, "checkpoint.output_offset"),  # < len(generated)
        ({"output_offset": True}, "checkpoint.output_offset"),
        ({"sampler": None}, "checkpoint.sampler"),
        ({"sampler": "top-p"}, "checkpoint.sampler"),
    ],
)
def test_checkpoint_invalid(changes: dict[str, Any], member: str) -> None:
    # R4
    assert_invalid(SessionCheckpoint.from_json, with_(CHECKPOINT, **changes), member)


@pytest.mark.parametrize(
    "name",
    [
        "session",
        "epoch",
        "compat_id",
        "scope_id",
        "prompt_blocks",
        "prompt_tail",
        "generated",
        "output_offset",
        "sampler",
    ],
)
def test_checkpoint_required_members(name: str) -> None:
    # R4
    assert_invalid(SessionCheckpoint.from_json, without(CHECKPOINT, name), f"checkpoint.{name}")


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"method": 1}, "checkpoint.sampler.method"),
        ({"method": "m" * 65}, "checkpoint.sampler.method"),
        ({"params": [0.9]}, "checkpoint.sampler.params"),
        ({"params": "p=0.9"}, "checkpoint.sampler.params"),
        ({"seed": "7"}, "checkpoint.sampler.seed"),
        ({"seed": 2**64}, "checkpoint.sampler.seed"),
        ({"seed": -(2**63) - 1}, "checkpoint.sampler.seed"),
        ({"step": -1}, "checkpoint.sampler.step"),
        ({"step": False}, "checkpoint.sampler.step"),
        ({"deterministic": "false"}, "checkpoint.sampler.deterministic"),
        ({"deterministic": 0}, "checkpoint.sampler.deterministic"),
        ({"deterministic": None}, "checkpoint.sampler.deterministic"),
    ],
)
def test_checkpoint_sampler_invalid(changes: dict[str, Any], member: str) -> None:
    # R4: sampler {method, params, seed, step, deterministic}.
    value = copy.deepcopy(CHECKPOINT)
    value["sampler"].update(changes)
    assert_invalid(SessionCheckpoint.from_json, value, member)


@pytest.mark.parametrize("name", ["method", "seed", "step", "deterministic"])
def test_checkpoint_sampler_required(name: str) -> None:
    # R4
    value = copy.deepcopy(CHECKPOINT)
    del value["sampler"][name]
    assert_invalid(SessionCheckpoint.from_json, value, f"checkpoint.sampler.{name}")


# --- Shard Map (RS1) --------------------------------------------------------


def test_shard_map_draft_example() -> None:
    # RS1: the draft's example parses and round-trips.
    shard_map = ShardMap.from_json(SHARD_MAP)
    assert shard_map.map == "c3f8...e1"
    assert shard_map.version == 4
    assert shard_map.shards == (
        Shard(0, 32768, "https://ii1.example/kvsp/"),
        Shard(32768, 65536, "https://ii2.example/kvsp/"),
        Shard(65536, 98304, "https://ii3.example/kvsp/"),
    )
    assert shard_map.to_json() == SHARD_MAP
    assert ShardMap.from_json(shard_map.to_json()) == shard_map
    assert shard_map.ranges_of("https://ii2.example/kvsp/") == [(32768, 65536)]
    assert shard_map.ranges_of("https://ii9.example/kvsp/") == []


def test_shard_map_unknown_members_and_case() -> None:
    # R1
    value = with_(SHARD_MAP, created_by="pc-1")
    value["shards"][0]["weight"] = 2
    assert ShardMap.from_json(value) == ShardMap.from_json(SHARD_MAP)
    value = without(SHARD_MAP, "version")
    value["Version"] = 4
    assert_invalid(ShardMap.from_json, value, "shard_map.version")


@pytest.mark.parametrize(
    ("shards", "member"),
    [
        # gap: not contiguous
        (
            [
                {"tokens": [0, 100], "instance": "https://ii1.example/"},
                {"tokens": [101, 200], "instance": "https://ii2.example/"},
            ],
            "shard_map.shards[1].tokens",
        ),
        # overlap
        (
            [
                {"tokens": [0, 100], "instance": "https://ii1.example/"},
                {"tokens": [99, 200], "instance": "https://ii2.example/"},
            ],
            "shard_map.shards[1].tokens",
        ),
        # out of order
        (
            [
                {"tokens": [100, 200], "instance": "https://ii2.example/"},
                {"tokens": [0, 100], "instance": "https://ii1.example/"},
            ],
            "shard_map.shards[1].tokens",
        ),
        # empty half-open range, reversed range
        ([{"tokens": [5, 5], "instance": "https://ii1.example/"}], "shard_map.shards[0].tokens"),
        ([{"tokens": [9, 5], "instance": "https://ii1.example/"}], "shard_map.shards[0].tokens"),
        ([{"tokens": [0], "instance": "https://ii1.example/"}], "shard_map.shards[0].tokens"),
        ([{"instance": "https://ii1.example/"}], "shard_map.shards[0].tokens"),
        (
            [{"tokens": [0, "9"], "instance": "https://ii1.example/"}],
            "shard_map.shards[0].tokens[1]",
        ),
        (
            [{"tokens": [-1, 9], "instance": "https://ii1.example/"}],
            "shard_map.shards[0].tokens[0]",
        ),
        ([{"tokens": [0, 9], "instance": "ii1"}], "shard_map.shards[0].instance"),
        ([{"tokens": [0, 9]}], "shard_map.shards[0].instance"),
        ([{"Tokens": [0, 9], "instance": "https://ii1.example/"}], "shard_map.shards[0].tokens"),
        ([[0, 9]], "shard_map.shards[0]"),
        ([], "shard_map.shards"),
        ({"tokens": [0, 9]}, "shard_map.shards"),
    ],
)
def test_shard_map_invalid(shards: Any, member: str) -> None:
    # RS1: half-open, contiguous, non-overlapping.
    assert_invalid(ShardMap.from_json, with_(SHARD_MAP, shards=shards), member)


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"map": 7}, "shard_map.map"),
        ({"map": "m" * 257}, "shard_map.map"),
        ({"version": -1}, "shard_map.version"),
        ({"version": "4"}, "shard_map.version"),
        ({"version": True}, "shard_map.version"),
    ],
)
def test_shard_map_invalid_members(changes: dict[str, Any], member: str) -> None:
    # RS1
    assert_invalid(ShardMap.from_json, with_(SHARD_MAP, **changes), member)


instances = st.sampled_from([f"https://ii{i}.example/kvsp/" for i in range(1, 6)])


@st.composite
def shard_maps(draw: st.DrawFn) -> dict[str, Any]:
    bounds = sorted(
        draw(st.sets(st.integers(min_value=0, max_value=2**40), min_size=2, max_size=12))
    )
    return {
        "map": draw(st.text(min_size=1, max_size=40)),
        "version": draw(st.integers(min_value=0, max_value=2**53 - 1)),
        "shards": [
            {"tokens": [a, b], "instance": draw(instances)} for a, b in itertools.pairwise(bounds)
        ],
    }


@given(shard_maps())
def test_shard_map_round_trip_property(value: dict[str, Any]) -> None:
    # RS1: every contiguous half-open map round-trips unchanged.
    shard_map = ShardMap.from_json(value)
    assert shard_map.to_json() == value
    assert ShardMap.from_json(shard_map.to_json()) == shard_map
    assert all(a.end == b.start for a, b in itertools.pairwise(shard_map.shards))


@given(shard_maps(), st.integers(min_value=1, max_value=1000), st.data())
def test_shard_map_gap_property(value: dict[str, Any], shift: int, data: st.DataObject) -> None:
    # RS1: moving any shard boundary (but the first) by a nonzero amount breaks contiguity.
    shards = value["shards"]
    if len(shards) < 2:
        shards.append(
            {
                "tokens": [shards[0]["tokens"][1], shards[0]["tokens"][1] + 1],
                "instance": "https://x.example/",
            }
        )
    i = data.draw(st.integers(min_value=1, max_value=len(shards) - 1))
    start, end = shards[i]["tokens"]
    shards[i]["tokens"] = [start + shift, end + shift + 1]
    assert_invalid(ShardMap.from_json, value, f"shard_map.shards[{i}].tokens")


# --- Reshard (RS2, RS5, RS6) ------------------------------------------------


def test_reshard_plan_draft_example() -> None:
    # RS2: the draft's plan example.
    plan = parse_reshard(PLAN)
    assert plan == ReshardPlan(
        map="c3f8...e1",
        from_version=4,
        to_version=5,
        deadline_ms=200,
        retain=((0, 32768),),
        fetch=(RangeFetch(32768, 49152, "https://ii2.example/kvsp/"),),
        release=(),
    )
    assert plan.to_json() == PLAN
    assert parse_reshard(plan.to_json()) == plan


def test_reshard_plan_defaults_and_unknown_members() -> None:
    # RS2, R1: retain/fetch/release default to empty; unknown members ignored.
    value = {"map": MAP_ID, "from": 0, "to": 1, "deadline_ms": 0, "why": "scale-up"}
    plan = parse_reshard(value)
    assert isinstance(plan, ReshardPlan)
    assert (plan.retain, plan.fetch, plan.release) == ((), (), ())
    assert parse_reshard(plan.to_json()) == plan


def test_reshard_commit_and_abort() -> None:
    # RS5, RS6: {map, commit: v+1} and {map, abort: v+1}.
    commit = parse_reshard({"map": "c3f8...e1", "commit": 5})
    assert commit == ReshardCommit("c3f8...e1", 5)
    assert commit.to_json() == {"map": "c3f8...e1", "commit": 5}
    assert parse_reshard(commit.to_json()) == commit
    abort = parse_reshard({"map": "c3f8...e1", "abort": 5, "reason": "deadline"})
    assert abort == ReshardAbort("c3f8...e1", 5)
    assert abort.to_json() == {"map": "c3f8...e1", "abort": 5}
    assert parse_reshard(abort.to_json()) == abort


@pytest.mark.parametrize(
    ("value", "member"),
    [
        # to must be from + 1 (RS2)
        (with_(PLAN, to=6), "reshard.to"),
        (with_(PLAN, to=4), "reshard.to"),
        (with_(PLAN, to=3), "reshard.to"),
        # exactly one of plan / commit / abort
        ({"map": "m", "commit": 5, "abort": 5}, "reshard"),
        (with_(PLAN, commit=5), "reshard"),
        ({"map": "m", "from": 4}, "reshard"),
        ({"map": "m"}, "reshard"),
        ({"map": "m", "Commit": 5}, "reshard"),  # R1: case-sensitive
        # members
        (without(PLAN, "map"), "reshard.map"),
        (without(PLAN, "from"), "reshard.from"),
        (without(PLAN, "deadline_ms"), "reshard.deadline_ms"),
        (with_(PLAN, deadline_ms=-1), "reshard.deadline_ms"),
        (with_(PLAN, deadline_ms=2**32), "reshard.deadline_ms"),
        (with_(PLAN, **{"from": "4"}), "reshard.from"),
        (with_(PLAN, to=True), "reshard.to"),
        ({"map": "m", "commit": "5"}, "reshard.commit"),
        ({"map": "m", "abort": -1}, "reshard.abort"),
        ({"map": 4, "commit": 5}, "reshard.map"),
        # ranges: half-open
        (with_(PLAN, retain=[[10, 10]]), "reshard.retain[0]"),
        (with_(PLAN, retain=[[20, 10]]), "reshard.retain[0]"),
        (with_(PLAN, retain=[0, 32768]), "reshard.retain[0]"),
        (with_(PLAN, release=[[0, 1], [5]]), "reshard.release[1]"),
        (with_(PLAN, release=[[0, True]]), "reshard.release[0][1]"),
        # fetch entries
        (
            with_(PLAN, fetch=[{"tokens": [5, 1], "from": "https://ii2.example/"}]),
            "reshard.fetch[0].tokens",
        ),
        (with_(PLAN, fetch=[{"tokens": [1, 5]}]), "reshard.fetch[0].from"),
        (with_(PLAN, fetch=[{"tokens": [1, 5], "from": "ii2"}]), "reshard.fetch[0].from"),
        (
            with_(PLAN, fetch=[{"tokens": [1, 5], "From": "https://ii2.example/"}]),
            "reshard.fetch[0].from",
        ),
        (with_(PLAN, fetch=[[1, 5]]), "reshard.fetch[0]"),
        ([PLAN], "reshard"),
    ],
)
def test_reshard_invalid(value: Any, member: str) -> None:
    # RS2, RS5, RS6
    assert_invalid(parse_reshard, value, member)


@given(
    st.integers(min_value=0, max_value=2**53 - 2),
    st.lists(st.tuples(st.integers(0, 2**30), st.integers(1, 2**30)), max_size=5),
)
def test_reshard_plan_round_trip_property(version: int, spans: list[tuple[int, int]]) -> None:
    # RS2: any plan from v to v+1 round-trips.
    ranges = [[a, a + n] for a, n in spans]
    value = {
        "map": MAP_ID,
        "from": version,
        "to": version + 1,
        "deadline_ms": 200,
        "retain": ranges,
        "fetch": [{"tokens": r, "from": "https://ii2.example/kvsp/"} for r in ranges],
        "release": ranges[::-1],
    }
    plan = parse_reshard(value)
    assert isinstance(plan, ReshardPlan)
    assert plan.to_json() == value
    assert parse_reshard(plan.to_json()) == plan
