"""kvstore as SGLang's HiCache storage backend (issue 10, SGLang 0.5.23).

Loaded by SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KvstoreHiCacheStorage",
        "interface_v1": 1, "kvstore.holders": "https://h1.example:8443/kvsp/", ...}'

(the ``kvstore.*`` options are those of :class:`~kvstore.integrations.chunks.ChunkSettings`).
With ``"interface_v1": 1`` SGLang calls the zero-copy ``batch_get_v1`` /
``batch_set_v1`` with indices into its host memory pool, registered here by
``register_mem_pool_host``; without it, the copying ``get``/``set`` family
with flat page tensors. Both are served.

Each page (``page_size`` tokens, every layer, K and V) is one KVSP block
container of codec raw, one container layer per model layer, K and V each
``page_size x heads x head_dim`` in ``kvsp-layout-1``: the same octets from
every host layout (``layer_first``, ``page_first``, ``page_first_direct``,
``page_head``), so servers with different layouts share pages. A page's
name is SGLang's page hash (a chain over the token prefix) with the tensor
parallel rank; the Block Key is a keyed hash of that name
(:mod:`kvstore.integrations.chunks`), shared by the SGLang servers of the
scope and descriptor, not with token-keyed KVSP clients.

Hybrid models' extra host pools (Mamba, SWA, indexers) move through
SGLang's v2 batch interface (``batch_exists_v2`` / ``batch_get_v2`` /
``batch_set_v2``, pools registered by ``register_mem_host_pool_v2``),
served by :mod:`kvstore.integrations.sglang_v2` over the same store; its
KV pages are v1's pages.

SGLang's storage threads are not async: calls go to an event loop in a
thread of this backend's own. A holder that is down makes pages miss
(``False``, ``None``, a shorter prefix); nothing raises into SGLang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransferResult,
)

from ..config import ConfigError
from ..logs import describe
from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.codecs import CODEC_RAW
from ..protocol.problems import KvspError
from ..protocol.tensors import kv_dtype_of, section_to_tensor, tensor_to_section
from . import sglang_v2
from .chunks import ChunkSettings, ChunkStore, Geometry, LoopThread, options_with_prefix
from .sglang_v2 import Batch, FlatPages, PageFormat

log = logging.getLogger(__name__)

#: A page's tensor in each host layout, before it is seen as [2, L, page, H, D].
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def canonical_page(page: torch.Tensor, layout: str, geometry: Geometry) -> torch.Tensor:
    """A page (flat, or the pool's own slice) as a ``[2, layers, page, heads,
    head_dim]`` view of the same memory."""
    layers, heads, dim, tokens = (
        geometry.layers,
        geometry.kv_heads,
        geometry.head_dim,
        geometry.block_tokens,
    )
    # view(), never reshape(): a copy would silently swallow what a get writes.
    if layout == "layer_first":
        return page.view(2, layers, tokens, heads, dim)
    if layout == "page_first":
        return page.view(2, tokens, layers, heads, dim).transpose(1, 2)
    if layout == "page_first_direct":
        return page.view(2, layers, tokens, heads, dim)
    if layout == "page_head":
        return page.view(2, heads, tokens, layers, dim).permute(0, 3, 2, 1, 4)
    raise ConfigError(f"kvstore: host memory layout {layout!r} not supported ({LAYOUTS})")


class KvPages:
    """A KV host pool's pages as containers (the module's format): the KV
    pool's, and a KV-shaped extra pool's (:mod:`.sglang_v2`)."""

    def __init__(self, pool: Any, tag: str = "") -> None:
        if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise ConfigError("kvstore: K and V of different head dims are not supported")
        try:
            kv_dtype = kv_dtype_of(pool.dtype)
        except ValueError as exc:
            raise ConfigError(f"kvstore: {exc}") from None
        if pool.layout not in LAYOUTS:
            raise ConfigError(f"kvstore: host layout {pool.layout!r} not supported ({LAYOUTS})")
        self.pool = pool
        self.geometry = Geometry(
            pool.layer_num, pool.head_num, pool.head_dim, kv_dtype, pool.page_size
        )
        self.layout: str = pool.layout
        self.dtype: torch.dtype = pool.dtype
        self.page_size: int = pool.page_size
        self.tag = tag

    def page(self, slot: int) -> torch.Tensor:
        """The pool's page starting at token slot ``slot``, as a canonical view."""
        return canonical_page(self.pool.get_data_page(slot, flat=False), self.layout, self.geometry)

    def encode(self, page: torch.Tensor) -> bytearray:
        """One page (as :func:`canonical_page` sees it) as a container."""
        sections = [
            (tensor_to_section(page[0, layer]), tensor_to_section(page[1, layer]))
            for layer in range(self.geometry.layers)
        ]
        return kc.encode(sections, token_count=self.geometry.block_tokens)

    def decode_into(self, body: BytesLike | None, page: torch.Tensor) -> bool:
        """Write a served container into ``page`` (a canonical view); False
        (and ``page`` untouched) for a miss or a container of another shape."""
        if body is None:
            return False
        try:
            container = kc.decode(body)
        except KvspError as exc:
            log.warning("kvstore: a holder served a page that does not decode: %s", exc.detail)
            return False
        g = self.geometry
        section = g.block_tokens * g.kv_heads * g.head_dim * self.dtype.itemsize
        if (
            container.codec != CODEC_RAW
            or container.first_layer != 0
            or len(container) != g.layers
            or container.token_count != g.block_tokens
            or any(len(x.k) != section or len(x.v) != section for x in container)
        ):
            log.warning("kvstore: a holder served a page of another geometry; ignored")
            return False
        for layer, sections in enumerate(container):
            page[0, layer].copy_(section_to_tensor(sections.k, g.kv_dtype, g.kv_heads, g.head_dim))
            page[1, layer].copy_(section_to_tensor(sections.v, g.kv_dtype, g.kv_heads, g.head_dim))
        return True

    def container_at(self, slot: int) -> bytearray:
        return self.encode(self.page(slot))

    def write_at(self, slot: int, body: BytesLike) -> bool:
        return self.decode_into(body, self.page(slot))


class _Transfer:
    """A get in progress: pages are written only while it is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = True

    def close(self) -> None:
        with self.lock:  # waits for a page being written, then no more
            self.open = False


class KvstoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over a :class:`ChunkStore`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        if sys.byteorder != "little":
            raise ConfigError("kvstore: kvsp-layout-1 is little-endian; this host is not")
        if storage_config.is_mla_model:
            raise ConfigError("kvstore: MLA models are not supported by this backend")
        self.storage_config = storage_config
        self.options = options_with_prefix(storage_config.extra_config)
        # Tensor parallel ranks hold different heads of the same page, pipeline
        # stages different layers (two even stages have the same geometry, so
        # the same descriptor), context parallel ranks different tokens.
        c = storage_config
        self.suffix = f"@{c.tp_rank}/{c.tp_size}"
        ranks = (
            ("pp", c.pp_rank, c.pp_size),
            ("cp", c.attn_cp_rank, c.attn_cp_size),
            ("dcp", getattr(c, "dcp_rank", 0), getattr(c, "dcp_size", 1)),
        )
        for label, rank, size in ranks:
            if size and size > 1:
                self.suffix += f".{label}{rank}/{size}"
        self.store: ChunkStore | None = None
        self.loop: LoopThread | None = None
        self.mem_pool_host: Any = None
        #: Each host pool's page format, by SGLang's pool name (v2).
        self.formats: dict[str, PageFormat] = {}

    # --- set-up -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool after construction: the geometry
        (and so the descriptor) is known only now."""
        self.mem_pool_host = mem_pool_host
        self.kv = KvPages(mem_pool_host)
        self.formats[str(PoolName.KV)] = self.kv
        self.geometry, self.layout, self.dtype = self.kv.geometry, self.kv.layout, self.kv.dtype
        self.store = ChunkStore(
            ChunkSettings.from_options(self.options, namespace="sglang", geometry=self.geometry)
        )
        self.loop = LoopThread("kvstore-hicache")
        # Transfers are bounded by the store's own timeouts; this is the backstop.
        self.wait_s = 4 * self.store.settings.timeout_s
        log.info(
            "kvstore HiCache backend: holders %s, scope %s, compat %s, layout %s",
            ",".join(self.store.settings.holders),
            self.store.scope_id,
            self.store.compat_id,
            self.layout,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Each host pool of a hybrid model, the KV pool among them (after
        :meth:`register_mem_pool_host`; extra pools may come later). A pool
        whose pages cannot be stored is logged, and its pages miss."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return  # the KV pool is register_mem_pool_host's: its pages are v1's
        try:
            self.formats[name] = self._format_of(host_pool, name)
        except Exception as exc:
            log.error(
                "kvstore: SGLang's %s pool cannot be stored (%s); its pages miss",
                name,
                describe(exc),
            )

    def _format_of(self, pool: Any, name: str) -> PageFormat:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        if isinstance(pool, MHATokenToKVPoolHost):
            try:
                return KvPages(pool, tag=f"#{name}")
            except ConfigError as exc:
                log.info("kvstore: %s pool stored as flat pages: %s", name, exc)
        return FlatPages(pool, name, self.geometry.block_tokens)

    def _ready(self) -> tuple[ChunkStore, LoopThread]:
        if self.store is None or self.loop is None:
            raise RuntimeError("kvstore: register_mem_pool_host was not called")
        return self.store, self.loop

    def _run(self, coroutine: Any, miss: Any, transfer: _Transfer | None = None) -> Any:
        """Run a coroutine on the backend's loop for SGLang's thread; ``miss``
        if it fails or runs late. A late get is closed first: nothing is
        written into pages SGLang takes back once it was told "miss"."""
        _, loop = self._ready()
        try:
            return loop.run(coroutine, self.wait_s)
        except (
            concurrent.futures.TimeoutError,
            concurrent.futures.CancelledError,
            KvspError,
        ) as exc:
            if transfer is not None:
                transfer.close()
            log.warning("kvstore: a transfer did not complete (%s): a miss", describe(exc))
            return miss

    def _store(
        self, names: Sequence[str], containers: Sequence[Callable[[], BytesLike]]
    ) -> list[bool]:
        """Each page's container is built (one copy, from SGLang's memory)
        only when a request slot is free to send it."""
        store, _ = self._ready()

        async def put_all() -> list[bool]:
            pairs = zip(names, containers, strict=True)
            return list(await asyncio.gather(*(store.put(n, c) for n, c in pairs)))

        return list(self._run(put_all(), [False] * len(names)))

    def _fetch(self, names: Sequence[str], write: Callable[[int, BytesLike], bool]) -> list[bool]:
        """Each page written by ``write(i, container)`` as it arrives, all
        under one lease per holder (LE1)."""
        store, _ = self._ready()
        transfer = _Transfer()

        def written(i: int, body: BytesLike) -> bool | None:
            with transfer.lock:
                if not transfer.open:
                    return None
                return True if write(i, body) else None

        found = self._run(store.fetch_many(names, written), [None] * len(names), transfer)
        return [x is not None for x in found]

    # --- zero-copy interface (interface_v1) --------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        size = self.geometry.block_tokens

        def container(i: int) -> Callable[[], bytearray]:
            return lambda: self.kv.container_at(int(host_indices[i * size]))

        return self._store(
            [k + self.suffix for k in keys], [container(i) for i in range(len(keys))]
        )

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        size = self.geometry.block_tokens

        def write(i: int, body: BytesLike) -> bool:
            return self.kv.write_at(int(host_indices[i * size]), body)

        return self._fetch([k + self.suffix for k in keys], write)

    # --- copying interface -------------------------------------------------------

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        def container(value: torch.Tensor) -> Callable[[], bytearray]:
            return lambda: self.kv.encode(canonical_page(value, self.layout, self.geometry))

        return all(self._store([k + self.suffix for k in keys], [container(v) for v in values]))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        given = list(target_locations) if target_locations else [None] * len(keys)
        targets: list[torch.Tensor] = [
            t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in given
        ]

        def write(i: int, body: BytesLike) -> bool:
            return self.kv.decode_into(body, canonical_page(targets[i], self.layout, self.geometry))

        found = self._fetch([k + self.suffix for k in keys], write)
        return [targets[i] if ok else None for i, ok in enumerate(found)]

    def exists(self, key: str) -> bool:
        store, _ = self._ready()
        return bool(self._run(store.contains(key + self.suffix), False))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        store, _ = self._ready()
        names = [k + self.suffix for k in keys]
        return int(self._run(store.contains_prefix(names), 0))

    # --- v2 batch interface (hybrid models' pools; .sglang_v2) -------------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The usable prefix of ``keys``, the KV pages and each pool's pages
        by its hit policy (:mod:`.sglang_v2`)."""
        store, _ = self._ready()
        transfers = list(pool_transfers or ())
        found = sglang_v2.exists(store, keys, transfers, self.formats, self.suffix)
        return self._run(found, PoolTransferResult(0, {}, []))

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages from the holders into its host pool, all
        pools in one batch; per pool, which pages were written."""
        batch = Batch.of(transfers, self.formats, self.suffix)

        def write(i: int, body: BytesLike) -> bool:
            fmt, slot = batch.pages[i]
            return fmt.write_at(slot, body)

        return batch.results(self._fetch(batch.names, write) if batch.names else [])

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages from its host pool to the holders; per
        pool, which pages are held."""
        batch = Batch.of(transfers, self.formats, self.suffix)

        def container(fmt: PageFormat, slot: int) -> Callable[[], bytearray]:
            return lambda: fmt.container_at(slot)

        containers = [container(fmt, slot) for fmt, slot in batch.pages]
        return batch.results(self._store(batch.names, containers) if batch.names else [])

    def clear(self) -> None:
        # A holder is shared: clients do not delete blocks (KVSP has no such
        # request); they leave by eviction or the retention limit.
        log.info("kvstore: clear() leaves the holders' pages in place")

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        if self.store is not None and self.loop is not None:
            self._run(self.store.close(), None)
            self.loop.stop()


__all__: Sequence[str] = ("KvPages", "KvstoreHiCacheStorage", "canonical_page")
