"""Holder sets (kvstore.holderset) and the layout of a holder's workers
(kvstore.workers, docs/workers.md), without processes: rendezvous order,
failover, discovery, each worker's port, URI and share of storage, the
``workers`` key, a policy naming every worker's URI, the worker label."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from pathlib import Path

import pytest

from kvstore.config import ConfigError, StorageConfig, TierConfig, check, load
from kvstore.cores import available_cores
from kvstore.holderset import HolderSet, NoHolder, rank
from kvstore.metrics import Metrics
from kvstore.protocol._bytes import BytesLike
from kvstore.protocol.problems import BadRequest, KvspError, NotFound, PreconditionFailed
from kvstore.protocol.records import ReplicaRecord
from kvstore.security import Policy
from kvstore.settings import HolderSettings
from kvstore.workers import (
    DEFAULT_PREFIX,
    worker_config,
    worker_storage,
    worker_uri,
)

A, B, C = (f"https://h:{p}/kvsp/" for p in (8443, 8444, 8445))
KEYS = [hashlib.sha256(bytes([n])).hexdigest() for n in range(64)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeHolders:
    """Holders as a client sees them: each has blocks, or fails, or lists shards."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[str]] = {}
        self.failing: set[str] = set()
        self.refusing: set[str] = set()
        self.listing: dict[str, list[str] | Exception] = {}
        self.calls: list[tuple[str, str]] = []

    def _call(self, what: str, holder: str) -> None:
        self.calls.append((what, holder))
        if holder in self.failing:
            raise KvspError(f"{holder}: connection refused")  # transport: status 500
        if holder in self.refusing:
            raise BadRequest("refused")

    async def put_block(
        self, holder: str, compat_id: str, scope_id: str, block_key: str, data: BytesLike
    ) -> ReplicaRecord:
        self._call("put", holder)
        held = self.blocks.setdefault(holder, set())
        if block_key in held:
            raise PreconditionFailed("held")
        held.add(block_key)
        return None  # type: ignore[return-value]  # the set passes it through

    async def get_block(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        *,
        layers: tuple[int, int] | None = None,
        codec: int | None = None,
        record: ReplicaRecord | None = None,
    ) -> bytes:
        self._call("get", holder)
        if block_key not in self.blocks.get(holder, set()):
            raise NotFound("no such block")
        return holder.encode()

    async def shards(self, holder: str) -> list[str]:
        self._call("shards", holder)
        listed = self.listing.get(holder, NotFound("no shards here"))
        if isinstance(listed, Exception):
            raise listed
        return listed


def test_rank_is_the_rendezvous_order_every_client_computes() -> None:
    for key in KEYS[:8]:
        expected = sorted([A, B, C], key=lambda h: hashlib.sha256((h + key).encode()).digest())
        assert rank([C, A, B], key) == rank([B, C, A], key) == expected
    firsts = [rank([A, B, C], k)[0] for k in KEYS]
    assert all(firsts.count(h) >= 10 for h in (A, B, C)), firsts  # spread
    # Removing a holder moves only the blocks it took.
    for key in KEYS:
        if rank([A, B, C], key)[0] != C:
            assert rank([A, B], key)[0] == rank([A, B, C], key)[0]


async def test_a_failing_holder_is_skipped_and_its_blocks_go_to_the_next() -> None:
    clock, client = Clock(), FakeHolders()
    holders = HolderSet([A, B], down_s=5.0, clock=clock)
    key = next(k for k in KEYS if rank([A, B], k)[0] == A)
    client.failing.add(A)
    assert (await holders.put_block(client, "c", "s", key, b"x"))[0] == B
    assert not holders.up(A) and holders.order(key) == [B, A]
    # Read back: A is skipped while down; B serves it.
    assert await holders.get_block(client, "c", "s", key) == (B, B.encode())
    assert ("get", A) not in client.calls
    clock.now += 5.0  # A is tried again; it is back and lacks the block: next
    client.failing.clear()
    assert holders.order(key) == [A, B]
    assert await holders.get_block(client, "c", "s", key) == (B, B.encode())
    assert (await holders.put_block(client, "c", "s", key, b"x"))[0] == A  # its place again


async def test_refusals_are_raised_and_misses_are_not_found() -> None:
    client = FakeHolders()
    holders = HolderSet([A, B])
    client.refusing.add(A)
    client.refusing.add(B)
    with pytest.raises(BadRequest):
        await holders.put_block(client, "c", "s", KEYS[0], b"x")
    assert holders.up(A) and holders.up(B)  # a refusal is no failure of the holder
    with pytest.raises(NotFound):
        await HolderSet([A, B]).get_block(FakeHolders(), "c", "s", KEYS[0])
    client = FakeHolders()
    client.failing.update((A, B))
    with pytest.raises(NoHolder):
        await HolderSet([A, B]).put_block(client, "c", "s", KEYS[0], b"x")
    with pytest.raises(NoHolder):
        await HolderSet([A, B]).get_block(client, "c", "s", KEYS[0])
    # A block already held counts as stored, with no record.
    client = FakeHolders()
    first = rank([A], KEYS[1])[0]
    client.blocks[first] = {KEYS[1]}
    assert await HolderSet([A]).put_block(client, "c", "s", KEYS[1], b"x") == (first, None)


async def test_discovery_lists_every_worker_once_and_keeps_a_seed_that_has_none() -> None:
    client = FakeHolders()
    other = "https://other:9000/kvsp/"
    client.listing[A] = [A, B.rstrip("/")]  # a worker's list (slash or not)
    client.listing[B] = [A, B]
    holders = HolderSet([A, B, other])
    assert await holders.discover(client) == (A, B, other)  # other: a 404, itself
    assert holders.discovered
    client.listing[A] = KvspError("unreachable")
    again = HolderSet([A])
    assert await again.discover(client) == (A,) and not again.discovered  # asked again later
    with pytest.raises(ValueError):
        HolderSet([])


def test_each_worker_has_its_port_uri_and_share_of_every_tier(tmp_path: Path) -> None:
    assert worker_uri("https://h.example:8443/kvsp/", 3) == "https://h.example:8446/kvsp/"
    assert worker_uri("https://h.example/kvsp/", 1) == "https://h.example:444/kvsp/"
    assert worker_uri("http://[::1]:80/k/", 2) == "http://[::1]:82/k/"
    storage = StorageConfig(
        tiers=(
            TierConfig("host", 1000),
            TierConfig("lmdb", 3000, {"path": str(tmp_path / "l")}),
            TierConfig("redis", 900, {"url": "redis://x"}),
            TierConfig("s3", 600, {"prefix": "p/"}),
        )
    )
    one = worker_storage(storage, 1, 3)
    assert [t.capacity for t in one.tiers] == [333, 1000, 300, 200]
    assert one.tiers[1].options["path"] == str(tmp_path / "l" / "worker-1")
    assert one.tiers[2].options == {"url": "redis://x", "prefix": "kvstore:w1:"}
    assert one.tiers[3].options == {"prefix": "p/w1/"}
    assert one.tiers[0].options.get("workers") == 3  # the host tier's prefault guard
    # The defaults a worker's prefix extends are the backends' own.
    from kvstore.backends.redis import RedisTier
    from kvstore.backends.s3 import S3Tier

    for backend, cls in (("redis", RedisTier), ("s3", S3Tier)):
        assert inspect.signature(cls).parameters["prefix"].default == DEFAULT_PREFIX[backend]


def _file(tmp_path: Path, server: str, holder: str = "") -> Path:
    (tmp_path / "p.json").write_text('{"principals": {}}')
    file = tmp_path / "k.toml"
    file.write_text(
        f"[server]\nport = 9443\ninsecure_http = true\n{server}\n[holder]\n"
        f'uri = "http://127.0.0.1:9443/kvsp/"\npolicy = "p.json"\n{holder}\n'
        '[[storage.tiers]]\nbackend = "host"\ncapacity = 1000\n'
    )
    return file


def test_the_workers_key_auto_the_environment_and_its_checks(tmp_path: Path) -> None:
    assert load(_file(tmp_path, "")).server.workers == 1
    assert load(_file(tmp_path, 'workers = "auto"')).server.workers == available_cores()
    config = load(_file(tmp_path, ""), {"KVSTORE_SERVER__WORKERS": "auto"})
    assert config.server.workers == available_cores()
    config = load(_file(tmp_path, "workers = 3"))
    assert check(config, ("holder",)) == []
    assert any("serve the holder role alone" in p for p in check(config, ("holder", "index")))
    zero = dataclasses.replace(config, server=dataclasses.replace(config.server, workers=0))
    assert check(zero, ("holder",)) == ['server.workers: at least 1 (or "auto": one per core)']
    ephemeral = dataclasses.replace(config, server=dataclasses.replace(config.server, port=0))
    assert "consecutive ports" in check(ephemeral, ("holder",))[0]
    with pytest.raises(ConfigError, match=r"server\.workers"):
        load(_file(tmp_path, 'workers = "many"'))

    second = worker_config(config, 2)
    assert second.server.port == 9445 and second.server.workers == 1
    assert second.holder.uri == "http://127.0.0.1:9445/kvsp/"
    assert second.holder.shards == tuple(f"http://127.0.0.1:{p}/kvsp/" for p in (9443, 9444, 9445))
    assert second.storage.tiers[0].capacity == 333
    assert check(second, ("holder",)) == []
    assert second.server.unix_socket == ""
    proxied = dataclasses.replace(
        config,
        server=dataclasses.replace(
            config.server, unix_socket="/run/kv/kvstore.sock", trusted_proxy="unix"
        ),
    )
    assert worker_config(proxied, 2).server.unix_socket == "/run/kv/kvstore-2.sock"
    assert second.server.proxy_port == 0
    sidecar = dataclasses.replace(
        config,
        server=dataclasses.replace(config.server, proxy_port=9500, trusted_proxy="127.0.0.6"),
    )
    assert [worker_config(sidecar, i).server.proxy_port for i in range(3)] == [9500, 9501, 9502]


def test_a_policy_may_name_every_worker_uri_of_one_holder() -> None:
    policy = Policy.from_json({"principals": {"urn:h": {"roles": ["holder"], "holder": [A, B]}}})
    grant = policy.grant("urn:h")
    assert grant.holder == A and grant.holders == (A, B)
    assert grant.acts_as_holder(lambda u: u == B) and not grant.acts_as_holder(lambda u: u == C)
    with pytest.raises(ValueError, match=r"holder\[1\]"):
        Policy.from_json({"principals": {"urn:h": {"holder": [A, "ftp://x"]}}})
    with pytest.raises(ValueError, match="empty array"):
        Policy.from_json({"principals": {"urn:h": {"holder": []}}})


def test_a_workers_metrics_carry_its_label() -> None:
    metrics = Metrics()
    metrics.requests.labels("r", "GET", "200").inc()
    assert b'route="r",status="200"} 1.0' in metrics.render()
    metrics.labels = {"worker": "1"}
    assert b'route="r",status="200",worker="1"} 1.0' in metrics.render()


def test_shards_default_to_the_holder_alone() -> None:
    assert HolderSettings("https://h/kvsp/").shards == ()


async def test_an_instance_writes_each_block_to_one_worker_of_each_target() -> None:
    # store_blocks_to names targets; a target run as workers lists them
    # (asked once); each block goes to its rendezvous worker of each target.
    from kvstore.instance.runtime import BlockWriter
    from kvstore.storage import BlockRef

    client = FakeHolders()
    client.listing[A] = [A, B]
    writer = BlockWriter(client, [A, C])  # type: ignore[arg-type]  # a fake's types
    refs = [BlockRef("c" * 64, "5" * 32, k) for k in KEYS[:12]]
    for r in refs:
        await writer.write_now(r, b"x")
    assert writer.written == 24 and writer.failed == 0
    assert [c for c in client.calls if c[0] == "shards"] == [("shards", A), ("shards", C)]
    for r in refs:
        assert r.block_key in client.blocks[rank([A, B], r.block_key)[0]]
        assert r.block_key in client.blocks[C]
    assert client.blocks[A] and client.blocks[B]


async def test_a_full_holder_passes_a_block_on_and_discovery_backs_off() -> None:
    from kvstore.protocol.problems import InsufficientStorage

    class Full(FakeHolders):
        async def put_block(self, holder: str, *args: object) -> ReplicaRecord:
            if holder == A:
                self.calls.append(("put", holder))
                raise InsufficientStorage("no room")
            return await super().put_block(holder, *args)  # type: ignore[arg-type]

    client = Full()
    holders = HolderSet([A, B])
    key = next(k for k in KEYS if rank([A, B], k)[0] == A)
    assert (await holders.put_block(client, "c", "s", key, b"x"))[0] == B
    assert holders.up(A)  # full, not failed: its other blocks still go there

    clock = Clock()
    client = FakeHolders()
    client.listing[A] = KvspError("unreachable")
    client.listing[B] = BadRequest("no such resource here")  # another implementation
    holders = HolderSet([A, B], clock=clock)
    assert holders.needs_discovery()
    await holders.discover(client)
    assert not holders.discovered and not holders.needs_discovery()  # not at every block
    clock.now += HolderSet.rediscover_s
    assert holders.needs_discovery()
    client.listing[A] = [A]
    await holders.discover(client)
    assert holders.discovered and holders.holders == (A, B)  # a 4xx: B stands for itself
