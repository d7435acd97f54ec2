"""Choosing an instance (PL1, PL2) against hand-computed costs."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.controller.placement import choose, rank
from kvstore.protocol.control import InstanceStatus, Link
from kvstore.protocol.placement import shape_groups
from kvstore.protocol.problems import InvalidState
from kvstore.protocol.records import ReplicaRecord, Residency

H1 = "https://h1.test/kvsp/"
NEAR, FAR, BUSY = (f"https://{n}.test/kvsp/" for n in ("near", "far", "busy"))
MIB = 1 << 20


def status(instance: str, link_rate: float | None, queued: int = 0) -> InstanceStatus:
    links = (Link(H1, link_rate, 10.0),) if link_rate else ()
    return InstanceStatus(
        instance=instance,
        epoch=1,
        state="active",
        running=1,
        queued=queued,
        batch_size=8,
        kv_utilization=0.2,
        prefill_tokens_per_s=10000,
        decode_tokens_per_s=1000,
        ttl_ms=3000,
        links=links,
    )


def replicas(n: int) -> list[list[ReplicaRecord]]:
    return [
        [
            ReplicaRecord(
                block_key=f"{i:064x}",
                compat_id="c" * 64,
                scope_id="d" * 32,
                holder=H1,
                codec=1,
                size=2 * MIB,
                digest="sha-256:" + "0" * 64,
                residency=(Residency("host", 0, 31),),
                ttl_ms=1000,
            )
        ]
        for i in range(n)
    ]


def test_cheapest_fetch_wins() -> None:
    # 4 blocks of 16 tokens cached at H1; the prompt has 80 tokens.
    near = status(NEAR, 100000.0)  # 8 * 2 MiB / 100000 Mbit/s = 167.8 us per block
    far = status(FAR, 1000.0)  # 16777 us per block: recomputing is cheaper
    ranked = rank(
        [far, near], shape_groups(replicas(4)), total_tokens=80, block_tokens=16, mean_service_us=0
    )
    assert [c.instance for c in ranked] == [NEAR, FAR]
    best = choose(ranked)
    fetch = 10 + 4 * 8 * 2 * MIB / 100000
    assert best.fetch_us == pytest.approx(fetch)
    assert best.cost_us == pytest.approx(fetch + 1e6 * 16 / 10000)  # the 16 unmatched tokens
    assert ranked[1].cost_us == pytest.approx(1e6 * 80 / 10000)  # recompute all: 8000 us


def test_queue_wait_counts() -> None:
    # wait_us = queued x mean service time can outweigh a faster fetch.
    near_busy = status(BUSY, 100000.0, queued=10)
    far = status(FAR, 1000.0)
    ranked = rank(
        [near_busy, far],
        shape_groups(replicas(4)),
        total_tokens=80,
        block_tokens=16,
        mean_service_us=5000,
    )
    assert choose(ranked).instance == FAR
    assert ranked[1].wait_us == 50000


def test_unreachable_replicas_mean_recompute() -> None:
    ranked = rank(
        [status(NEAR, None)],
        shape_groups(replicas(2)),
        total_tokens=32,
        block_tokens=16,
        mean_service_us=0,
    )
    assert ranked[0].fetch_us is None
    assert ranked[0].cost_us == pytest.approx(1e6 * 32 / 10000)


def test_no_cache_and_ties() -> None:
    a, b = status(NEAR, 100000.0), dataclasses.replace(status(FAR, 100000.0), running=0)
    ranked = rank([a, b], [], total_tokens=16, block_tokens=16, mean_service_us=0)
    assert ranked[0].instance == FAR  # same cost: the less loaded first
    assert ranked[0].fetch_us == 0.0


def test_no_active_instance() -> None:
    with pytest.raises(InvalidState):
        choose([])
