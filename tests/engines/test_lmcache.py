"""kvstore as LMCache's remote tier (issue 10): a real ``LMCacheEngine`` on
the CPU stores KV chunks through the plug-in (loaded by LMCache from its
configuration, ``remote_storage_plugins``) into a real holder process over
mTLS; a second, fresh engine with no local cache retrieves them, and the
tensors are equal. A holder that is down makes LMCache miss, not crash."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvstore.client import HolderClient
from kvstore.integrations.chunks import ChunkSettings, ChunkStore
from kvstore.integrations.lmcache import CPUKVConnector, KvstoreConnector, geometry_of
from kvstore.protocol import container as kc

from .holder import Holder

LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 2, 8, 16
HIDDEN = HEADS * HEAD_DIM
DTYPE = torch.bfloat16
SLOTS = 256


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="toy-model",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )


def config(holder: Holder, timeout_s: int = 5) -> LMCacheEngineConfig:
    # Exactly what an operator writes (docs/integrations.md), as Python.
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,  # no local hits: every one comes from the holder
        max_local_cpu_size=0.02,  # GB: LMCache's allocation buffer, needed anyway
        blocking_timeout_secs=timeout_s,
        remote_storage_plugins=["kvstore"],
        extra_config={
            "remote_storage_plugin.kvstore.module_path": "kvstore.integrations.lmcache",
            "remote_storage_plugin.kvstore.class_name": "KvstoreConnectorAdapter",
            **holder.options(),
        },
    )


@pytest.fixture
def engines() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:  # its event-loop thread is not a daemon: always destroyed
        LMCacheEngineBuilder.destroy(name)


def engine(name: str, holder: Holder, made: list[str], timeout_s: int = 5) -> Any:
    made.append(name)
    built = LMCacheEngineBuilder.get_or_create(
        name,
        config(holder, timeout_s),
        metadata(),
        CPUKVConnector(LAYERS, HIDDEN),
        broadcast_fn=lambda t, src: None,
        broadcast_object_fn=lambda o, src: o,
    )
    built.post_init()
    return built


def remote_backend(built: Any) -> Any:
    backends = built.storage_manager.storage_backends
    (name,) = [n for n in backends if n.startswith("RemoteBackend")]
    return backends[name]


def connector(built: Any) -> KvstoreConnector:
    found = remote_backend(built).connection
    while not isinstance(found, KvstoreConnector):
        found = found._connector  # LMCache's InstrumentedRemoteConnector around ours
    return found


def wait_for_puts(built: Any, count: int, timeout_s: float = 10.0) -> None:
    """``store`` returns at once; LMCache's loop sends the chunks later."""
    stats = connector(built).store.stats
    deadline = time.monotonic() + timeout_s
    while stats.puts + stats.put_failures < count or remote_backend(built).put_tasks:
        assert time.monotonic() < deadline, f"puts did not finish: {stats}"
        time.sleep(0.02)


def test_a_fresh_engine_retrieves_what_another_stored_through_kvstore(
    holder: Holder, engines: list[str]
) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 32000, (3 * CHUNK + 5,))  # 3 chunks and a partial tail
    kv_a = torch.randn(2, LAYERS, SLOTS, HIDDEN).to(DTYPE)
    slots_a = torch.arange(100, 100 + len(tokens))
    a = engine("A", holder, engines)
    assert [type(connector(a)).__name__] == ["KvstoreConnector"]  # loaded from the config
    a.store(tokens, kvcaches=kv_a, slot_mapping=slots_a)
    wait_for_puts(a, 3)
    assert connector(a).store.stats.puts == 3 and connector(a).store.stats.put_failures == 0

    b = engine("B", holder, engines)
    kv_b = torch.zeros(2, LAYERS, SLOTS, HIDDEN, dtype=DTYPE)
    slots_b = torch.arange(10, 10 + len(tokens))
    assert b.lookup(tokens) == 3 * CHUNK
    mask = b.retrieve(tokens, kvcaches=kv_b, slot_mapping=slots_b)
    assert int(mask.sum()) == 3 * CHUNK
    assert torch.equal(kv_b[:, :, 10 : 10 + 3 * CHUNK], kv_a[:, :, 100 : 100 + 3 * CHUNK])
    assert not kv_b[:, :, 10 + 3 * CHUNK :].any()  # nothing beyond what was stored
    stats = connector(b).store.stats
    assert stats.hits == 3 and stats.leases >= 1  # the batch was leased while fetched

    # What the holder keeps is a KVSP container: per layer, the chunk's K
    # and V rows in kvsp-layout-1 (tokens slowest, little-endian elements).
    store = connector(b).store
    start, end, key = next(iter(b.token_database.process_tokens(tokens)))
    import asyncio

    async def stored() -> bytes:
        async with HolderClient(holder.context()) as http:  # type: ignore[arg-type]
            return await http.get_block(
                holder.uri, store.compat_id, store.scope_id, store.block_key(key.to_string())
            )

    container = kc.decode(asyncio.run(stored()))
    assert len(container) == LAYERS and container.token_count == end - start == CHUNK
    for layer in (0, LAYERS - 1):
        rows = kv_a[:, layer, 100 + start : 100 + end].contiguous()
        assert bytes(container.layer(layer).k) == rows[0].view(torch.uint8).numpy().tobytes()
        assert bytes(container.layer(layer).v) == rows[1].view(torch.uint8).numpy().tobytes()


def test_a_holder_that_is_down_makes_lmcache_miss_not_crash(
    holder: Holder, engines: list[str]
) -> None:
    torch.manual_seed(1)
    tokens = torch.randint(0, 32000, (2 * CHUNK,))
    kv = torch.randn(2, LAYERS, SLOTS, HIDDEN).to(DTYPE)
    slots = torch.arange(len(tokens))
    a = engine("A", holder, engines)
    a.store(tokens, kvcaches=kv, slot_mapping=slots)
    wait_for_puts(a, 2)
    b = engine("B", holder, engines, timeout_s=3)
    assert b.lookup(tokens) == 2 * CHUNK
    holder.kill()
    assert b.lookup(tokens) == 0
    # Requests that found it dead (refused at once); from then on it is
    # skipped: the retrieve and the store send nothing, they do not wait.
    tried = connector(b).store.stats.errors
    assert tried >= 1
    out = torch.zeros_like(kv)
    mask = b.retrieve(tokens, kvcaches=out, slot_mapping=slots)
    assert int(mask.sum()) == 0 and not out.any()
    b.store(torch.randint(0, 32000, (CHUNK,)), kvcaches=kv, slot_mapping=slots)  # no raise
    wait_for_puts(b, 1)
    assert connector(b).store.stats.put_failures == 1
    assert connector(b).store.stats.errors == tried
    # Back: the same engine finds its chunks again (no restart of LMCache).
    holder.start()
    time.sleep(1.1)  # past down_backoff_s
    assert b.lookup(tokens) == 0  # a holder with host memory only lost them ...
    a.store(tokens, kvcaches=kv, slot_mapping=slots)
    wait_for_puts(a, 4)
    assert b.lookup(tokens) == 2 * CHUNK  # ... and serves them once stored again


def test_the_plugin_refuses_what_it_cannot_name(tmp_path: Path) -> None:
    # Geometry comes from LMCache's metadata; the options name the model.
    geometry = geometry_of(metadata())
    assert (
        geometry.layers,
        geometry.kv_heads,
        geometry.head_dim,
        geometry.kv_dtype,
        geometry.block_tokens,
    ) == (LAYERS, HEADS, HEAD_DIM, "bf16", CHUNK)
    (tmp_path / "key").write_text(os.urandom(32).hex())
    options = {
        "holders": "http://127.0.0.1:1/kvsp/",
        "scope_key_file": str(tmp_path / "key"),
        "model": "m",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
    }
    settings = ChunkSettings.from_options(options, namespace="lmcache", geometry=geometry)
    other = ChunkSettings.from_options(options, namespace="sglang", geometry=geometry)
    assert ChunkStore(settings).block_key("x") != ChunkStore(other).block_key("x")
    from kvstore.config import ConfigError

    with pytest.raises(ConfigError, match="scope_key_file"):
        ChunkSettings.from_options(
            {**options, "scope_key_file": str(tmp_path / "none")},
            namespace="lmcache",
            geometry=geometry,
        )
    with pytest.raises(ConfigError, match="model_digest"):
        ChunkSettings.from_options(
            {**options, "model_digest": "md5"}, namespace="lmcache", geometry=geometry
        )


def test_lmcache_health_check_put_and_get_passes_again_and_again(
    holder: Holder, engines: list[str]
) -> None:
    # LMCache's RemoteBackendHealthCheck puts a buffer of arbitrary contents
    # under one fixed key (model "test", chunk hash 0) and wants it back;
    # a holder keeps the first copy of a name, so each probe gets its own.
    from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck

    b = engine("B", holder, engines)
    check = object.__new__(RemoteBackendHealthCheck)  # only what _put_and_get_check uses
    check.backend = remote_backend(b)
    check._get_ping_timeout = lambda: 10  # type: ignore[method-assign]
    backend = check.backend.local_cpu_backend
    allocate = backend.allocate

    def noisy(*args: Any, **kwargs: Any) -> Any:  # other octets in every probe's buffer
        obj = allocate(*args, **kwargs)
        if obj is not None:
            obj.tensor.copy_(torch.randn(obj.tensor.shape).to(obj.tensor.dtype))
        return obj

    backend.allocate = noisy
    try:
        results = [check._put_and_get_check() for _ in range(3)]
    finally:
        backend.allocate = allocate
    assert results == [True, True, True]


def test_the_async_loading_path_returns_the_held_prefix(holder: Holder, engines: list[str]) -> None:
    # LMCache's async loading asks batched_async_contains, then
    # batched_get_non_blocking, which returns the consecutive prefix held.
    import asyncio

    torch.manual_seed(2)
    tokens = torch.randint(0, 32000, (3 * CHUNK,))
    kv = torch.randn(2, LAYERS, SLOTS, HIDDEN).to(DTYPE)
    a = engine("A", holder, engines)
    a.store(tokens[: 2 * CHUNK], kvcaches=kv, slot_mapping=torch.arange(2 * CHUNK))
    wait_for_puts(a, 2)
    keys = [key for _, _, key in a.token_database.process_tokens(tokens)]
    ours = connector(a)

    def on_loop(coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, ours.loop).result(10)

    assert on_loop(ours.batched_async_contains("l1", keys)) == 2
    got = on_loop(ours.batched_get_non_blocking("l1", [keys[0], keys[2], keys[1]]))
    assert len(got) == 1 and torch.equal(got[0].tensor, kv[:, :, :CHUNK])
    for obj in got:
        obj.ref_count_down()


def test_unsupported_lmcache_modes_stop_lmcache_with_a_clear_error(
    holder: Holder, tmp_path: Path
) -> None:
    # LMCache logs a failing connector and runs on without its remote tier;
    # a configuration kvstore cannot serve is irrecoverable instead.
    import asyncio
    from types import SimpleNamespace

    from lmcache.v1.exceptions import IrrecoverableException

    from kvstore.integrations.lmcache import KvstoreConnectorAdapter

    adapter = KvstoreConnectorAdapter()
    assert adapter.can_parse("plugin://kvstore") and not adapter.can_parse("plugin://fs")
    for change, match in (
        ({"use_layerwise": True}, "use_layerwise"),
        ({"remote_serde": "cachegen"}, "remote_serde"),
    ):
        cfg = config(holder)
        for name, value in change.items():
            setattr(cfg, name, value)
        context = SimpleNamespace(
            config=cfg,
            metadata=metadata(),
            loop=asyncio.new_event_loop(),
            local_cpu_backend=None,
            url="plugin://kvstore",
            plugin_name="kvstore",
        )
        with pytest.raises(IrrecoverableException, match=match):
            adapter.create_connector(context)
    cfg = config(holder)
    cfg.extra_config = {**cfg.extra_config, "kvstore.model_digest": "md5"}
    context = SimpleNamespace(
        config=cfg,
        metadata=metadata(),
        loop=asyncio.new_event_loop(),
        local_cpu_backend=None,
        url="plugin://kvstore",
        plugin_name="kvstore",
    )
    with pytest.raises(IrrecoverableException, match="model_digest"):
        adapter.create_connector(context)
