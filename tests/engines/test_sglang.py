"""kvstore as SGLang's HiCache storage backend (issue 10): SGLang's own CPU
host pool (``MHATokenToKVPoolHost``, ``page_first``) round-trips pages
through the backend, created by SGLang's factory from the dynamic
configuration, into a real holder process over mTLS: zero-copy
(``batch_set_v1`` / ``batch_get_v1`` against the registered pool) and
copying (``set`` / ``batch_get`` with flat pages, as the controller does);
a pool of another layout reads the same pages; a holder that is down
makes pages miss."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore.bench import sglang_stubs

sglang_stubs.install()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvstore.integrations.sglang import KvstoreHiCacheStorage, canonical_page  # noqa: E402
from kvstore.protocol import container as kc  # noqa: E402

from .holder import Holder  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS, PAGES = 3, 2, 8, 4, 32, 4
DTYPE = torch.bfloat16


def host_pool(layout: str) -> Any:
    device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=DTYPE, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                              enable_memory_saver=False, enable_alt_stream=False)  # fmt: skip
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size,
                                start_layer=device.start_layer,
                                end_layer=device.end_layer)  # fmt: skip


def backend(holder: Holder, pool: Any, tp_rank: int = 0,
            pp: tuple[int, int] = (0, 1)) -> KvstoreHiCacheStorage:  # fmt: skip
    # What --hicache-storage-backend-extra-config carries (docs/integrations.md).
    extra = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
             "class_name": "KvstoreHiCacheStorage", "interface_v1": 1,
             **holder.options()}  # fmt: skip
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2 if tp_rank else 1,
                                  pp_rank=pp[0], pp_size=pp[1],
                                  attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                  enable_storage_metrics=False,
                                  is_page_first_layout=pool.layout == "page_first",
                                  model_name="toy-model", extra_config=extra)  # fmt: skip
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
    import asyncio

    from kvstore.client import HolderClient

    chunks = store.store

    async def first() -> bytes:
        async with HolderClient(holder.context()) as http:  # type: ignore[arg-type]
            return await http.get_block(holder.uri, chunks.compat_id, chunks.scope_id,
                                        chunks.block_key(keys[0] + "@0/1"))  # fmt: skip

    container = kc.decode(asyncio.run(first()))
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
    assert store.batch_set(keys[1:], [pool.get_data_page(int(src[i * PAGE]))
                                      for i in range(1, PAGES)])  # fmt: skip
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
            page = canonical_page(other_pool.get_data_page(int(dst[p]), flat=False), layout,
                                  other.geometry)  # fmt: skip
            assert torch.equal(page, want), layout
        flat = other.batch_get(keys[:1], [other_pool.get_dummy_flat_data_page()])[0]
        assert flat is not None
        other_pool.set_from_flat_data_page(int(dst[0]), flat)  # what SGLang does with it
        page = canonical_page(other_pool.get_data_page(int(dst[0]), flat=False), layout,
                              other.geometry)  # fmt: skip
        assert torch.equal(page, canonical[0]), layout
        mine = get_storage_hash_str([layout.__len__()] * PAGE, None, page_size=PAGE)
        assert other.batch_set_v1(mine, dst[:PAGE]) == [True]
        back = pool.alloc(PAGE)
        assert store.batch_get_v1(mine, back) == [True]
        assert torch.equal(canonical_page(pool.get_data_page(int(back[0]), flat=False),
                                          "page_first", store.geometry), page), layout  # fmt: skip
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
    started = time.monotonic()
    assert store.batch_exists(keys) == 0
    dst = pool.alloc(PAGES * PAGE)
    before = read(pool, dst)
    assert store.batch_get_v1(keys, dst) == [False] * PAGES
    assert all(torch.equal(a, b) for a, b in zip(before, read(pool, dst), strict=True))
    assert store.batch_set_v1(keys, src) == [False] * PAGES
    assert not store.set(keys[0], pool.get_data_page(int(src[0])))
    assert time.monotonic() - started < 10
    assert store.store is not None and store.store.stats.errors >= 1


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
    extra = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
             "class_name": "KvstoreHiCacheStorage", "interface_v1": interface_v1,
             **holder.options()}  # fmt: skip

    def storage_config(model_name: str, extra_config: dict[str, Any]) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                    attn_cp_size=1, is_mla_model=False,
                                    enable_storage_metrics=False, is_page_first_layout=True,
                                    model_name=model_name, extra_config=extra_config)  # fmt: skip

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
        controller.attach_storage_backend("dynamic", model_name="toy-model",
                                          storage_backend_extra_config=extra)  # fmt: skip
    backend_made = controller.storage_backend
    try:
        assert isinstance(backend_made, KvstoreHiCacheStorage)
        expected = ("_page_set_zero_copy", "_page_get_zero_copy") if interface_v1 else (
            "_generic_page_set", "_generic_page_get")  # fmt: skip
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
