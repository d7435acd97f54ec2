"""kvstore as SGLang's HiCache storage backend (issue 10): SGLang's own CPU
host pool (``MHATokenToKVPoolHost``, ``page_first``) round-trips pages
through the backend, created by SGLang's factory from the dynamic
configuration, into a real holder process over mTLS: zero-copy
(``batch_set_v1`` / ``batch_get_v1`` against the registered pool) and
copying (``set`` / ``batch_get`` with flat pages, as the controller does);
a pool of another layout reads the same pages; a holder that is down
makes pages miss. The v2 batch interface of hybrid models moves the KV
pool's pages (v1's blocks) and SGLang's own Mamba host pool's and a
sliding-window KV pool's pages, with the hit policies counted as SGLang's
own file backend counts them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore.bench import sglang_stubs

sglang_stubs.install()

from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvstore.integrations.sglang import KvstoreHiCacheStorage, canonical_page  # noqa: E402
from kvstore.protocol import container as kc  # noqa: E402

from .holder import Holder  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS, PAGES = 3, 2, 8, 4, 32, 4
DTYPE = torch.bfloat16


def host_pool(layout: str, layers: int = LAYERS) -> Any:
    device = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )


def backend(
    holder: Holder, pool: Any, tp_rank: int = 0, pp: tuple[int, int] = (0, 1)
) -> KvstoreHiCacheStorage:
    # What --hicache-storage-backend-extra-config carries (docs/integrations.md).
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KvstoreHiCacheStorage",
        "interface_v1": 1,
        **holder.options(),
    }
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2 if tp_rank else 1,
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="toy-model",
        extra_config=extra,
    )
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(made, KvstoreHiCacheStorage)
    made.register_mem_pool_host(pool)  # as SGLang's controller does, right after
    return made


def fill(pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """Random K/V into the pool's pages; returns each page, flat, as SGLang sees it."""
    pages = []
    for p in range(0, len(indices), PAGE):
        data = torch.randn(pool.get_dummy_flat_data_page().shape).to(DTYPE)
        pool.set_from_flat_data_page(int(indices[p]), data)
        pages.append(data)
    return pages


def read(pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for p in range(0, len(indices), PAGE):
        page = torch.zeros(pool.get_dummy_flat_data_page().shape, dtype=DTYPE)
        # set_from_flat_data_page's inverse for every layout: the flat page.
        page.copy_(pool.get_data_page(int(indices[p]), flat=True))
        out.append(page)
    return out


def held(holder: Holder, store: KvstoreHiCacheStorage, name: str) -> kc.Container:
    """The container a holder keeps under a chunk name."""
    import asyncio

    from kvstore.client import HolderClient

    chunks = store.store
    assert chunks is not None

    async def get() -> bytes:
        async with HolderClient(holder.context()) as http:  # type: ignore[arg-type]
            return await http.get_block(
                holder.uri, chunks.compat_id, chunks.scope_id, chunks.block_key(name)
            )

    return kc.decode(asyncio.run(get()))


@pytest.fixture
def made() -> Iterator[list[KvstoreHiCacheStorage]]:
    backends: list[KvstoreHiCacheStorage] = []
    yield backends
    for found in backends:
        found.close()


def test_pages_round_trip_zero_copy_through_a_real_holder(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    torch.manual_seed(0)
    pool = host_pool("page_first")
    store = backend(holder, pool)
    made.append(store)
    keys = get_storage_hash_str(list(range(100, 100 + PAGES * PAGE)), None, page_size=PAGE)
    extra = HiCacheStorageExtraInfo(prefix_keys=[])
    src = pool.alloc(PAGES * PAGE)
    fill(pool, src)
    written = read(pool, src)
    assert store.batch_exists(keys, extra) == 0
    assert store.batch_set_v1(keys, src, extra) == [True] * PAGES
    assert store.batch_exists(keys, extra) == PAGES
    assert store.batch_exists([*keys[:2], "f" * 64, *keys[3:]], extra) == 2
    # Into other slots, in another order, of a pool whose pages were zeroed.
    for p in range(0, len(src), PAGE):
        pool.set_from_flat_data_page(int(src[p]), pool.get_dummy_flat_data_page())
    pool.free(src)
    dst = pool.alloc(PAGES * PAGE)
    dst = torch.flip(dst.view(-1, PAGE), [0]).reshape(-1)
    assert store.batch_get_v1(keys[::-1], dst, extra) == [True] * PAGES
    for want, got in zip(written[::-1], read(pool, dst), strict=True):
        assert torch.equal(want, got)
    assert store.batch_get_v1(["0" * 64], dst[:PAGE], extra) == [False]
    assert store.store is not None and store.store.stats.leases >= 1

    # A page on the holder is a KVSP container: per layer, K then V, each
    # page x heads x head_dim in kvsp-layout-1.
    container = held(holder, store, keys[0] + "@0/1")
    page = written[0].view(2, PAGE, LAYERS, HEADS, HEAD_DIM)  # page_first's flat page
    assert len(container) == LAYERS and container.token_count == PAGE
    assert (
        bytes(container.layer(1).k)
        == page[0, :, 1].contiguous().view(torch.uint8).numpy().tobytes()
    )
    assert (
        bytes(container.layer(2).v)
        == page[1, :, 2].contiguous().view(torch.uint8).numpy().tobytes()
    )


def test_the_copying_interface_and_another_layout_share_the_pages(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    torch.manual_seed(1)
    pool = host_pool("page_first")
    store = backend(holder, pool)
    made.append(store)
    keys = get_storage_hash_str(list(range(7, 7 + PAGES * PAGE)), None, page_size=PAGE)
    src = pool.alloc(PAGES * PAGE)
    fill(pool, src)
    written = read(pool, src)
    # What HiCacheController._generic_page_set does.
    assert store.set(keys[0], pool.get_data_page(int(src[0])))
    assert store.batch_set(
        keys[1:], [pool.get_data_page(int(src[i * PAGE])) for i in range(1, PAGES)]
    )
    # ... and _generic_page_get, into dummy flat pages.
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, written, strict=True))
    assert store.get("0" * 64, pool.get_dummy_flat_data_page()) is None
    assert store.exists(keys[0]) and not store.exists("0" * 64)

    # Servers whose host pools have the other layouts read the same pages,
    # zero-copy and copying; and write pages page_first reads back.
    canonical = [w.view(2, PAGE, LAYERS, HEADS, HEAD_DIM).transpose(1, 2) for w in written]
    for layout in ("layer_first", "page_first_direct", "page_head"):
        other_pool = host_pool(layout)
        other = backend(holder, other_pool)
        made.append(other)
        dst = other_pool.alloc(PAGES * PAGE)
        assert other.batch_get_v1(keys, dst) == [True] * PAGES, layout
        for p, want in zip(range(0, len(dst), PAGE), canonical, strict=True):
            page = canonical_page(
                other_pool.get_data_page(int(dst[p]), flat=False), layout, other.geometry
            )
            assert torch.equal(page, want), layout
        flat = other.batch_get(keys[:1], [other_pool.get_dummy_flat_data_page()])[0]
        assert flat is not None
        other_pool.set_from_flat_data_page(int(dst[0]), flat)  # what SGLang does with it
        page = canonical_page(
            other_pool.get_data_page(int(dst[0]), flat=False), layout, other.geometry
        )
        assert torch.equal(page, canonical[0]), layout
        mine = get_storage_hash_str([layout.__len__()] * PAGE, None, page_size=PAGE)
        assert other.batch_set_v1(mine, dst[:PAGE]) == [True]
        back = pool.alloc(PAGE)
        assert store.batch_get_v1(mine, back) == [True]
        assert torch.equal(
            canonical_page(
                pool.get_data_page(int(back[0]), flat=False), "page_first", store.geometry
            ),
            page,
        ), layout
    # Other tensor-parallel ranks hold other heads, other pipeline stages
    # other layers (with the same geometry): their names differ.
    for ranks in ({"tp_rank": 1}, {"pp": (1, 2)}):
        elsewhere = backend(holder, pool, **ranks)
        made.append(elsewhere)
        assert elsewhere.batch_exists(keys) == 0, ranks


def test_a_holder_that_is_down_makes_pages_miss(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    pool = host_pool("page_first")
    store = backend(holder, pool)
    made.append(store)
    keys = get_storage_hash_str(list(range(PAGES * PAGE)), None, page_size=PAGE)
    src = pool.alloc(PAGES * PAGE)
    fill(pool, src)
    assert store.batch_set_v1(keys, src) == [True] * PAGES
    holder.kill()
    assert store.batch_exists(keys) == 0
    assert store.store is not None
    # Requests that found it dead (refused at once); from then on it is
    # skipped: later calls are misses that send nothing, not waits.
    tried = store.store.stats.errors
    assert tried >= 1
    dst = pool.alloc(PAGES * PAGE)
    before = read(pool, dst)
    assert store.batch_get_v1(keys, dst) == [False] * PAGES
    assert all(torch.equal(a, b) for a, b in zip(before, read(pool, dst), strict=True))
    assert store.batch_set_v1(keys, src) == [False] * PAGES
    assert not store.set(keys[0], pool.get_data_page(int(src[0])))
    assert store.store.stats.errors == tried


def test_sglang_threads_calling_at_once_are_served(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    # SGLang's prefetch, backup and lookup threads call the backend at the
    # same time; each call waits on the backend's own event loop.
    import threading

    pool = host_pool("page_first")
    store = backend(holder, pool)
    made.append(store)
    errors: list[BaseException] = []
    slots = [pool.alloc(PAGE) for _ in range(6)]
    for s in slots:
        fill(pool, s)

    def work(n: int) -> None:
        try:
            keys = get_storage_hash_str([n] * PAGE, None, page_size=PAGE)
            assert store.batch_set_v1(keys, slots[n]) == [True]
            assert store.batch_exists(keys) == 1
            assert store.batch_get_v1(keys, slots[n]) == [True]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_sglangs_controller_attaches_the_backend_and_moves_pages(
    holder: Holder, interface_v1: int
) -> None:
    # HiCacheController.attach_storage_backend("dynamic", ...) builds the
    # backend from the extra configuration and picks its page functions
    # (zero-copy with interface_v1, copying without); the functions its
    # backup and prefetch threads call move pages through kvstore. The
    # controller is built without a scheduler (only what attaching needs).
    import threading
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    torch.manual_seed(3)
    pool = host_pool("page_first")
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KvstoreHiCacheStorage",
        "interface_v1": interface_v1,
        **holder.options(),
    }

    def storage_config(model_name: str, extra_config: dict[str, Any]) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=model_name,
            extra_config=extra_config,
        )

    controller: Any = object.__new__(HiCacheController)
    controller.enable_storage = False
    controller.storage_stop_event = threading.Event()
    controller.storage_host_pool = controller.mem_pool_host = pool
    controller.host_memory_mode = "cache"
    controller.page_size = PAGE
    controller._stop_storage_threads = controller._start_storage_threads = lambda: None
    controller._create_sync_groups = lambda: []
    controller._generate_storage_config = storage_config
    with get_parallel().override(attn_dcp_size=1):
        controller.attach_storage_backend(
            "dynamic", model_name="toy-model", storage_backend_extra_config=extra
        )
    backend_made = controller.storage_backend
    try:
        assert isinstance(backend_made, KvstoreHiCacheStorage)
        expected = (
            ("_page_set_zero_copy", "_page_get_zero_copy")
            if interface_v1
            else ("_generic_page_set", "_generic_page_get")
        )
        assert (controller.page_set_func.__name__, controller.page_get_func.__name__) == expected
        keys = get_storage_hash_str(list(range(50, 50 + PAGES * PAGE)), None, page_size=PAGE)
        src = pool.alloc(PAGES * PAGE)
        fill(pool, src)
        written = read(pool, src)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        assert controller.page_set_func(keys, src, info) is True
        dst = pool.alloc(PAGES * PAGE)
        operation = SimpleNamespace(request_id="r1", is_terminated=lambda: False)
        assert controller.page_get_func(operation, keys, dst, info) == PAGES
        assert all(torch.equal(a, b) for a, b in zip(written, read(pool, dst), strict=True))
    finally:
        backend_made.close()


# --- v2 batch interface (hybrid models' pools) -------------------------------------

KV, MAMBA, SWA = PoolName.KV, PoolName.MAMBA, PoolName.SWA
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


def mamba_pool() -> Any:
    """SGLang's own Mamba host pool on the CPU: per slot (a page of one
    slot), every layer's temporal (fp32) and conv (bf16) state."""
    slots = 16
    info = MambaStateBufferInfo(
        temporal=torch.zeros(LAYERS, slots, 3, 4, dtype=torch.float32),
        conv=(torch.zeros(LAYERS, slots, 5, 2, dtype=DTYPE),),
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )


def hybrid(holder: Holder, made: list[KvstoreHiCacheStorage]) -> tuple[Any, ...]:
    """A backend with a KV pool (page_first), SGLang's Mamba pool and a
    sliding-window KV pool of 2 layers (layer_first), registered as the
    hybrid controller registers them."""
    pool, mamba, swa = host_pool("page_first"), mamba_pool(), host_pool("layer_first", layers=2)
    store = backend(holder, pool)
    made.append(store)
    for found, name in ((pool, KV), (mamba, MAMBA), (swa, SWA)):
        store.register_mem_host_pool_v2(found, name)
    return store, pool, mamba, swa


def fill_pages(pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """Random pages into any host pool; returns each page, flat, as stored."""
    for p in range(0, len(indices), pool.page_size):
        dummy = pool.get_dummy_flat_data_page()
        octets = dummy.dtype == torch.uint8
        data = (
            torch.randint(0, 256, dummy.shape, dtype=torch.uint8)
            if octets
            else torch.randn(dummy.shape).to(dummy.dtype)
        )
        pool.set_from_flat_data_page(int(indices[p]), data)
    return pages_of(pool, indices)


def pages_of(pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [
        pool.get_data_page(int(indices[p]), flat=True).clone()
        for p in range(0, len(indices), pool.page_size)
    ]


def test_v2_round_trips_kv_and_extra_pools_through_a_real_holder(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    torch.manual_seed(4)
    store, pool, mamba, swa = hybrid(holder, made)
    keys = get_storage_hash_str(list(range(300, 300 + PAGES * PAGE)), None, page_size=PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    pools = (pool, mamba, swa)
    src = (pool.alloc(PAGES * PAGE), mamba.alloc(PAGES), swa.alloc(PAGES * PAGE))
    written = [fill_pages(p, i) for p, i in zip(pools, src, strict=True)]

    def transfers(indices: tuple[torch.Tensor, ...], keys: list[str]) -> list[PoolTransfer]:
        return [
            PoolTransfer(name=KV, host_indices=indices[0], keys=keys),
            PoolTransfer(name=MAMBA, host_indices=indices[1], keys=keys, hit_policy=TRAILING),
            PoolTransfer(name=SWA, host_indices=indices[2], keys=keys),
        ]

    every = {KV: [True] * PAGES, MAMBA: [True] * PAGES, SWA: [True] * PAGES}
    assert store.batch_set_v2(transfers(src, keys), info) == every
    # Into other slots, pages in reverse order, of pools whose pages were
    # zeroed: every pool's pages in one batch, under one lease (one holder).
    for p, i in zip(pools, src, strict=True):
        for page in range(0, len(i), p.page_size):
            p.set_from_flat_data_page(int(i[page]), p.get_dummy_flat_data_page())
    sizes = (PAGES * PAGE, PAGES, PAGES * PAGE)
    dst = tuple(
        torch.flip(p.alloc(n).view(-1, p.page_size), [0]).reshape(-1)
        for p, n in zip(pools, sizes, strict=True)
    )
    assert store.store is not None
    leases = store.store.stats.leases
    assert store.batch_get_v2(transfers(dst, keys[::-1]), info) == every
    assert store.store.stats.leases == leases + 1
    for p, want, i in zip(pools, written, dst, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want[::-1], pages_of(p, i), strict=True))

    # The same keys, three pools, three blocks: a Mamba page is one layer of
    # SGLang's flat page octets (V empty); a SWA page is a KV page of the
    # pool's own 2 layers, in kvsp-layout-1 like the KV pool's.
    flat = held(holder, store, keys[0] + "@0/1#mamba:page_first")
    assert (len(flat), flat.token_count, len(flat.layer(0).v)) == (1, PAGE, 0)
    assert bytes(flat.layer(0).k) == written[1][0].numpy().tobytes()
    window = held(holder, store, keys[0] + "@0/1#swa")
    layer_first = written[2][0].view(2, 2, PAGE, HEADS, HEAD_DIM)
    assert len(window) == 2
    assert bytes(window.layer(1).v) == layer_first[1, 1].view(torch.uint8).numpy().tobytes()
    assert len(held(holder, store, keys[0] + "@0/1")) == LAYERS  # v1's KV block

    # What SGLang's own backends refuse, or what no holder has, is a miss.
    unknown = PoolTransfer(name=PoolName.INDEXER, host_indices=dst[0][:PAGE], keys=keys[:1])
    short = PoolTransfer(name=MAMBA, host_indices=dst[1][:1], keys=keys[:2])
    assert store.batch_get_v2([unknown, short]) == {
        PoolName.INDEXER: [False],
        MAMBA: [False, False],
    }
    assert store.batch_set_v2([unknown]) == {PoolName.INDEXER: [False]}
    some = PoolTransfer(name=MAMBA, host_indices=dst[1][:2], keys=[keys[0], "0" * 64])
    assert store.batch_get_v2([some]) == {MAMBA: [True, False]}


def test_v1_pages_and_v2_kv_pages_are_the_same_blocks(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    torch.manual_seed(5)
    pool = host_pool("page_first")
    store = backend(holder, pool)
    made.append(store)
    store.register_mem_host_pool_v2(pool, KV)
    keys = get_storage_hash_str(list(range(400, 400 + PAGES * PAGE)), None, page_size=PAGE)
    src = pool.alloc(PAGES * PAGE)
    written = fill_pages(pool, src)
    half = PAGES // 2
    assert store.batch_set_v1(keys[:half], src[: half * PAGE]) == [True] * half
    assert store.batch_set_v2(
        [PoolTransfer(name=KV, host_indices=src[half * PAGE :], keys=keys[half:])]
    ) == {KV: [True] * half}
    found = store.batch_exists_v2(keys, [])
    assert (found.kv_hit_pages, found.extra_pool_hit_pages, found.restorable_prefix_pages) == (
        PAGES,
        {KV: PAGES},
        list(range(1, PAGES + 1)),
    )
    assert store.batch_exists(keys) == PAGES
    dst = pool.alloc(PAGES * PAGE)
    assert store.batch_get_v2(
        [PoolTransfer(name=KV, host_indices=dst[: half * PAGE], keys=keys[:half])]
    ) == {KV: [True] * half}
    assert store.batch_get_v1(keys[half:], dst[half * PAGE :]) == [True] * (PAGES - half)
    assert all(torch.equal(a, b) for a, b in zip(written, pages_of(pool, dst), strict=True))


def test_v2_hit_policies_count_as_sglangs_file_backend(
    holder: Holder, made: list[KvstoreHiCacheStorage], tmp_path: Any
) -> None:
    # KV pages 0-3 held; Mamba states at pages 1 and 3 only (as SGLang backs
    # up a state at some nodes); the sliding window at pages 0-2. The same
    # pages go into SGLang's own HiCacheFile, whose counts are the reference.
    torch.manual_seed(6)
    store, pool, mamba, swa = hybrid(holder, made)
    files = {"file_storage_path": str(tmp_path / "file")}
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
        model_name="toy-model",
        extra_config=files,
    )
    reference = HiCacheFile(config)
    for found, name in ((pool, KV), (mamba, MAMBA), (swa, SWA)):
        reference.register_mem_host_pool_v2(found, name)
    keys = get_storage_hash_str(list(range(500, 500 + PAGES * PAGE)), None, page_size=PAGE)
    kv, states, window = pool.alloc(PAGES * PAGE), mamba.alloc(2), swa.alloc(3 * PAGE)
    for p, i in ((pool, kv), (mamba, states), (swa, window)):
        fill_pages(p, i)
    stored = [
        PoolTransfer(name=KV, host_indices=kv, keys=keys),
        PoolTransfer(name=MAMBA, host_indices=states, keys=[keys[1], keys[3]]),
        PoolTransfer(name=SWA, host_indices=window, keys=keys[:3]),
    ]
    for backend_ in (store, reference):
        assert all(all(x) for x in backend_.batch_set_v2(stored).values())

    def asking(name: PoolName, policy: PoolHitPolicy, trailing: int = 1) -> PoolTransfer:
        tail = keys[-trailing:] if policy == TRAILING else keys
        return PoolTransfer(name=name, keys=tail, hit_policy=policy)

    cases = [
        (keys, [], (4, {KV: 4}, [1, 2, 3, 4])),
        (keys, [asking(MAMBA, TRAILING)], (4, {KV: 4, MAMBA: 4}, [2, 4])),
        (keys, [asking(SWA, ALL)], (3, {KV: 4, SWA: 3}, [1, 2, 3])),
        (keys, [asking(MAMBA, TRAILING), asking(SWA, ALL)], (2, {KV: 4, MAMBA: 4, SWA: 3}, [2])),
        (keys, [asking(SWA, TRAILING, 2)], (3, {KV: 4, SWA: 3}, [1, 2, 3])),
        (keys, [asking(MAMBA, TRAILING, 2)], (0, {KV: 4}, [])),
        (keys, [asking(MAMBA, TRAILING, 2), asking(SWA, ALL)], (0, {KV: 4}, [])),
        (keys, [asking(MAMBA, ALL)], (0, {KV: 4}, [])),
        (keys, [asking(PoolName.INDEXER, ALL)], (0, {KV: 4}, [])),  # registered nowhere
        ([*keys[:2], "f" * 64, keys[3]], [asking(MAMBA, TRAILING)], (2, {KV: 2, MAMBA: 2}, [2])),
        (["f" * 64, *keys[1:]], [asking(MAMBA, TRAILING)], (0, {}, [])),
    ]
    for asked, transfers, want in cases:
        for backend_ in (store, reference):
            got = backend_.batch_exists_v2(asked, transfers, HiCacheStorageExtraInfo())
            assert (
                got.kv_hit_pages,
                got.extra_pool_hit_pages,
                got.restorable_prefix_pages,
            ) == want, (backend_, transfers)

    # BLOCK_GROUPS (no SGLang backend counts it in 0.5.23): the pool's own
    # verdict, whole groups from the start, never gating the KV hit.
    groups = PoolTransfer(
        name=SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=2
    )
    got = store.batch_exists_v2(keys, [groups])
    assert (got.kv_hit_pages, got.extra_pool_hit_pages) == (4, {KV: 4, SWA: 2})
    groups.group_pages = 0  # no geometry: no verdict
    assert store.batch_exists_v2(keys, [groups]).extra_pool_hit_pages == {KV: 4}


def test_v2_with_the_holder_down_misses(holder: Holder, made: list[KvstoreHiCacheStorage]) -> None:
    torch.manual_seed(7)
    store, pool, mamba, _ = hybrid(holder, made)
    keys = get_storage_hash_str(list(range(600, 600 + PAGES * PAGE)), None, page_size=PAGE)
    src = (pool.alloc(PAGES * PAGE), mamba.alloc(PAGES))
    fill_pages(pool, src[0])
    fill_pages(mamba, src[1])

    def transfers(indices: tuple[torch.Tensor, ...]) -> list[PoolTransfer]:
        return [
            PoolTransfer(name=KV, host_indices=indices[0], keys=keys),
            PoolTransfer(name=MAMBA, host_indices=indices[1], keys=keys, hit_policy=TRAILING),
        ]

    assert store.batch_set_v2(transfers(src)) == {KV: [True] * PAGES, MAMBA: [True] * PAGES}
    tail = [PoolTransfer(name=MAMBA, keys=keys[-1:], hit_policy=TRAILING)]
    assert store.batch_exists_v2(keys, tail).kv_hit_pages == PAGES
    holder.kill()
    found = store.batch_exists_v2(keys, tail)
    assert store.store is not None
    tried = store.store.stats.errors  # then skipped: misses that send nothing
    assert tried >= 1
    assert (found.kv_hit_pages, found.extra_pool_hit_pages, found.restorable_prefix_pages) == (
        0,
        {},
        [],
    )
    dst = (pool.alloc(PAGES * PAGE), mamba.alloc(PAGES))
    before = (pages_of(pool, dst[0]), pages_of(mamba, dst[1]))
    assert store.batch_get_v2(transfers(dst)) == {KV: [False] * PAGES, MAMBA: [False] * PAGES}
    after = (pages_of(pool, dst[0]), pages_of(mamba, dst[1]))
    assert all(
        torch.equal(a, b)
        for x, y in zip(before, after, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert store.batch_set_v2(transfers(src)) == {KV: [False] * PAGES, MAMBA: [False] * PAGES}
    assert store.store.stats.errors == tried


def test_sglangs_hybrid_controller_moves_a_mamba_state_through_v2(
    holder: Holder, made: list[KvstoreHiCacheStorage]
) -> None:
    # The hybrid controller's own backup, hit query and sidecar prefetch
    # (built without a scheduler, as above): a request's KV pages (v1) and
    # the Mamba state at its last page (batch_set_v2, TRAILING_PAGES) are
    # stored; the query finds the whole prefix restorable; the prefetch
    # reads the state back into another slot.
    from queue import Queue
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
        PrefetchOperation,
        StorageOperation,
    )

    torch.manual_seed(8)
    store, pool, mamba, _ = hybrid(holder, made)
    controller: Any = object.__new__(HybridCacheController)
    controller.storage_backend = store
    controller.page_size = PAGE
    controller.storage_config = store.storage_config  # a storage writer: backs up
    controller.page_set_func = controller._page_set_zero_copy
    controller.mem_pool_host = SimpleNamespace(entry_map={MAMBA: SimpleNamespace(host_pool=mamba)})
    controller.prefetch_sync_queue = Queue()
    tokens = list(range(700, 700 + PAGES * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    kv, state = pool.alloc(PAGES * PAGE), mamba.alloc(1)
    fill_pages(pool, kv)
    written = fill_pages(mamba, state)

    last = PoolTransfer(name=MAMBA, host_indices=state, keys=keys[-1:], hit_policy=TRAILING)
    backup = StorageOperation(kv, tokens, hash_value=keys, prefix_keys=[], pool_transfers=[last])
    controller._page_backup_with_stable_layout(backup)
    assert backup.completed_tokens == PAGES * PAGE
    assert backup.pool_storage_result.extra_pool_hit_pages == {MAMBA: 1}

    def prefetch(name: str) -> Any:
        return PrefetchOperation(
            SimpleNamespace(rid=name),
            tokens,
            pool_transfers=[PoolTransfer(name=MAMBA, keys=keys[-1:], hit_policy=TRAILING)],
        )

    query = prefetch("r1")
    assert controller._storage_hit_query(query) == (keys, PAGES * PAGE)
    assert query.query_pool_hit_pages == {KV: PAGES, MAMBA: PAGES}
    assert query.pool_storage_result.restorable_prefix_pages == [PAGES]

    load = prefetch("r2")
    load.hash_value = keys
    load.pool_transfers[0].host_indices = into = mamba.alloc(1)
    controller._page_transfer_sidecar(load, PAGES)
    assert controller.prefetch_sync_queue.get_nowait().pool_hits == {MAMBA: 1}
    assert torch.equal(pages_of(mamba, into)[0], written[0])
