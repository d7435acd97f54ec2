"""The engines' chunk layer (issue 10, kvstore.integrations.chunks) against
two real uvicorn holders: names spread over the holders by rendezvous
hashing, one lease per holder around a batched get, failover to the next
holder when one is down (and that one skipped for a while), prefix lookups,
and names kept apart by scope, descriptor and namespace."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from kvstore.backends.host import HostTier
from kvstore.config import ConfigError
from kvstore.holder import HolderSettings, create_app
from kvstore.integrations.chunks import ChunkSettings, ChunkStore, Geometry
from kvstore.protocol.compat import parse_descriptor
from kvstore.security import Policy
from kvstore.storage import TieredStore

from .storage.helpers import block

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)
GEOMETRY = Geometry(layers=8, kv_heads=2, head_dim=8, kv_dtype="bf16", block_tokens=4)
DESCRIPTOR = parse_descriptor(
    {
        "model": "m",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
        "positional": "rope",
        "layers": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "kv_dtype": "bf16",
        "block_tokens": 4,
        "layout": "kvsp-layout-1",
    }
)


class Holder:
    def __init__(self) -> None:
        # Bound here and handed to uvicorn: two holders made one after the
        # other cannot be given the same free port (a pick-then-bind race).
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}/kvsp/"
        self.store = TieredStore([(HostTier(), 64 << 20)])
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None
        #: What it answers at GET shards (empty: itself alone).
        self.shards: tuple[str, ...] = ()

    async def start(self) -> None:
        settings = HolderSettings(self.uri, allow_anonymous=True, shards=self.shards)
        app = create_app(settings, self.store, OPEN)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        )
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)
            self.server = self.task = None

    def held(self) -> int:
        return len(self.store)


@pytest.fixture
async def holders() -> AsyncIterator[list[Holder]]:
    found = [Holder(), Holder()]
    for holder in found:
        await holder.start()
    yield found
    for holder in found:
        await holder.stop()


def settings(
    holders: list[Holder], key: bytes = bytes(range(32)), namespace: str = "t", **kw: object
) -> ChunkSettings:
    return ChunkSettings(
        holders=tuple(h.uri for h in holders),
        scope_key=key,
        descriptor=DESCRIPTOR,
        namespace=namespace,
        timeout_s=2.0,
        **kw,
    )  # type: ignore[arg-type]


async def test_names_spread_over_holders_and_come_back_in_one_lease_each(
    holders: list[Holder],
) -> None:
    store = ChunkStore(settings(holders))
    names = [f"chunk-{n}" for n in range(24)]
    bodies = {n: block() for n in names}
    assert all(await asyncio.gather(*(store.put(n, bodies[n]) for n in names)))
    counts = [h.held() for h in holders]
    assert sum(counts) == 24 and min(counts) >= 4, counts  # both hold a share
    # The same name is on the same holder from any client (rendezvous).
    again = ChunkStore(settings(holders))
    for n in names[:4]:
        assert again.holders_for(again.block_key(n))[0] == store.holders_for(store.block_key(n))[0]
    got = await again.get_many([*names, "absent"])
    assert got[:-1] == [bodies[n] for n in names] and got[-1] is None
    assert again.stats.leases == 2 and again.stats.hits == 24 and again.stats.misses == 1
    assert all(len(h.store.leases) == 0 for h in holders)  # released
    assert await again.contains_prefix([*names[:5], "absent", *names[5:]]) == 5
    await store.close()
    await again.close()


async def test_a_holder_down_sends_puts_to_the_next_and_gets_there_too(
    holders: list[Holder],
) -> None:
    store = ChunkStore(settings(holders, down_backoff_s=60.0))
    names = [f"chunk-{n}" for n in range(12)]
    first = {n: store.holders_for(store.block_key(n))[0] for n in names}
    on_a = [n for n in names if first[n] == holders[0].uri]
    on_b = [n for n in names if first[n] == holders[1].uri]
    assert on_a and on_b
    for n in on_b:
        assert await store.put(n, block())
    await holders[0].stop()
    # A's names go to B while A is down; B's stay where they are.
    bodies = {n: block() for n in on_a}
    for n in on_a:
        assert await store.put(n, bodies[n])
    assert holders[1].held() == len(names)
    assert store.stats.errors == 1  # A failed once, then was skipped
    # A fresh client (A not yet known to be down) still finds A's names on B.
    fresh = ChunkStore(settings(holders))
    got = await fresh.get_many(on_a)
    assert got == [bodies[n] for n in on_a]
    assert fresh.stats.errors >= 1 and await fresh.contains(on_a[0])
    await store.close()
    await fresh.close()


async def test_one_configured_uri_finds_every_worker_of_its_holder() -> None:
    # Two holders that answer GET shards as the workers of one process do
    # (docs/workers.md); the engine is configured with the first only.
    workers = [Holder(), Holder()]
    for worker in workers:
        worker.shards = tuple(w.uri for w in workers)
        await worker.start()
    try:
        store = ChunkStore(settings(workers[:1]))
        names = [f"chunk-{n}" for n in range(16)]
        bodies = {n: block() for n in names}
        assert all(await asyncio.gather(*(store.put(n, bodies[n]) for n in names)))
        assert store.holders == tuple(w.uri for w in workers)
        counts = [w.held() for w in workers]
        assert sum(counts) == 16 and min(counts) >= 3, counts  # both workers hold a share
        again = ChunkStore(settings(workers[:1]))
        assert await again.get_many(names) == [bodies[n] for n in names]
        assert again.stats.leases == 2  # one per worker
        await store.close()
        await again.close()
    finally:
        for worker in workers:
            await worker.stop()


async def test_a_lone_holder_has_no_shards_and_keeps_its_configured_uri(
    holders: list[Holder],
) -> None:
    from kvstore.client import HolderClient
    from kvstore.protocol.problems import NotFound

    async with HolderClient() as client:
        with pytest.raises(NotFound):
            await client.shards(holders[0].uri)
    alias = holders[0].uri.replace("127.0.0.1", "localhost")  # not its holder.uri
    store = ChunkStore(dataclasses.replace(settings(holders), holders=(alias,)))
    assert await store.put("x", block())
    assert store.holders == (alias,)
    await store.close()


async def test_every_holder_down_is_a_miss_not_an_error(holders: list[Holder]) -> None:
    store = ChunkStore(settings(holders))
    assert await store.put("x", block())
    for holder in holders:
        await holder.stop()
    assert await store.get_many(["x", "y"]) == [None, None]
    assert not await store.put("z", block())
    assert not await store.contains("x") and not await store.reachable()
    assert store.stats.put_failures == 1
    await store.close()


async def test_names_are_kept_apart_by_scope_descriptor_and_namespace(
    holders: list[Holder],
) -> None:
    base = ChunkStore(settings(holders))
    other_scope = ChunkStore(settings(holders, key=bytes(range(1, 33))))
    other_engine = ChunkStore(settings(holders, namespace="u"))
    keys = {s.block_key("same") for s in (base, other_scope, other_engine)}
    assert len(keys) == 3
    assert await base.put("same", block())
    assert not await other_scope.contains("same") and not await other_engine.contains("same")
    assert other_scope.scope_id != base.scope_id
    for store in (base, other_scope, other_engine):
        await store.close()


def test_options_are_checked(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(os.urandom(32).hex())
    (tmp_path / "short").write_text(os.urandom(8).hex())
    options = {
        "holders": "http://127.0.0.1:1/kvsp, http://127.0.0.1:2/kvsp/",
        "scope_key_file": str(tmp_path / "key"),
        "model": "m",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
    }
    found = ChunkSettings.from_options(options, namespace="t", geometry=GEOMETRY)
    assert found.holders == ("http://127.0.0.1:1/kvsp/", "http://127.0.0.1:2/kvsp/")
    assert found.descriptor.layers == 8 and found.descriptor.positional == "rope"
    assert found.ssl_context is None  # http only
    (tmp_path / "d.json").write_text(__import__("json").dumps(DESCRIPTOR.to_json()))
    from_file = ChunkSettings.from_options(
        {**options, "descriptor_file": str(tmp_path / "d.json")}, namespace="t", geometry=GEOMETRY
    )
    assert from_file.descriptor == DESCRIPTOR
    bad = {
        "holders": ({**options, "holders": ""}, "holders"),
        "scheme": ({**options, "holders": "ftp://x/"}, "holders"),
        "short key": ({**options, "scope_key_file": str(tmp_path / "short")}, "scope_key"),
        "digest": ({**options, "model_digest": "md5"}, "model_digest"),
        "timeout": ({**options, "timeout_s": "-1"}, "timeout_s"),
        "tls": ({**options, "holders": "https://127.0.0.1:1/kvsp/"}, "cafile"),
        "geometry": ({**options, "descriptor_file": str(tmp_path / "d.json")}, "geometry"),
    }
    for name, (opts, match) in bad.items():
        geometry = GEOMETRY if name != "geometry" else Geometry(4, 2, 8, "bf16", 4)
        with pytest.raises(ConfigError, match=match):
            ChunkSettings.from_options(opts, namespace="t", geometry=geometry)


async def test_a_chunk_that_fails_to_convert_is_a_miss_and_cancelling_gives_back(
    holders: list[Holder],
) -> None:
    # convert (the engine's decode into its buffer) failing for one chunk is
    # that chunk's miss; the lease is released all the same. A cancelled
    # batch gives every converted chunk to release (the engine's buffers).
    store = ChunkStore(settings(holders))
    names = [f"c{n}" for n in range(6)]
    for n in names:
        assert await store.put(n, block())

    def convert(i: int, body: bytes) -> bytes | None:
        if i == 2:
            raise ValueError("not a chunk of this geometry")
        return body

    got = await store.fetch_many(names, convert)
    assert [x is None for x in got] == [False, False, True, False, False, False]
    assert store.stats.errors == 1 and all(len(h.store.leases) == 0 for h in holders)

    released: list[int] = []
    arrived = asyncio.Event()

    def slow(i: int, body: bytes) -> int:
        arrived.set()
        return i

    async def hang_after_first() -> None:
        await arrived.wait()

    task = asyncio.create_task(store.fetch_many(names, slow, release=released.append))
    await hang_after_first()
    await asyncio.sleep(0)  # let a few more arrive
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released and all(isinstance(i, int) for i in released)
    await asyncio.sleep(0.2)  # the lease release in finally ran
    assert all(len(h.store.leases) == 0 for h in holders)
    await store.close()


async def test_pinned_chunks_are_leased_where_they_are_renewed_and_read_under_that_lease(
    holders: list[Holder],
) -> None:
    # LMCache's MP mode locks chunks at lookup and loads them later
    # (kvstore.integrations.lmcache_mp): pin_many is that lock, a lease.
    store = ChunkStore(settings(holders, lease_ms=5_000))
    names = [f"pin-{n}" for n in range(10)]
    bodies = {n: block() for n in names}
    assert all(await asyncio.gather(*(store.put(n, bodies[n]) for n in names)))
    pins = await store.pin_many([*names, "absent"])
    assert pins[-1] is None and all(p is not None and p.lease for p in pins[:-1])
    assert store.stats.leases == 2  # one per holder, for the whole batch
    by_holder = {h.uri: h for h in holders}
    for name, pin in zip(names, pins, strict=False):
        assert pin is not None
        assert pin.holder == store.holders_for(store.block_key(name))[0]
        assert len(by_holder[pin.holder].store.leases) == 1  # held until released
    # Read under the pins: no lease of its own.
    got = await store.fetch_many(names, lambda _, body: body, pinned=pins[:-1])
    assert got == [bodies[n] for n in names] and store.stats.leases == 2
    first = pins[0]
    assert first is not None
    assert 19_000 <= (await store.renew(first, 20_000) or 0) <= 20_000
    for pin in {p for p in pins if p is not None}:
        await store.release(pin)
    assert all(len(h.store.leases) == 0 for h in holders)
    assert await store.renew(first, 1_000) == 0  # released: gone, not an error
    # A holder that is down: its chunks are not found, the others are.
    on_b = [store.holders_for(store.block_key(n))[0] == holders[1].uri for n in names]
    assert any(on_b) and not all(on_b)
    await holders[0].stop()
    again = await store.pin_many(names)
    assert [p is not None for p in again] == on_b
    for pin in {p for p in again if p is not None}:
        await store.release(pin)
    await store.close()


async def test_a_lease_refused_by_the_quota_still_finds_the_chunks_unpinned(
    holders: list[Holder],
) -> None:
    # LE3: a lease over the holder's quota (here its longest TTL, 60 s) is
    # refused with 429; the chunks are then found by HEAD, without a lease.
    store = ChunkStore(settings(holders[:1], lease_ms=120_000))
    assert await store.put("q-1", block())
    pins = await store.pin_many(["q-1", "q-absent"])
    assert pins[0] is not None and pins[0].lease is None and pins[1] is None
    assert store.stats.errors >= 1 and store.stats.leases == 0
    assert len(holders[0].store.leases) == 0
    assert await store.renew(pins[0], 1_000) == 0  # nothing to renew
    await store.close()
