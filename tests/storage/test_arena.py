"""The host tier's arena: extents handed out, given back only when the last
view of them is gone (a GET streaming a block that was deleted or evicted
never sees its memory reused), coalesced, and a fallback to ordinary memory
when nothing fits; a PUT body received straight into an extent is kept
without a copy."""

from __future__ import annotations

import asyncio
import gc
import os

import httpx
import pytest

from kvstore.backends.host import HEADROOM_MIN, HostTier
from kvstore.holder import HolderSettings, create_app
from kvstore.security import Policy
from kvstore.storage import TieredStore
from kvstore.storage.arena import ALIGN, Arena

from .helpers import COMPAT, SCOPE, block, ref

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)


def test_extents_are_disjoint_and_coalesce_when_given_back() -> None:
    arena = Arena(1 << 20)
    views = [arena.alloc(100_000) for _ in range(10)]
    assert all(v is not None and len(v) == 100_000 and not v.readonly for v in views)
    for n, view in enumerate(views):
        assert view is not None
        view[:] = bytes([n]) * len(view)
    del view
    # Each kept its own octets: no two extents overlap.
    assert [bytes(v[:1]) + bytes(v[-1:]) for v in views if v is not None] == [
        bytes([n, n]) for n in range(10)
    ]
    assert arena.used == 10 * (-(-100_000 // ALIGN) * ALIGN)
    assert arena.alloc(arena.size) is None  # more than is free: no extent
    # Given back out of order, the free extents merge into one again.
    for n in (3, 1, 2, 0, 9, 5, 7, 4, 8, 6):
        views[n] = None
    gc.collect()
    assert arena.used == 0 and arena.largest_free == arena.size
    whole = arena.alloc(arena.size)
    assert whole is not None and len(whole) == arena.size


def test_a_view_of_an_extent_keeps_it_from_reuse() -> None:
    arena = Arena(1 << 16)
    first = arena.alloc(1 << 15)
    assert first is not None
    first[:] = b"a" * len(first)
    streaming = first.toreadonly()[100:200]  # what a GET holds while it sends
    del first
    # Its extent is still taken: the rest of the arena is all there is.
    second = arena.alloc(1 << 15)
    third = arena.alloc(1 << 15)
    assert second is not None and third is None
    second[:] = b"b" * len(second)
    assert bytes(streaming) == b"a" * 100
    del streaming
    third = arena.alloc(1 << 15)  # now it is free again
    assert third is not None


def test_views_freed_in_other_threads_keep_the_free_list_whole() -> None:
    arena = Arena(8 << 20)

    def churn(n: int) -> None:
        for _ in range(200):
            view = arena.alloc(4096 + n * 64)
            if view is not None:
                view[0] = n
            del view  # given back in this thread

    async def run() -> None:
        await asyncio.gather(*(asyncio.to_thread(churn, n) for n in range(8)))

    asyncio.run(run())
    assert arena.used == 0 and arena.largest_free == arena.size


def test_an_extent_given_back_while_the_arena_is_busy_waits_for_it() -> None:
    # A finalizer may run at any moment, even in a garbage collection inside
    # alloc() on the thread that holds the arena's lock: it must not take
    # the lock (it would never get it) nor touch the free list mid-change.
    arena = Arena(1 << 20)
    view = arena.alloc(4096)
    with arena._lock:
        del view  # its finalizer runs here, on this thread, lock held
    assert arena.used == 0 and arena.largest_free == arena.size


def test_a_prefaulted_arena_and_a_bad_size() -> None:
    arena = Arena(1 << 20, prefault=True)
    view = arena.alloc(1 << 20)
    assert view is not None and bytes(view[:8]) == bytes(8)
    with pytest.raises(ValueError):
        Arena(0)


async def test_the_host_tier_keeps_blocks_in_its_arena_and_falls_back() -> None:
    tier = HostTier()
    tier.provision(1 << 20)
    arena = tier.arena
    assert arena is not None and arena.size >= (1 << 20) + HEADROOM_MIN
    data = os.urandom(300_000)
    await tier.put("a/0", bytearray(data))  # mutable: copied into an extent
    got = await tier.get("a/0")
    assert isinstance(got, memoryview) and got.readonly and bytes(got) == data
    assert arena.owns(memoryview(got)) and arena.used >= len(data)
    # A buffer the tier handed out is kept as it is: no second extent.
    buffer = tier.buffer(1000)
    assert buffer is not None
    buffer[:] = b"x" * 1000
    used = arena.used
    await tier.put("a/1", buffer)
    assert arena.used == used and bytes(await tier.get("a/1") or b"") == b"x" * 1000
    # Nothing, or octets not in one run: kept outside the arena, not a fallback.
    await tier.put("a/3", b"")
    await tier.put("a/4", memoryview(bytes(range(10)))[::2])
    empty = await tier.get("a/3")
    assert empty is not None and bytes(empty) == b""
    assert bytes(await tier.get("a/4") or b"") == bytes(range(0, 10, 2))
    assert tier.fallbacks == 0
    # A slice of an extent is not the whole of one: copied, not adopted.
    assert not arena.owns(buffer[:10]) and not arena.owns(memoryview(data))
    del buffer
    # Bytes are immutable: kept as they are, outside the arena.
    await tier.put("a/5", data)
    assert (await tier.get("a/5")) is data
    # Larger than the arena: kept in ordinary memory, still served.
    big = bytearray(os.urandom(arena.size + 1))
    await tier.put("a/2", big)
    assert bytes(await tier.get("a/2") or b"") == big
    # Deleting gives the extent back once nothing holds it.
    del got
    await tier.delete("a/0")
    await tier.delete("a/1")
    gc.collect()
    assert arena.used == 0
    # Prefaulting more than the machine's memory is not attempted: the
    # arena is mapped, its pages left to fault in as they are used.
    huge = HostTier(prefault=True)
    huge.provision(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    assert huge.arena is not None and huge.arena.size > 0
    plain = HostTier(arena=False)
    plain.provision(1 << 20)
    assert plain.arena is None and plain.buffer(10) is None
    with pytest.raises(ValueError):
        HostTier(prefault="yes")  # type: ignore[arg-type]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            HostTier(workers=bad)  # type: ignore[arg-type]


def test_workers_prefault_only_what_the_machine_holds_for_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each of 4 workers' share is a quarter of the machine: alone it would
    # be prefaulted; all four together are more than 0.9 of the memory, so
    # none is (its pages fault in as they are used).
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    share = HostTier(prefault=True, workers=4)
    with caplog.at_level("WARNING", logger="kvstore.storage"):
        share.provision(physical // 4)
    assert share.arena is not None
    assert "not prefaulting 4 arena(s)" in caplog.text


async def test_a_get_streaming_an_evicted_block_sends_its_own_octets() -> None:
    # The store evicts the block being sent and stores others in its place;
    # the octets already handed to the response stay the evicted block's.
    size = len(block(layers=8, section=32 << 10))
    store = TieredStore([(HostTier(), 3 * size)])
    first = block(layers=8, section=32 << 10)
    # Mutable buffers (as a received body is), so copied into the arena.
    await store.put(ref(0), bytearray(first))
    read = store.read(ref(0))
    sent = [chunk async for chunk in read]  # a response's views, not yet written
    for n in range(1, 8):  # room is made by evicting block 0 and others
        await store.put(ref(n), bytearray(block(layers=8, section=32 << 10)))
    assert ref(0) not in store
    assert b"".join(bytes(c) for c in sent) == first
    tier = store.slots[0].tier
    assert isinstance(tier, HostTier) and tier.arena is not None
    pinned = tier.arena.used
    del sent, read
    gc.collect()
    assert tier.arena.used < pinned  # the evicted block's extent is free now


async def test_a_put_body_is_received_into_the_arena() -> None:
    store = TieredStore([(HostTier(), 16 << 20)])
    tier = store.slots[0].tier
    assert isinstance(tier, HostTier) and tier.arena is not None
    app = create_app(HolderSettings("http://holder.test/kvsp/", allow_anonymous=True), store, OPEN)
    data = block(layers=8, section=64 << 10)
    url = f"blocks/{COMPAT}/{SCOPE}/{ref(1).block_key}"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://holder.test/kvsp/"
    ) as client:
        put = await client.put(url, content=data, headers={"If-None-Match": "*"})
        assert put.status_code == 201, put.text
        (key,) = [k async for k in tier.keys()]
        kept = tier._data[key]
        # Kept as received: the body's own extent, not a copy of it, and
        # read-only (nothing writes into a stored block through the body).
        assert isinstance(kept, memoryview) and tier.arena.owns(kept) and kept.readonly
        assert tier.arena.used == -(-len(data) // ALIGN) * ALIGN
        get = await client.get(url)
        assert get.status_code == 200 and get.content == data
        # A body refused after it arrived (already held: 412) leaves no extent.
        again = await client.put(url, content=data, headers={"If-None-Match": "*"})
        assert again.status_code == 412
        gc.collect()
        assert tier.arena.used == -(-len(data) // ALIGN) * ALIGN
        # So does one that is not a container (400).
        bad = await client.put(
            f"blocks/{COMPAT}/{SCOPE}/{ref(2).block_key}",
            content=os.urandom(len(data)),
            headers={"If-None-Match": "*"},
        )
        assert bad.status_code == 400
        gc.collect()
        assert tier.arena.used == -(-len(data) // ALIGN) * ALIGN
