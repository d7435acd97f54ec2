"""Placement cost estimates (PL1): fetch_us, recompute_us, wait_us and cost."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.control import InstanceStatus, Link
from kvstore.protocol.placement import (
    FetchPlan,
    ReplicaShape,
    decode_shapes,
    placement_cost,
    plan_fetch,
    plan_groups,
    recompute_us,
    replica_read_us,
    shape_groups,
    transfer_us,
    wait_us,
)
from kvstore.protocol.problems import InvalidRecord
from kvstore.protocol.records import LookupResponse, ReplicaRecord, Residency

from .vectors import COMPAT_ID, K0, K1, SCOPE_ID

MIB = 1 << 20
SIZE = 2 * MIB  # the draft example's replica size, 2097152 octets
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
H3 = "https://h3.example/kvsp/"  # no link reported for it
II7 = "https://ii7.example/kvsp/"
K2 = hashlib.sha256(b"third block key").hexdigest()

# The draft example's residency: device 0-15, host 16-31 at 400000 Mbit/s.
DRAFT_RESIDENCY = (Residency("device", 0, 15), Residency("host", 16, 31, 400000.0))


def record(
    block_key: str = K0,
    holder: str = H1,
    size: int = SIZE,
    residency: tuple[Residency, ...] = DRAFT_RESIDENCY,
) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=block_key,
        compat_id=COMPAT_ID,
        scope_id=SCOPE_ID,
        holder=holder,
        codec=1,
        size=size,
        digest="sha-256:" + "0" * 64,
        residency=residency,
        ttl_ms=600000,
    )


def status(
    *links: Link, instance: str = II7, prefill: float = 42000, queued: int = 3
) -> InstanceStatus:
    return InstanceStatus(
        instance=instance,
        epoch=12,
        state="active",
        running=18,
        queued=queued,
        batch_size=32,
        kv_utilization=0.71,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=3100,
        ttl_ms=3000,
        links=links,
    )


# The draft example's link: 200000 Mbit/s, 12 us RTT.
LINK_H1 = Link(H1, 200000.0, 12.0)
LINK_H2 = Link(H2, 100000.0, 50.0)
STATUS = status(LINK_H1, LINK_H2)

# 2 MiB over 200000 Mbit/s: 8 * 2097152 / 200000 us.
READ_H1 = 8 * SIZE / 200000  # 83.88608
READ_H2 = 8 * SIZE / 100000  # 167.77216


# --- the elementary formulas ------------------------------------------------


def test_transfer_us() -> None:
    # PL1: 8 * octets / mbit_per_s is microseconds.
    assert transfer_us(1_000_000, 8000) == pytest.approx(1000.0)
    assert transfer_us(SIZE, 200000) == pytest.approx(83.88608)
    assert transfer_us(0, 1) == 0.0


def test_recompute_us() -> None:
    # PL1: recompute_us = 1e6 * tokens / prefill_tokens_per_s.
    assert recompute_us(42000, 42000) == pytest.approx(1e6)
    assert recompute_us(4, 42000) == pytest.approx(1e6 * 4 / 42000)
    assert recompute_us(0, 42000) == 0.0
    assert recompute_us(-4, 42000) == 0.0
    assert recompute_us(4, 0) == math.inf  # an instance that reports no prefill rate


def test_wait_us() -> None:
    # PL1: wait_us = queued * mean service time.
    assert wait_us(3, 250.0) == pytest.approx(750.0)
    assert wait_us(0, 250.0) == 0.0


# --- replica_read_us: the tier's read_mbit_per_s reduces the link rate -------


def test_replica_read_us_link_bound() -> None:
    # PL1: a tier faster than the link does not speed the read up.
    assert replica_read_us(record(), LINK_H1) == pytest.approx(READ_H1)


def test_replica_read_us_storage_tier_reduces_rate() -> None:
    # PL1: for layers held in a storage tier, the rate is the tier's read_mbit_per_s.
    residency = (
        Residency("device", 0, 15),
        Residency("local-storage", 16, 31, read_mbit_per_s=8000.0),
    )
    expected = 8 * (SIZE / 2) / 200000 + 8 * (SIZE / 2) / 8000  # 41.94304 + 1048.576
    assert replica_read_us(record(residency=residency), LINK_H1) == pytest.approx(expected)
    assert expected == pytest.approx(1090.51904)


def test_replica_read_us_split_by_layer_share() -> None:
    # PL1: each residency segment carries its share of the octets (layers are equal-sized).
    residency = (
        Residency("device", 0, 7),
        Residency("remote-storage", 8, 31, read_mbit_per_s=50000.0),
    )
    expected = 8 * (SIZE * 8 / 32) / 200000 + 8 * (SIZE * 24 / 32) / 50000
    assert replica_read_us(record(residency=residency), LINK_H1) == pytest.approx(expected)


def test_replica_read_us_without_residency() -> None:
    # PL1: no residency stated -> the whole size at the link rate.
    assert replica_read_us(record(residency=()), LINK_H2) == pytest.approx(READ_H2)


@given(
    st.integers(min_value=1, max_value=2**40),
    st.floats(min_value=1.0, max_value=1e7),
    st.floats(min_value=1.0, max_value=1e7),
)
def test_replica_read_us_bounds_property(size: int, link_rate: float, tier_rate: float) -> None:
    # PL1: reading never beats the link, never beats the tier, never exceeds the slower of both.
    residency = (Residency("remote-storage", 0, 31, read_mbit_per_s=tier_rate),)
    us = replica_read_us(record(size=size, residency=residency), Link(H1, link_rate, 0.0))
    assert us == pytest.approx(8 * size / min(link_rate, tier_rate))
    assert us >= transfer_us(size, link_rate) * (1 - 1e-9)


# --- plan_fetch -------------------------------------------------------------


def test_plan_fetch_single_source() -> None:
    # PL1: rtt + 8 * bytes / rate for the draft example's replica and link.
    plan = plan_fetch([[record()]], STATUS)
    assert plan is not None
    assert plan.fetch_us == pytest.approx(12 + READ_H1)  # 95.88608
    assert dict(plan.sources) == pytest.approx({H1: 12 + READ_H1})


def test_plan_fetch_same_source_adds_bytes_rtt_once() -> None:
    # PL1: bytes_from(s) is the total volume from s; its RTT counts once.
    plan = plan_fetch([[record(K0)], [record(K1)], [record(K2)]], STATUS)
    assert plan is not None
    assert plan.fetch_us == pytest.approx(12 + 3 * READ_H1)
    assert dict(plan.sources) == pytest.approx({H1: 12 + 3 * READ_H1})


def test_plan_fetch_max_over_sources() -> None:
    # PL1: sources proceed in parallel: fetch_us is the max over sources.
    plan = plan_fetch([[record(K0, H1)], [record(K1, H2)]], STATUS)
    assert plan is not None
    assert dict(plan.sources) == pytest.approx({H1: 12 + READ_H1, H2: 50 + READ_H2})
    assert plan.fetch_us == pytest.approx(max(12 + READ_H1, 50 + READ_H2))
    assert plan.fetch_us == pytest.approx(217.77216)


def test_plan_fetch_chooses_cheapest_source() -> None:
    # PL1: of several replicas of a block, the one with the cheapest read is used.
    plan = plan_fetch([[record(K0, H2), record(K0, H1)]], STATUS)
    assert plan is not None
    assert list(plan.sources) == [H1]
    assert plan.fetch_us == pytest.approx(12 + READ_H1)
    # A slow storage tier at H1 makes H2 the better source.
    slow = (Residency("remote-storage", 0, 31, read_mbit_per_s=1000.0),)
    plan = plan_fetch([[record(K0, H1, residency=slow), record(K0, H2)]], STATUS)
    assert plan is not None
    assert list(plan.sources) == [H2]
    assert plan.fetch_us == pytest.approx(50 + READ_H2)


def test_plan_fetch_skips_partial_replicas() -> None:
    # PL1: a replica whose residency covers fewer layers than its layer_digests
    # list cannot supply the whole block, however fast its holder.
    digests = tuple("ab" * 32 for _ in range(32))
    partial = record(holder=H1, residency=(Residency("device", 0, 15),))
    partial = dataclasses.replace(partial, layer_digests=digests)
    whole = record(holder=H2, residency=(Residency("host", 0, 31),))
    whole = dataclasses.replace(whole, layer_digests=digests)
    plan = plan_fetch([[partial, whole]], STATUS)
    assert plan is not None
    assert list(plan.sources) == [H2]
    assert plan_fetch([[partial]], STATUS) is None


def test_plan_fetch_counts_rtt_when_choosing() -> None:
    # A faster link behind a long RTT loses to a slower, near one for a small block.
    far = Link(H1, 400000.0, 5000.0)
    near = Link(H2, 100000.0, 10.0)
    small = 64 * 1024
    plan = plan_fetch(
        [[record(holder=H1, size=small), record(holder=H2, size=small)]], status(far, near)
    )
    assert plan is not None
    assert list(plan.sources) == [H2]


def test_plan_fetch_skips_replica_without_link() -> None:
    # PL1: a replica at a holder the instance reports no link to is not a source.
    plan = plan_fetch([[record(K0, H3), record(K0, H2)]], STATUS)
    assert plan is not None
    assert list(plan.sources) == [H2]


def test_plan_fetch_unreachable_is_none() -> None:
    # PL1: a matched block with no replica over a reported link cannot be fetched.
    assert plan_fetch([[record(K0, H1)], [record(K1, H3)]], STATUS) is None
    assert plan_fetch([[record(K0, H1)]], status()) is None  # no links at all


def test_plan_fetch_resident_blocks_cost_nothing() -> None:
    # PL1: only blocks not already resident at i are fetched.
    plan = plan_fetch([[record(K0, H1)], [record(K1, H2)]], STATUS, resident={K1})
    assert plan is not None
    assert plan.fetch_us == pytest.approx(12 + READ_H1)
    assert H2 not in plan.sources
    # A resident block needs no reachable replica either.
    assert plan_fetch([[record(K0, H3)]], STATUS, resident={K0}) == FetchPlan(0.0, {})


def test_plan_fetch_replica_at_instance_itself_is_resident() -> None:
    # PL1: a replica held by the instance itself means the block is resident there.
    own = record(K1, II7)
    for replicas in ([own], [record(K1, H2), own], [own, record(K1, H3)]):
        plan = plan_fetch([[record(K0, H1)], replicas], STATUS)
        assert plan is not None
        assert plan.fetch_us == pytest.approx(12 + READ_H1)
        assert dict(plan.sources) == pytest.approx({H1: 12 + READ_H1})


def test_plan_fetch_nothing_to_fetch() -> None:
    # PL1: no matched blocks -> fetch_us 0.
    assert plan_fetch([], STATUS) == FetchPlan(0.0, {})


def test_plan_fetch_from_lookup_response() -> None:
    # L1, L2, PL1: the replicas of a lookup answer feed plan_fetch directly.
    sent = LookupResponse(2, ((record(K0, H1),), (record(K1, H1), record(K1, H2))))
    response = LookupResponse.from_json(sent.to_json())
    assert response == sent
    plan = plan_fetch(response.replicas, STATUS)
    assert plan is not None
    assert plan.fetch_us == pytest.approx(12 + 2 * READ_H1)


# --- placement_cost ---------------------------------------------------------


def test_placement_cost_fetch_wins() -> None:
    # PL1: cost = wait + min(fetch + recompute(unmatched), recompute(all)).
    cost = placement_cost(
        fetch_us=50.0,
        matched_tokens=800,
        total_tokens=1000,
        prefill_tokens_per_s=1e6,  # 1 us per token
        queued=3,
        mean_service_us=100.0,
    )
    assert cost == pytest.approx(300 + 50 + 200)


def test_placement_cost_recompute_wins() -> None:
    # PL1: when fetching is slower than recomputing everything, recompute everything.
    cost = placement_cost(
        fetch_us=5000.0, matched_tokens=800, total_tokens=1000, prefill_tokens_per_s=1e6
    )
    assert cost == pytest.approx(1000.0)


def test_placement_cost_unfetchable() -> None:
    # PL1: fetch_us None (plan_fetch found no source) -> recompute everything.
    cost = placement_cost(
        fetch_us=None,
        matched_tokens=800,
        total_tokens=1000,
        prefill_tokens_per_s=1e6,
        queued=2,
        mean_service_us=10.0,
    )
    assert cost == pytest.approx(20 + 1000)


def test_placement_cost_draft_numbers() -> None:
    # PL1: the draft's status (42000 tok/s, queued 3) and replica (2 MiB over 200000 Mbit/s).
    plan = plan_fetch([[record(K0)], [record(K1)]], STATUS)
    assert plan is not None
    cost = placement_cost(
        fetch_us=plan.fetch_us,
        matched_tokens=8,
        total_tokens=10,
        prefill_tokens_per_s=STATUS.prefill_tokens_per_s,
        queued=STATUS.queued,
        mean_service_us=1000.0,
    )
    fetch = 12 + 2 * READ_H1
    expected = 3 * 1000.0 + min(fetch + 1e6 * 2 / 42000, 1e6 * 10 / 42000)
    assert cost == pytest.approx(expected)


@given(
    st.one_of(st.none(), st.floats(min_value=0, max_value=1e9)),
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=10**6),
    st.floats(min_value=1.0, max_value=1e7),
    st.integers(min_value=0, max_value=1000),
    st.floats(min_value=0, max_value=1e6),
)
def test_placement_cost_property(
    fetch: float | None, matched: int, extra: int, rate: float, queued: int, service: float
) -> None:
    # PL1: never worse than recomputing everything, never better than waiting;
    # with nothing to fetch and everything matched, the cost is the wait alone.
    total = matched + extra
    cost = placement_cost(
        fetch_us=fetch,
        matched_tokens=matched,
        total_tokens=total,
        prefill_tokens_per_s=rate,
        queued=queued,
        mean_service_us=service,
    )
    wait = queued * service
    everything = 1e6 * total / rate
    assert cost <= wait + everything + 1e-6 * max(1.0, wait + everything)
    assert cost >= wait - 1e-9
    if fetch is not None:
        expected = wait + min(fetch + 1e6 * extra / rate, everything)
        assert cost == pytest.approx(expected)
    full = placement_cost(
        fetch_us=0.0,
        matched_tokens=total,
        total_tokens=total,
        prefill_tokens_per_s=rate,
        queued=queued,
        mean_service_us=service,
    )
    assert full == pytest.approx(wait)


def test_groups_do_not_change_the_plan() -> None:
    # Blocks with replicas of equal shapes, counted once, plan as if each
    # were computed on its own: n blocks of one shape read n times as long.
    rows = [
        [record(K0, H1), record(K0, H2)],
        [record(K1, H1, size=SIZE // 2)],
        [record(K2, H1), record(K2, H2)],
    ]
    groups = shape_groups(rows)
    assert sorted(n for _, n in groups) == [1, 2]
    plan = plan_groups(groups, STATUS)
    assert plan == plan_fetch(rows, STATUS) and plan is not None
    assert plan.fetch_us == pytest.approx(12 + 2 * READ_H1 + READ_H1 / 2)
    assert shape_groups(rows, resident={K0, K2}) == [((ReplicaShape.of(rows[1][0]),), 1)]


def test_shapes_round_trip_and_partial_replicas() -> None:
    # PL1: a shape carries what placement reads of a record, as compact JSON.
    digests = tuple("ab" * 32 for _ in range(32))
    full = dataclasses.replace(record(), layer_digests=digests)
    part = dataclasses.replace(full, residency=(Residency("device", 0, 15),))
    shapes = (ReplicaShape.of(full), ReplicaShape.of(part), ReplicaShape.of(record()))
    assert [s.whole for s in shapes] == [True, False, True]
    assert decode_shapes(b"[" + b",".join(s.encode() for s in shapes) + b"]") == shapes
    assert decode_shapes(shapes[0].encode()) == shapes[:1]
    with pytest.raises(InvalidRecord):
        decode_shapes(b'[{"holder":"not a uri","size":1,"residency":[]}]')
