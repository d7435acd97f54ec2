"""The Tier contract, run against every tier with real services (STYLE 11)."""

from __future__ import annotations

import os

import pytest

from kvstore.storage.tier import Tier

from .tiers import KINDS, make_tier

pytestmark = pytest.mark.parametrize("kind", KINDS)

K1 = "a" * 64 + "/" + "b" * 64 + "/" + "c" * 32 + "/0-15"
K2 = "d" * 64 + "/" + "b" * 64 + "/" + "c" * 32 + "/16-31"


@pytest.fixture
async def tier(kind: str, request: pytest.FixtureRequest) -> Tier:
    t = make_tier(kind, request)
    yield t  # type: ignore[misc]
    await t.close()


async def test_put_get_round_trip(tier: Tier) -> None:
    data = os.urandom(4096)
    await tier.put(K1, data)
    got = await tier.get(K1)
    assert got is not None
    assert bytes(got) == data


async def test_missing_key_is_none(tier: Tier) -> None:
    assert await tier.get(K2) is None


async def test_put_accepts_any_buffer_and_copies_it(tier: Tier) -> None:
    buf = bytearray(b"x" * 100)
    await tier.put(K1, memoryview(buf))
    buf[0] = ord("y")  # the tier must not alias the caller's mutable buffer
    got = await tier.get(K1)
    assert got is not None and bytes(got) == b"x" * 100


async def test_overwrite_replaces(tier: Tier) -> None:
    await tier.put(K1, b"old")
    await tier.put(K1, b"new")
    got = await tier.get(K1)
    assert got is not None and bytes(got) == b"new"


async def test_delete(tier: Tier) -> None:
    await tier.put(K1, b"v")
    await tier.delete(K1)
    assert await tier.get(K1) is None
    await tier.delete(K1)  # deleting a missing key is fine


async def test_keys_lists_what_is_stored(tier: Tier) -> None:
    await tier.put(K1, b"1")
    await tier.put(K2, b"2")
    assert sorted([k async for k in tier.keys()]) == sorted([K1, K2])
    await tier.delete(K1)
    assert [k async for k in tier.keys()] == [K2]


async def test_sized_keys_tell_each_value_s_octets(tier: Tier) -> None:
    # What a restart sizes segments with, without reading them: a persistent
    # tier tells every size; a tier that cannot says None (then it is read).
    await tier.put(K1, b"1" * 300)
    await tier.put(K2, b"2" * 7)
    sized = dict([pair async for pair in tier.sized_keys()])
    assert sorted(sized) == sorted([K1, K2])
    if tier.persistent:
        assert sized == {K1: 300, K2: 7}
    else:
        assert all(size in (None, {K1: 300, K2: 7}[key]) for key, size in sized.items())


async def test_batch_operations(tier: Tier) -> None:
    await tier.put_many([(K1, b"1"), (K2, b"2")])
    got = await tier.get_many([K1, K2, K1.replace("a", "e")])
    assert [None if g is None else bytes(g) for g in got] == [b"1", b"2", None]
    await tier.delete_many([K1, K2])
    assert await tier.get_many([K1, K2]) == [None, None]


async def test_two_mib_segment(tier: Tier) -> None:
    data = os.urandom(2 << 20)
    await tier.put(K1, data)
    got = await tier.get(K1)
    assert got is not None and bytes(got) == data


async def test_reopening_keeps_what_a_persistent_tier_holds_and_nothing_else(
    tier: Tier, kind: str, request: pytest.FixtureRequest
) -> None:
    # Persistent tiers (LMDB, Redis, S3) outlive the object and the process;
    # a memory tier's contents end with it (what the holder withdraws at a
    # stop, and why a restart re-adopts only persistent segments).
    await tier.put(K1, b"durable")
    options = {}
    if kind.startswith("remote-memory"):
        options["prefix"] = tier.prefix  # type: ignore[attr-defined]
    if kind == "remote-storage":
        options["bucket"] = tier.bucket  # type: ignore[attr-defined]
    await tier.close()
    reopened = make_tier(kind, request, **options)
    try:
        got = await reopened.get(K1)
        if tier.persistent:
            assert got is not None and bytes(got) == b"durable"
        else:
            assert kind in ("host", "host-arena", "device") and got is None
    finally:
        await reopened.close()
