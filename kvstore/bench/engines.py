"""``kvstore bench engines``: chunk round trips through the LMCache plug-in,
LMCache's MP-mode L2 adapter and the SGLang HiCache backend, each against
:class:`kvstore.client.HolderClient` moving the same octets, with the same
concurrency, to the same holder process (mTLS, host memory) in the same run.

The plug-ins' costs beyond the client are theirs: naming (one HMAC a
chunk), a lease around every batched get (two more requests per holder and
batch; the MP adapter's lookup-and-lock is its lease, and its unlock the
release), the copies between the engine's buffers and the container (one
each way; SGLang's page_first pages one more on puts, strided per layer),
and the engine's own machinery (LMCache's event loop thread,
SGLang's synchronous calls through a loop thread). Runs in the engines'
virtualenv (``make engines``), where LMCache and SGLang are installed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from . import Result
from .holder import Servers

# A 16-layer model with 8 KV heads of 128 in bf16: 64 tokens are 4 MiB.
LAYERS, HEADS, HEAD_DIM, TOKENS = 16, 8, 128, 64
CONCURRENCY = 16


def _options(root: Path, uri: str) -> dict[str, str]:
    key = root / "scope.key"
    if not key.exists():
        key.write_text(os.urandom(32).hex())
    certs = root / "certs"
    return {
        "kvstore.holders": uri,
        "kvstore.scope_key_file": str(key),
        "kvstore.cafile": str(certs / "ca.pem"),
        "kvstore.certfile": str(certs / "client-bench.pem"),
        "kvstore.keyfile": str(certs / "client-bench.key"),
        "kvstore.model": "bench",
        "kvstore.model_digest": "sha-256:" + "1" * 64,
        "kvstore.tokenizer_digest": "sha-256:" + "2" * 64,
    }


def _direct(
    servers: Servers, uri: str, container: bytes, count: int, rounds: int
) -> tuple[float, float]:
    """Seconds to PUT then to GET ``count`` containers with kvstore.client
    (the fastest of ``rounds``, each on fresh names)."""
    from ..client import HolderClient

    compat, scope = "e" * 64, "f" * 32

    async def rounds_of() -> list[tuple[float, float]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        out = []
        # One pooled client for every round, as each plug-in keeps its own.
        async with HolderClient(servers.client_ssl()) as http:

            async def put(key: str) -> None:
                async with gate:
                    await http.put_block(uri, compat, scope, key, container)

            async def get(key: str) -> None:
                async with gate:
                    await http.get_block(uri, compat, scope, key)

            for round_ in range(rounds + 1):  # round 0 warms the pool up
                keys = [f"{round_:032x}{i:032x}" for i in range(count)]
                started = time.perf_counter()
                await asyncio.gather(*(put(k) for k in keys))
                middle = time.perf_counter()
                await asyncio.gather(*(get(k) for k in keys))
                out.append((middle - started, time.perf_counter() - middle))
        return out[1:]

    runs = asyncio.run(rounds_of())
    return min(p for p, _ in runs), min(g for _, g in runs)


def _lmcache(root: Path, uri: str, count: int, rounds: int) -> tuple[float, float]:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    from ..integrations.lmcache import CPUKVConnector, KvstoreConnector

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=TOKENS,
        local_cpu=False,
        max_local_cpu_size=2 * count * 4 / 1024 + 0.1,
        remote_storage_plugins=["kvstore"],
        blocking_timeout_secs=60,
        extra_config={
            "remote_storage_plugin.kvstore.module_path": "kvstore.integrations.lmcache",
            "remote_storage_plugin.kvstore.class_name": "KvstoreConnectorAdapter",
            **_options(root, uri),
        },
    )
    metadata = LMCacheMetadata(
        model_name="bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, TOKENS, HEADS, HEAD_DIM),
        chunk_size=TOKENS,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        "kvstore-bench",
        config,
        metadata,
        CPUKVConnector(LAYERS, HEADS * HEAD_DIM),
        broadcast_fn=lambda t, src: None,
        broadcast_object_fn=lambda o, src: o,
    )
    try:
        engine.post_init()
        backends = engine.storage_manager.storage_backends
        backend = next(b for n, b in backends.items() if n.startswith("RemoteBackend"))
        connector = backend.connection
        while not isinstance(connector, KvstoreConnector):
            connector = connector._connector
        shape = torch.Size([2, LAYERS, TOKENS, HEADS * HEAD_DIM])
        objs = []
        for _ in range(count):
            obj = connector.local_cpu_backend.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(torch.randn(shape).to(torch.bfloat16))
            objs.append(obj)

        def on_loop(coroutine: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coroutine, connector.loop).result(120)

        def once(round_: int) -> tuple[float, float]:
            keys = [
                CacheEngineKey("bench", 1, 0, round_ * 100_000 + i, torch.bfloat16)
                for i in range(count)
            ]
            started = time.perf_counter()
            on_loop(connector.batched_put(keys, objs))
            middle = time.perf_counter()
            got = on_loop(connector.batched_get(keys))
            done = time.perf_counter()
            assert all(g is not None for g in got), "a chunk did not come back"
            assert torch.equal(got[0].tensor, objs[0].tensor)
            for g in got:
                g.ref_count_down()
            return middle - started, done - middle

        runs = [once(r) for r in range(rounds + 1)][1:]  # round 0 warms up
        return min(p for p, _ in runs), min(g for _, g in runs)
    finally:
        LMCacheEngineBuilder.destroy("kvstore-bench")


def _lmcache_mp(root: Path, uri: str, count: int, rounds: int) -> tuple[float, float]:
    """Seconds to store, then to look up, lock, load and unlock ``count``
    chunks through the MP-mode L2 adapter, submitted as LMCache's
    controllers submit them (one task per batch, completion by event fd)."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    import select

    import torch
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.platform.event_notifier import consume_fd

    from ..integrations.lmcache_mp import KvstoreL2Adapter

    shape = torch.Size([2, LAYERS, TOKENS, HEADS * HEAD_DIM])

    def chunk(data: torch.Tensor) -> Any:
        meta = MemoryObjMetadata(
            shape=shape,
            dtype=torch.bfloat16,
            address=0,
            phy_size=data.numel() * 2,
            ref_count=1,
            fmt=MemoryFormat.KV_2LTD,
            shapes=[shape],
            dtypes=[torch.bfloat16],
        )
        return TensorMemoryObj(data, meta, None)

    params: dict[str, Any] = {k.removeprefix("kvstore."): v for k, v in _options(root, uri).items()}
    params.update(
        layers=LAYERS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        kv_dtype="bf16",
        chunk_size=TOKENS,
        timeout_s=60,
    )
    adapter = KvstoreL2Adapter(params)

    def wait(fd: int, result: Any) -> Any:
        while (found := result()) is None:  # as LMCache's controllers wait
            if select.select([fd], [], [], 1.0)[0]:
                consume_fd(fd)
        return found

    try:
        sources = [chunk(torch.randn(shape.numel()).to(torch.bfloat16)) for _ in range(count)]
        targets = [chunk(torch.zeros(shape.numel(), dtype=torch.bfloat16)) for _ in range(count)]

        def once(round_: int) -> tuple[float, float]:
            keys = [
                ObjectKey(
                    chunk_hash=(round_ * 100_000 + i).to_bytes(8, "big"),
                    model_name="bench",
                    kv_rank=1 << 24,
                )
                for i in range(count)
            ]
            started = time.perf_counter()
            task = adapter.submit_store_task(keys, sources)
            stored = wait(
                adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task)
            )
            middle = time.perf_counter()
            task = adapter.submit_lookup_and_lock_task(keys, {})
            found = wait(
                adapter.get_lookup_and_lock_event_fd(),
                lambda: adapter.query_lookup_and_lock_result(task),
            )
            task = adapter.submit_load_task(keys, targets)
            loaded = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
            adapter.submit_unlock(keys)
            done = time.perf_counter()
            assert stored.is_successful(), "a chunk was not stored"
            assert all(found.test(i) and loaded.test(i) for i in range(count)), "a chunk missed"
            assert torch.equal(targets[-1].tensor, sources[-1].tensor)
            return middle - started, done - middle

        runs = [once(r) for r in range(rounds + 1)][1:]  # round 0 warms up
        return min(p for p, _ in runs), min(g for _, g in runs)
    finally:
        adapter.close()


def _sglang(root: Path, uri: str, count: int, rounds: int) -> tuple[float, float]:
    from . import sglang_stubs

    sglang_stubs.install()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    device = MHATokenToKVPool(
        size=count * TOKENS,
        page_size=TOKENS,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        TOKENS,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KvstoreHiCacheStorage",
        "interface_v1": 1,
        **_options(root, uri),
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    try:
        src = host.alloc(count * TOKENS)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(torch.bfloat16))
        dst = host.alloc(count * TOKENS)

        def once(round_: int) -> tuple[float, float]:
            keys = [f"{round_:032x}{i:032x}" for i in range(count)]
            started = time.perf_counter()
            assert all(backend.batch_set_v1(keys, src))
            middle = time.perf_counter()
            assert all(backend.batch_get_v1(keys, dst))
            return middle - started, time.perf_counter() - middle

        runs = [once(r) for r in range(rounds + 1)][1:]  # round 0 warms up
        return min(p for p, _ in runs), min(g for _, g in runs)
    finally:
        backend.close()


def run(quick: bool = False) -> list[Result]:
    from ..protocol import container as kc

    count, rounds = (8, 2) if quick else (32, 3)
    section = TOKENS * HEADS * HEAD_DIM * 2
    container = bytes(
        kc.encode([(os.urandom(section), os.urandom(section))] * LAYERS, token_count=TOKENS)
    )
    mib = count * len(container) / 2**20
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-engines-") as tmp:
        root = Path(tmp)
        servers = Servers(root)
        try:
            uri = servers.holder("host", tls=True)
            put_s, get_s = _direct(servers, uri, container, count, rounds)
            lm_put, lm_get = _lmcache(root, uri, count, rounds)
            mp_put, mp_get = _lmcache_mp(root, uri, count, rounds)
            sg_put, sg_get = _sglang(root, uri, count, rounds)
        finally:
            servers.close()
    size = f"{len(container) / 2**20:.0f} MiB chunks x {count}"
    return [
        Result(
            f"LMCache plug-in put, {size}",
            "MiB/s",
            mib / lm_put,
            "kvstore.client put_block",
            mib / put_s,
        ),
        Result(
            f"LMCache plug-in get, {size}",
            "MiB/s",
            mib / lm_get,
            "kvstore.client get_block",
            mib / get_s,
        ),
        Result(
            f"LMCache MP L2 adapter store, {size}",
            "MiB/s",
            mib / mp_put,
            "kvstore.client put_block",
            mib / put_s,
            goal=0.8,
        ),
        Result(
            f"LMCache MP L2 adapter lookup+lock, load, unlock, {size}",
            "MiB/s",
            mib / mp_get,
            "kvstore.client get_block",
            mib / get_s,
            goal=0.8,
        ),
        Result(
            f"SGLang batch_set_v1, {size}",
            "MiB/s",
            mib / sg_put,
            "kvstore.client put_block",
            mib / put_s,
        ),
        Result(
            f"SGLang batch_get_v1, {size}",
            "MiB/s",
            mib / sg_get,
            "kvstore.client get_block",
            mib / get_s,
        ),
    ]
