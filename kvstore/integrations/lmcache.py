"""kvstore as an LMCache remote storage plug-in (issue 10, LMCache 0.5.6).

In LMCache's configuration (YAML, or ``LMCACHE_*`` variables)::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.integrations.lmcache
      remote_storage_plugin.kvstore.class_name: KvstoreConnectorAdapter
      kvstore.holders: https://h1.example:8443/kvsp/
      kvstore.scope_key_file: /etc/kvstore/scope.key
      kvstore.cafile: /etc/kvstore/ca.pem
      kvstore.certfile: /etc/kvstore/client.pem
      kvstore.keyfile: /etc/kvstore/client.key
      kvstore.model: meta-llama/Llama-3.1-8B-Instruct
      kvstore.model_digest: sha-256:...
      kvstore.tokenizer_digest: sha-256:...

Each LMCache chunk (a ``MemoryObj`` of format ``KV_2LTD``: K and V of every
layer, ``[2, layers, tokens, heads x head_dim]``) is stored as a KVSP block
container of codec raw, one container layer per model layer. Per layer,
LMCache's K and V rows are exactly ``kvsp-layout-1`` (tokens slowest,
elements little-endian): a put copies LMCache's buffer once into the
container, a get copies the container once into a buffer LMCache allocates. The
block's name is a keyed hash of LMCache's key string (see
:mod:`kvstore.integrations.chunks`): such blocks are shared by the LMCache
users of the scope, not with token-keyed KVSP clients.

Where LMCache asks, the plug-in batches: lookups are HEADs a window at a
time, batched gets take one lease per holder for the whole batch (LE1) and
fetch in parallel, batched puts go in parallel, all within the chunk
store's request limit. A holder that is down makes LMCache miss (``get``
answers None, lookups count it absent); it never raises into LMCache. A
configuration it cannot serve stops LMCache (``IrrecoverableException``).
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from ..config import ConfigError
from ..logs import describe
from ..protocol._bytes import BytesLike
from ..protocol.problems import KvspError
from ..protocol.tensors import kv_dtype_of
from .chunks import ChunkSettings, ChunkStore, Geometry, options_with_prefix
from .kv2ltd import chunk_container, chunk_of, copy_chunk

log = logging.getLogger(__name__)

PLUGIN_TYPE = "kvstore"


def geometry_of(metadata: Any) -> Geometry:
    """The descriptor's geometry from LMCache's metadata (one KV group, MHA/GQA)."""
    if metadata.use_mla:
        raise ConfigError("kvstore: MLA caches (KV_MLA_FMT) are not supported by this plug-in")
    if metadata.get_num_groups() != 1:
        raise ConfigError("kvstore: models with several KV layer groups are not supported")
    layers, kv, _, heads, head_dim = metadata.kv_shape
    try:
        kv_dtype = kv_dtype_of(metadata.kv_dtype)
    except ValueError as exc:
        raise ConfigError(f"kvstore: {exc}") from None
    if kv != 2:
        raise ConfigError(f"kvstore: KV of shape {metadata.kv_shape} not supported")
    return Geometry(layers, heads, head_dim, kv_dtype, metadata.chunk_size)


class KvstoreConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache's ``RemoteConnector`` over a :class:`ChunkStore`.

    LMCache runs the async methods on its storage manager's event loop
    (``context.loop``) and calls ``exists_sync`` and ``batched_contains``
    from its own threads; those are sent to that loop."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context.config, context.metadata)
        if sys.byteorder != "little":
            raise ConfigError("kvstore: kvsp-layout-1 is little-endian; LMCache's buffers are not")
        config = context.config
        if config.use_layerwise:
            raise ConfigError("kvstore: use_layerwise (KV_T2D chunks) is not supported")
        if (config.remote_serde or "naive") != "naive":
            raise ConfigError(
                f"kvstore: remote_serde {config.remote_serde!r}: only 'naive' "
                "(kvstore stores raw KV)"
            )
        self.loop = context.loop
        self.local_cpu_backend = context.local_cpu_backend
        self.geometry = geometry_of(context.metadata)
        options = options_with_prefix(context.config.extra_config)
        self.store = ChunkStore(
            ChunkSettings.from_options(options, namespace="lmcache", geometry=self.geometry)
        )
        self.timeout_s = float(context.config.blocking_timeout_secs)
        self._probe_name: str | None = None
        self.dtype = self.meta_dtypes[0]
        self.row_octets = self.geometry.kv_heads * self.geometry.head_dim * self.dtype.itemsize
        log.info(
            "kvstore LMCache plug-in: holders %s, scope %s, compat %s",
            ",".join(self.store.settings.holders),
            self.store.scope_id,
            self.store.compat_id,
        )

    # --- chunks <-> containers ------------------------------------------------

    def encode(self, memory_obj: MemoryObj) -> bytearray:
        """A chunk's container: per layer, LMCache's K rows, then its V rows."""
        if memory_obj.get_memory_format() != MemoryFormat.KV_2LTD:
            raise ValueError(f"kvstore: chunk format {memory_obj.get_memory_format()} not KV_2LTD")
        two, layers, tokens, hidden = memory_obj.get_shapes()[0]
        if (two, layers, hidden * self.dtype.itemsize) != (
            2,
            self.geometry.layers,
            self.row_octets,
        ):
            raise ValueError(f"kvstore: chunk of shape {memory_obj.get_shapes()[0]} unexpected")
        buf = memoryview(memory_obj.byte_array).cast("B")
        return chunk_container(buf, layers, tokens, self.row_octets)

    def decode(self, body: BytesLike) -> MemoryObj | None:
        """The container of a chunk back into a buffer LMCache allocates;
        None for one that is not a chunk of this geometry."""
        layers = self.geometry.layers
        container = chunk_of(body, layers, self.row_octets, self.geometry.block_tokens)
        if container is None:
            return None
        shape = torch.Size(
            [2, layers, container.token_count, self.row_octets // self.dtype.itemsize]
        )
        # Not LMCache's busy wait: it would sleep on the very loop whose puts
        # free the memory; a chunk that does not fit now is a miss.
        memory_obj = self.local_cpu_backend.allocate(
            shape, self.dtype, MemoryFormat.KV_2LTD, busy_loop=False
        )
        if memory_obj is None:
            log.warning("kvstore: LMCache could not allocate a chunk buffer")
            return None
        try:
            copy_chunk(
                container, memoryview(memory_obj.byte_array).cast("B"), layers, self.row_octets
            )
        except BaseException:
            memory_obj.ref_count_down()  # given back, not left to the collector
            raise
        return memory_obj

    def name(self, key: CacheEngineKey) -> str:
        """The chunk's name: LMCache's key string. LMCache's health check
        (``RemoteBackendHealthCheck``) puts a buffer of arbitrary contents
        under one fixed key (model ``test``, chunk hash 0) and expects it back:
        each such put gets a name of its own, since a holder keeps the first
        copy of a name (BL7) and every later probe would read stale octets."""
        text = str(key.to_string())
        if key.model_name == "test" and key.chunk_hash == 0:
            return self._probe_name or text
        return text

    def _probe_put_name(self, key: CacheEngineKey) -> str:
        if key.model_name == "test" and key.chunk_hash == 0:
            self._probe_name = f"{key.to_string()}#{uuid.uuid4()}"
        return self.name(key)

    # --- LMCache's interface ----------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.store.contains(self.name(key))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return bool(self._sync(lambda: self.store.contains(self.name(key)), False))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        names = [self.name(k) for k in keys]
        return int(self._sync(lambda: self.store.contains_prefix(names), 0))

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self.store.contains_prefix([self.name(k) for k in keys])

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        # Each chunk decoded into LMCache's buffer as it arrives (the batch's
        # octets are never all held at once); one answer per key, as LMCache
        # requires; what was allocated goes back if LMCache cancels the call.
        return await self.store.fetch_many(
            [self.name(k) for k in keys],
            lambda _, body: self.decode(body),
            release=lambda obj: obj.ref_count_down(),
        )

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        found = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for index, obj in enumerate(found):
            if obj is None:
                for rest in found[index + 1 :]:  # given back: LMCache takes the prefix only
                    if rest is not None:
                        rest.ref_count_down()
                break
            prefix.append(obj)
        return prefix

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        # LMCache keeps its buffers until this returns; each container is
        # built (one copy) only when a request slot is free to send it.
        import asyncio

        def builder(obj: MemoryObj) -> Any:
            return lambda: self.encode(obj)

        pairs = zip([self._probe_put_name(k) for k in keys], memory_objs, strict=True)
        done = await asyncio.gather(*(self.store.put(n, builder(m)) for n, m in pairs))
        if not all(done):
            log.info(
                "kvstore: %d of %d chunks not stored (no holder took them)",
                done.count(False),
                len(done),
            )

    def remove_sync(self, key: CacheEngineKey) -> bool:
        # KVSP has no client delete: chunks leave a holder by its eviction
        # or retention limit.
        return False

    async def list(self) -> list[str]:
        # KVSP has no listing of a holder's blocks (the IS indexes them);
        # LMCache uses this for reporting only.
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when at least one holder is reachable (LMCache's health monitor)."""
        return 0 if await self.store.reachable() else 1

    async def close(self) -> None:
        await self.store.close()

    def _sync(self, make: Any, miss: Any) -> Any:
        """Run ``make()`` (a coroutine) on LMCache's loop for a caller on
        another thread; ``miss`` if it fails, is cancelled or runs late."""
        import asyncio
        import concurrent.futures

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            # Waiting here would block the loop the answer needs: not done.
            log.warning("kvstore: a synchronous lookup on LMCache's own loop: a miss")
            return miss
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        try:
            return future.result(self.timeout_s)
        except (
            concurrent.futures.TimeoutError,
            concurrent.futures.CancelledError,
            KvspError,
        ) as exc:
            future.cancel()
            log.warning("kvstore: a lookup did not complete (%s): a miss", describe(exc))
            return miss


class CPUKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """An LMCache "GPU" connector over a plain CPU KV tensor ``[2, layers,
    slots, heads x head_dim]`` (kwargs ``kvcaches`` and ``slot_mapping``,
    token i at slot ``slot_mapping[i]``), for machines without an
    accelerator: tests and ``kvstore bench engines``. LMCache's own mock
    connector copies nothing."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers, self.hidden = layers, hidden

    @staticmethod
    def _slots(start: int, end: int, kwargs: dict[str, Any]) -> torch.Tensor:
        return torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)[start:end]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, self._slots(start, end, kwargs), :])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, self._slots(start, end, kwargs), :] = memory_obj.tensor

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])


class KvstoreConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """What LMCache instantiates (with no arguments) for ``plugin://kvstore``."""

    def __init__(self) -> None:
        super().__init__(f"{PLUGIN_TYPE}://")

    def can_parse(self, url: str) -> bool:
        if url.startswith("plugin://"):
            return bool(extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE)
        return url.startswith(self.schema)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        from lmcache.v1.exceptions import IrrecoverableException

        try:
            return KvstoreConnector(context)
        except ConfigError as exc:
            # LMCache would log any other error and run on without its remote
            # tier; a configuration to fix stops it instead.
            raise IrrecoverableException(str(exc)) from exc


__all__: Sequence[str] = (
    "CPUKVConnector",
    "KvstoreConnector",
    "KvstoreConnectorAdapter",
    "geometry_of",
)
