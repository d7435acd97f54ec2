"""kvstore as an L2 adapter of LMCache's multi-process mode (issue 21, LMCache 0.5.6).

LMCache's MP server loads it as a plug-in L2 adapter::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvstore.integrations.lmcache_mp",
        "class_name": "KvstoreL2Adapter",
        "adapter_params": {"holders": "https://h1.example:8443/kvsp/",
            "scope_key_file": "/etc/kvstore/scope.key", "cafile": "/etc/kvstore/ca.pem",
            "certfile": "/etc/kvstore/client.pem", "keyfile": "/etc/kvstore/client.key",
            "model": "meta-llama/Llama-3.1-8B-Instruct", "model_digest": "sha-256:...",
            "tokenizer_digest": "sha-256:...", "layers": 32, "kv_heads": 8,
            "head_dim": 128, "kv_dtype": "bf16", "chunk_size": 256}}'

(the options are the in-process plug-in's, unprefixed, plus the geometry,
which the MP server does not tell its adapters; docs/integrations.md).

LMCache's adapter operations are KVSP's, one for one:

=====================  ==========================================================
LMCache (L2 adapter)   KVSP at the chunk's holder (rendezvous over the holder set)
=====================  ==========================================================
store                  ``PUT blocks/...`` (BL7: a chunk held already is stored)
lookup and lock        ``POST leases``, one per holder and batch (LE1): the grant
                       lists the chunks held, and keeps them from eviction (LE2)
unlock                 ``DELETE leases/{id}`` once no key of the lease is locked
load                   ``GET blocks/...`` at the lease's holder, digests checked
                       (BL6), written into LMCache's buffer
delete                 nothing at the holder (KVSP has no client delete; a holder
                       evicts by its own policy): the byte accounting forgets it
=====================  ==========================================================

A lease lasts ``lease_ms``; the adapter renews the leases of locked keys
at half their TTL, for at most ``max_lock_s`` (a lock LMCache never
releases does not pin a chunk for ever).

Chunks are named as the in-process plug-in names them (LMCache's key string,
``model@world_size@worker_id@chunk_hash@dtype``, keyed by the scope key: the
same name is the same block), and stored in the same container
(:mod:`kvstore.integrations.kv2ltd`), so both modes read what either stored
under the same options. A non-empty ``cache_salt`` goes into the name
(``@cache_salt%<salt>``), so tenants never share chunks, and a salt listed in
``salt_scopes`` stores under a scope of its own, which the holders' policy
and quotas keep apart (K2, SEC1).

Failures are misses (the lookup's and load's bitmaps say 0) or failed store
tasks, never exceptions into LMCache's controllers (STYLE 8, in
:class:`~kvstore.integrations.chunks.ChunkStore`). Every task completes and
signals its event descriptor, whatever happens to the holders.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import create_event_notifier

from ..config import ConfigError
from ..logs import describe
from ..protocol._bytes import BytesLike
from ..protocol.tensors import torch_dtype
from .chunks import ChunkSettings, ChunkStore, Geometry, LoopThread, Pin
from .kv2ltd import chunk_container, chunk_of, copy_chunk
from .options import (
    CHUNK_OPTIONS,
    GEOMETRY_OPTIONS,
    check_known,
    flag,
    number,
    read_scope_key,
)

#: The adapter's own adapter_params, beside the holders' and the geometry's.
MP_OPTIONS = frozenset({"salt_scopes", "salt_scopes_only", "max_lock_s", "max_capacity_gb"})

log = logging.getLogger(__name__)


def chunk_name(key: ObjectKey, dtype_name: str) -> str:
    """A chunk's name: the string LMCache's in-process ``CacheEngineKey``
    makes of the same key (its ``to_string``), the salt and an object group
    other than the first added as LMCache adds tags."""
    world_size, worker = (key.kv_rank >> 24) & 0xFF, (key.kv_rank >> 16) & 0xFF
    name = f"{key.model_name}@{world_size}@{worker}@{key.chunk_hash.hex()}@{dtype_name}"
    if key.object_group_id:
        name += f"@object_group%{key.object_group_id}"
    if key.cache_salt:
        name += f"@cache_salt%{key.cache_salt}"
    return name


class KvstoreL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """``adapter_params`` of :class:`KvstoreL2Adapter` (found by LMCache's
    plug-in loader by its name); see :meth:`help`."""

    def __init__(
        self,
        settings: ChunkSettings,
        *,
        salt_scopes: Mapping[str, bytes] | None = None,
        salt_scopes_only: bool = False,
        max_lock_s: float = 300.0,
        max_capacity_bytes: int = 0,
    ) -> None:
        self.settings = settings
        self.salt_scopes = dict(salt_scopes or {})
        self.salt_scopes_only = salt_scopes_only
        self.max_lock_s = max_lock_s
        self.max_capacity_bytes = max_capacity_bytes

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvstoreL2AdapterConfig:
        options = {k: v for k, v in d.items() if k != "type"}
        check_known(options, CHUNK_OPTIONS | GEOMETRY_OPTIONS | MP_OPTIONS)
        geometry = Geometry.from_options(options)
        settings = ChunkSettings.from_options(
            options, namespace="lmcache", geometry=geometry, extra=GEOMETRY_OPTIONS | MP_OPTIONS
        )
        scopes = options.get("salt_scopes") or {}
        if not isinstance(scopes, dict):
            raise ConfigError("kvstore.salt_scopes: a map of cache_salt to scope key file")
        salt_scopes = {
            str(salt): read_scope_key(str(file), "salt_scopes") for salt, file in scopes.items()
        }
        capacity_gb = number(options, "max_capacity_gb", 0, zero=True)
        return cls(
            settings,
            salt_scopes=salt_scopes,
            salt_scopes_only=flag(options, "salt_scopes_only", False),
            max_lock_s=number(options, "max_lock_s", 300.0),
            max_capacity_bytes=int(capacity_gb * 2**30),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "kvstore L2 adapter (KVSP holders; docs/integrations.md). adapter_params:\n"
            "- holders: holder base URIs (list or comma-separated; required)\n"
            "- scope_key_file: scope key, hex (required)\n"
            "- cafile, certfile, keyfile: TLS and client certificate (https holders)\n"
            "- model, model_digest, tokenizer_digest [, positional, adapters] and the\n"
            "  geometry layers, kv_heads (one rank's), head_dim, kv_dtype, chunk_size;\n"
            "  or descriptor_file (a Compatibility Descriptor, JSON)\n"
            "- salt_scopes: {cache_salt: scope key file}; salt_scopes_only (false)\n"
            "- timeout_s (5), lease_ms (10000), down_backoff_s (5), max_lock_s (300),\n"
            "  max_capacity_gb (0: no aggregate eviction by LMCache)"
        )


@dataclass(eq=False)
class _Lease:
    """A lease of one lookup at one holder, and how many locks hold it."""

    store: ChunkStore
    pin: Pin
    keys: list[ObjectKey]
    since: float
    renew_at: float
    #: When the holder lets it go unless renewed (monotonic seconds).
    expires_at: float
    refs: int = 0
    gone: bool = False


@dataclass
class _Tasks:
    """Completed results of one kind of task, and the descriptor that says so."""

    notifier: Any = field(default_factory=create_event_notifier)
    done: dict[L2TaskId, Any] = field(default_factory=dict)


class KvstoreL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache's ``L2AdapterInterface`` over kvstore holders (see the module).

    Thread-safe as the interface requires: the store and prefetch
    controllers submit from their threads; the work runs on one event loop
    in a thread of the adapter's own; shared maps are guarded by one lock,
    held briefly and never across I/O."""

    def __init__(
        self,
        config: KvstoreL2AdapterConfig | Mapping[str, Any],
        l1_memory_desc: Any = None,
    ) -> None:
        if not isinstance(config, KvstoreL2AdapterConfig):
            config = KvstoreL2AdapterConfig.from_dict(dict(config))
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self.config = config
        settings = config.settings
        self.geometry = geometry = Geometry.of(settings.descriptor)
        self.dtype = torch_dtype(geometry.kv_dtype)
        self.row_octets = geometry.kv_heads * geometry.head_dim * self.dtype.itemsize
        self._dtype_name = str(TORCH_DTYPE_TO_STR_DTYPE[self.dtype])  # as LMCache names it
        self.store = ChunkStore(settings)
        self._salted = {
            salt: ChunkStore(replace(settings, scope_key=key))
            for salt, key in config.salt_scopes.items()
        }
        self._loop = LoopThread("kvstore-l2-adapter")
        self._stores = _Tasks()
        self._lookups = _Tasks()
        self._loads = _Tasks()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        #: Per locked key, its leases (a key locked twice holds two).
        self._locks: dict[ObjectKey, list[_Lease | None]] = {}
        self._leases: set[_Lease] = set()
        #: Octets of each key this adapter stored (the base class's accounting).
        self._sizes: dict[ObjectKey, int] = {}
        self._warned: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._renewer = asyncio.run_coroutine_threadsafe(self._renew_forever(), self._loop.loop)
        log.info(
            "kvstore L2 adapter: holders %s, scope %s, compat %s",
            ",".join(settings.holders),
            self.store.scope_id,
            self.store.compat_id,
        )

    # --- event descriptors ------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._stores.notifier.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookups.notifier.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._loads.notifier.fileno())

    # --- tasks ------------------------------------------------------------------

    def _submit(
        self, tasks: _Tasks, work: Callable[[], Coroutine[Any, Any, Any]], failed: Any
    ) -> L2TaskId:
        """Run ``work()`` on the adapter's loop; its result (``failed`` if it
        raises) is posted under a new task id and the descriptor signalled."""
        with self._lock:
            task_id = next(self._ids)
            if self._closed:  # too late: a failed task, never an exception
                tasks.done[task_id] = failed()
                return task_id

        async def run() -> None:
            try:
                result = await work()
            except Exception:
                log.exception("kvstore L2 adapter: a task failed")
                result = failed()
            with self._lock:
                tasks.done[task_id] = result
            tasks.notifier.notify()

        self._soon(run())
        return task_id

    def _soon(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Start ``coroutine`` on the adapter's loop (from any thread); close
        waits for it."""

        def start() -> None:
            task = asyncio.ensure_future(coroutine)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        self._loop.loop.call_soon_threadsafe(start)

    def _pop(self, tasks: _Tasks, task_id: L2TaskId) -> Any:
        with self._lock:
            return tasks.done.pop(task_id, None)

    def _store_for(self, key: ObjectKey) -> ChunkStore | None:
        if key.cache_salt in self._salted:
            return self._salted[key.cache_salt]
        if key.cache_salt and self.config.salt_scopes_only:
            self._warn(
                f"salt:{key.cache_salt}",
                "kvstore: cache_salt %r has no scope in "
                "salt_scopes (salt_scopes_only): not stored, not found",
                key.cache_salt,
            )
            return None
        return self.store

    def _by_store(self, keys: list[ObjectKey]) -> dict[ChunkStore, list[int]]:
        groups: dict[ChunkStore, list[int]] = {}
        for i, key in enumerate(keys):
            store = self._store_for(key)
            if store is not None:
                groups.setdefault(store, []).append(i)
        return groups

    def _warn(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:  # once per kind: a configuration to fix
            self._warned.add(what)
            log.warning(message, *args)

    # --- store ----------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(
            self._stores, lambda: self._store(keys, objects), lambda: L2StoreResult(False, 0)
        )

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores.done = self._stores.done, {}
        return done

    async def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        async def one(key: ObjectKey, obj: MemoryObj) -> bool:
            store = self._store_for(key)
            build = self._encoder(obj)
            if store is None or build is None:
                return False
            return await store.put(chunk_name(key, self._dtype_name), build)

        stored = await asyncio.gather(*(one(k, o) for k, o in zip(keys, objects, strict=True)))
        new_keys, sizes = [], []
        with self._lock:
            for key, obj, ok in zip(keys, objects, stored, strict=True):
                if ok and key not in self._sizes:
                    self._sizes[key] = obj.get_size()
                    new_keys.append(key)
                    sizes.append(self._sizes[key])
        if new_keys:
            self._notify_keys_stored(new_keys, sizes)
        return L2StoreResult(all(stored), sum(sizes))

    def _tokens(self, obj: MemoryObj) -> int | None:
        """The token count of an object of this geometry (one ``[2, layers,
        tokens, hidden]`` tensor of the descriptor's dtype), else None."""
        shapes, dtypes = obj.get_shapes(), obj.get_dtypes()
        g = self.geometry
        if len(shapes) == 1 and dtypes == [self.dtype] and len(shapes[0]) == 4:
            two, layers, tokens, hidden = shapes[0]
            rows = (two, layers, hidden * self.dtype.itemsize) == (2, g.layers, self.row_octets)
            if rows and 0 < tokens <= g.block_tokens:
                return int(tokens)
        self._warn(
            f"shape:{shapes}",
            "kvstore: an LMCache object of shapes %s, dtypes %s is "
            "not a chunk of the configured geometry %s: not stored, not loaded",
            shapes,
            dtypes,
            g,
        )
        return None

    def _encoder(self, obj: MemoryObj) -> Callable[[], bytearray] | None:
        tokens = self._tokens(obj)
        if tokens is None:
            return None
        # Built once a request slot is free (LMCache keeps the buffer until
        # the task completes): one copy, into the container.
        return lambda: chunk_container(
            memoryview(obj.byte_array).cast("B"), self.geometry.layers, tokens, self.row_octets
        )

    # --- lookup and lock, unlock ----------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(self._lookups, lambda: self._lookup(keys), lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._lookups, task_id)

    async def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        found = Bitmap(len(keys))
        groups = list(self._by_store(keys).items())
        pins = await asyncio.gather(
            *(
                store.pin_many([chunk_name(keys[i], self._dtype_name) for i in idx])
                for store, idx in groups
            )
        )
        now = time.monotonic()
        with self._lock:
            made: dict[tuple[str, str], _Lease] = {}
            for (store, idx), got in zip(groups, pins, strict=True):
                for i, pin in zip(idx, got, strict=True):
                    if pin is None:
                        continue
                    found.set(i)
                    lease = None
                    if pin.lease is not None:
                        lease = made.get((pin.holder, pin.lease))
                        if lease is None:
                            lease = _Lease(
                                store,
                                pin,
                                [],
                                now,
                                now + pin.ttl_ms / 2000,
                                now + pin.ttl_ms / 1000,
                            )
                            made[(pin.holder, pin.lease)] = lease
                            self._leases.add(lease)
                        lease.refs += 1
                        lease.keys.append(keys[i])
                    self._locks.setdefault(keys[i], []).append(lease)
        return found

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        done = []
        with self._lock:
            if self._closed:
                return  # every lease was released by close
            for key in keys:
                held = self._locks.get(key)
                if not held:
                    continue  # never locked (a miss)
                # Which request unlocks is not said: a lock that protects
                # nothing any more (its lease gone, or none granted) is taken
                # first, so no live lease is released under another lock.
                spent = [i for i, x in enumerate(held) if x is None or x.gone]
                lease = held.pop(spent[-1] if spent else -1)
                if not held:
                    del self._locks[key]
                if lease is not None and not lease.gone:
                    lease.refs -= 1
                    if lease.refs <= 0:
                        lease.gone = True
                        self._leases.discard(lease)
                        done.append(lease)
        for lease in done:  # LE1: released, not left to expire
            self._soon(lease.store.release(lease.pin))

    async def _renew_forever(self) -> None:
        """Renew the leases of locked keys at half their TTL; give one up
        when its holder no longer has it or after ``max_lock_s``."""
        every = max(0.05, min(1.0, self.config.settings.lease_ms / 4000))
        while True:
            await asyncio.sleep(every)
            try:
                await self._renew_due()
            except Exception:  # never the end of renewing
                log.exception("kvstore L2 adapter: lease renewal failed")

    async def _renew_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [x for x in self._leases if now >= x.renew_at]
        # All at once: a holder that does not answer delays only its own.
        await asyncio.gather(*(self._renew(lease, now) for lease in due))

    async def _renew(self, lease: _Lease, now: float) -> None:
        if now - lease.since >= self.config.max_lock_s:
            log.warning(
                "kvstore: %d keys locked for over %.0f s; their lease is given up",
                len(lease.keys),
                self.config.max_lock_s,
            )
            self._forget(lease)
            await lease.store.release(lease.pin)
            return
        ttl = await lease.store.renew(lease.pin, self.config.settings.lease_ms)
        if lease.gone:
            return  # unlocked (and released) meanwhile
        if ttl:
            done = time.monotonic()
            lease.renew_at, lease.expires_at = done + ttl / 2000, done + ttl / 1000
        elif ttl is None and time.monotonic() < lease.expires_at:
            lease.renew_at = time.monotonic() + 0.5  # not answered: asked again while it lasts
        else:
            self._forget(lease)  # gone at its holder, or expired unrenewed

    def _forget(self, lease: _Lease) -> None:
        """A lease that is gone. Its keys' entries stay (each unlock still
        takes exactly one, and skips it): removing them would let an unlock
        of this lease's request release another request's live lease."""
        with self._lock:
            lease.gone = True
            self._leases.discard(lease)

    # --- load -------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(
            self._loads, lambda: self._load(keys, objects), lambda: Bitmap(len(keys))
        )

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._loads, task_id)

    async def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        loaded = Bitmap(len(keys))
        with self._lock:  # where each key is locked, if it is
            pins = [self._pin_of(key) for key in keys]
        groups = list(self._by_store(keys).items())

        def into(idx: list[int]) -> Callable[[int, BytesLike], bool | None]:
            def convert(j: int, body: BytesLike) -> bool | None:
                obj = objects[idx[j]]
                tokens = self._tokens(obj)
                got = chunk_of(
                    body, self.geometry.layers, self.row_octets, self.geometry.block_tokens
                )
                if tokens is None or got is None or got.token_count != tokens:
                    return None
                copy_chunk(
                    got, memoryview(obj.byte_array).cast("B"), self.geometry.layers, self.row_octets
                )
                return True

            return convert

        results = await asyncio.gather(
            *(
                store.fetch_many(
                    [chunk_name(keys[i], self._dtype_name) for i in idx],
                    into(idx),
                    pinned=[pins[i] for i in idx],
                )
                for store, idx in groups
            )
        )
        accessed = []
        for (_, idx), got in zip(groups, results, strict=True):
            for i, ok in zip(idx, got, strict=True):
                if ok:
                    loaded.set(i)
                    accessed.append(keys[i])
        if accessed:
            self._notify_keys_accessed(accessed)
        return loaded

    def _pin_of(self, key: ObjectKey) -> Pin | None:
        for lease in reversed(self._locks.get(key, ())):
            if lease is not None and not lease.gone:
                return lease.pin
        return None

    # --- eviction, status, close ----------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache's eviction of ``keys``: KVSP has no client delete, so the
        holders keep the chunks until their own eviction; the adapter's byte
        accounting forgets them (a locked key is kept, as LMCache's own
        adapters do)."""
        with self._lock:
            gone = [k for k in keys if k in self._sizes and k not in self._locks]
            sizes = [self._sizes.pop(k) for k in gone]
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict[str, Any]:
        stores = [self.store, *self._salted.values()]
        with self._lock:
            locked, leases = len(self._locks), len(self._leases)
        stats: dict[str, int] = {}
        for store in stores:
            for name, value in store.stats.to_json().items():
                stats[name] = stats.get(name, 0) + value
        return {
            "is_healthy": any(s.healthy() for s in stores),
            "type": "KvstoreL2Adapter",
            "holders": list(self.store.holders),
            "scope": self.store.scope_id,
            "compat": self.store.compat_id,
            "locked_keys": locked,
            "leases_held": leases,
            **stats,
        }

    def close(self) -> None:
        async def shutdown() -> None:
            self._renewer.cancel()
            if self._background:  # tasks in flight, releases of unlocked leases
                await asyncio.wait(self._background, timeout=5)
            for task in list(self._background):  # not to use a closed client later
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            with self._lock:
                held, self._leases = list(self._leases), set()
                self._locks.clear()
            if held:  # bounded: a lease not released expires by itself
                _, late = await asyncio.wait(
                    [asyncio.ensure_future(x.store.release(x.pin)) for x in held], timeout=3
                )
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            for store in (self.store, *self._salted.values()):
                await store.close()

        with self._lock:
            self._closed = True

        try:
            self._loop.run(shutdown(), timeout_s=10)
        except Exception as exc:  # leases expire by themselves
            log.warning("kvstore L2 adapter: close did not finish cleanly: %s", describe(exc))
        self._loop.stop()
        for tasks in (self._stores, self._lookups, self._loads):
            tasks.notifier.close()


__all__ = ("KvstoreL2Adapter", "KvstoreL2AdapterConfig", "chunk_name")
