"""Residency shared by IS processes through a real Redis
(kvstore.index.shared_residency): an update taken by one process is
answered by the others, one bridge's updates apply in the order it sent
them whichever process took each, a process started later loads what is
resident, and an instance's records expire with its TTL."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvstore.index.shared_residency import SharedResidency
from kvstore.protocol.residency import ResidencyGroup, ResidencyUpdate
from kvstore.protocol.wire import role_id

from ..conftest import RedisServer

POD = "https://vllm-0.test:8000/"
COMPAT = hashlib.sha256(b"compat").hexdigest()
SCOPE = "a" * 32


def key(n: int) -> str:
    return hashlib.sha256(f"k{n}".encode()).hexdigest()


def adding(*keys: str, medium: str = "GPU") -> tuple[ResidencyGroup, ...]:
    return (ResidencyGroup(SCOPE, COMPAT, medium, keys),)


@pytest.fixture
async def processes(redis_server: RedisServer) -> AsyncIterator[Callable[[], SharedResidency]]:
    """IS processes' residency over one Redis, under a prefix of this test's."""
    prefix = f"test-{os.urandom(4).hex()}:"
    made: list[SharedResidency] = []

    def make() -> SharedResidency:
        made.append(SharedResidency(redis_server.url, prefix))
        return made[-1]

    yield make
    for shared in made:
        await shared.close()


async def until(check: Callable[[], Any], seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not within the time")


def prefix_at(shared: SharedResidency, *keys: str) -> list[tuple[str, int]]:
    return [(r.instance, r.prefix_blocks) for r in shared.lookup(SCOPE, COMPAT, keys)]


async def test_an_update_taken_by_one_process_is_answered_by_another(
    processes: Callable[[], SharedResidency],
) -> None:
    a, b = processes(), processes()
    await b.start()  # a process that only answers lookups follows the log too
    ttl, known, records = await a.tell(
        role_id(POD), ResidencyUpdate(POD, 30_000, add=adding(key(0), key(1)))
    )
    assert (ttl, known, records) == (30_000, False, 2)
    assert prefix_at(a, key(0), key(1)) == [(POD, 2)]  # at once where it was taken
    await until(lambda: prefix_at(b, key(0), key(1)) == [(POD, 2)])


async def test_one_bridge_s_updates_apply_in_its_order_wherever_taken(
    processes: Callable[[], SharedResidency],
) -> None:
    # Added at A, removed at B, added again at A, cleared at B, then one key
    # added at A: both processes end with exactly that key.
    a, b = processes(), processes()
    pod = role_id(POD)
    await a.tell(pod, ResidencyUpdate(POD, 30_000, add=adding(key(0), key(1))))
    await b.tell(pod, ResidencyUpdate(POD, 30_000, remove=adding(key(1))))
    _, known, records = await a.tell(pod, ResidencyUpdate(POD, 30_000, add=adding(key(1))))
    assert known and records == 2
    await b.tell(pod, ResidencyUpdate(POD, 30_000, clear=True, add=adding(key(5))))
    await a.tell(pod, ResidencyUpdate(POD, 30_000, add=adding(key(6))))
    for shared in (a, b):
        await until(lambda s=shared: prefix_at(s, key(5), key(6)) == [(POD, 2)])
        assert prefix_at(shared, key(0)) == []


async def test_a_process_started_later_loads_what_is_resident(
    processes: Callable[[], SharedResidency],
) -> None:
    a = processes()
    for n in range(3):
        await a.tell(role_id(POD), ResidencyUpdate(POD, 30_000, add=adding(key(n))))
    await a.tell(role_id(POD), ResidencyUpdate(POD, 30_000, remove=adding(key(2))))
    later = processes()
    await later.start()
    assert prefix_at(later, key(0), key(1), key(2)) == [(POD, 2)]


async def test_records_expire_with_the_instance_s_ttl_and_then_are_unknown(
    processes: Callable[[], SharedResidency],
) -> None:
    a, b = processes(), processes()
    await b.start()
    await a.tell(role_id(POD), ResidencyUpdate(POD, 400, add=adding(key(0))))
    await until(lambda: prefix_at(b, key(0)) == [(POD, 1)])
    await asyncio.sleep(1.2)  # its bridge stopped refreshing (the book sweeps each second)
    assert prefix_at(a, key(0)) == [] and prefix_at(b, key(0)) == []
    _, known, records = await b.tell(role_id(POD), ResidencyUpdate(POD, 30_000))
    assert not known and records == 0  # Redis let the instance go: tell everything again


async def test_a_redis_down_costs_lookups_one_timeout_not_one_each() -> None:
    import time

    from kvstore.storage.errors import TierUnavailable

    from ..conftest import free_port

    shared = SharedResidency(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(TierUnavailable):
            await shared.start()
        started = time.monotonic()
        for _ in range(20):  # the IS's lookups meanwhile: answered without residency
            with pytest.raises(TierUnavailable):
                await shared.start()
        assert time.monotonic() - started < 0.5
    finally:
        await shared.close()


async def test_shared_over_a_redis_cluster(redis_cluster: Any) -> None:
    # One hash tag: a hash and the log change together on one master.
    prefix = f"test-{os.urandom(4).hex()}:"
    a, b = (SharedResidency(redis_cluster.url, prefix, cluster=True) for _ in range(2))
    try:
        await b.start()
        _, known, records = await a.tell(
            role_id(POD), ResidencyUpdate(POD, 30_000, add=adding(key(0), key(1)))
        )
        assert not known and records == 2
        await until(lambda: prefix_at(b, key(0), key(1)) == [(POD, 2)])
        later = SharedResidency(redis_cluster.url, prefix, cluster=True)
        try:
            await later.start()  # the hashes found on whichever master holds them
            assert prefix_at(later, key(0), key(1)) == [(POD, 2)]
        finally:
            await later.close()
    finally:
        await a.close()
        await b.close()
