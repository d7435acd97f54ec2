"""kvstore as an L2 adapter of LMCache's multi-process mode (issue 21).

LMCache's own MP-mode ``StorageManager`` (CPU memory as L1, the adapter
loaded by its plug-in loader from the ``--l2-adapter`` JSON an operator
writes) stores chunks through the adapter into a real holder process over
mTLS, and a fresh storage manager prefetches them back, equal. The rest
drives the adapter as LMCache's store and prefetch controllers do
(``submit_*``, completion by event descriptor): locks are leases (a locked
chunk outlives pressure that evicts its neighbours, its lease renewed past
its TTL), a killed holder gives misses and failed stores, not exceptions or
hangs, ``cache_salt`` keeps tenants apart, and the byte accounting is the
interface's."""

from __future__ import annotations

import json
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

from kvstore.config import ConfigError
from kvstore.integrations.chunks import ChunkSettings, ChunkStore, Geometry
from kvstore.integrations.kv2ltd import chunk_of
from kvstore.integrations.lmcache_mp import KvstoreL2Adapter, KvstoreL2AdapterConfig, chunk_name

from .holder import Holder, start_holder

LAYERS, TOKENS, HIDDEN, HEADS, HEAD_DIM = 4, 16, 16, 2, 8
SHAPE = torch.Size([2, LAYERS, TOKENS, HIDDEN])
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.bfloat16])
RANK = ObjectKey.ComputeKVRank(world_size=2, global_rank=1, local_world_size=2, local_rank=1)
#: One chunk's container (header, digests and 4 KiB of KV) is under 4.5 KiB.
CHUNK_OCTETS = 4608


def params(holder: Holder, **more: Any) -> dict[str, Any]:
    """``adapter_params`` as an operator writes them (docs/integrations.md)."""
    found: dict[str, Any] = {k.removeprefix("kvstore."): v for k, v in holder.options().items()}
    found.update(
        layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, kv_dtype="bf16", chunk_size=TOKENS, **more
    )
    return found


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(
        chunk_hash=i.to_bytes(4, "big") * 8,
        model_name="toy",
        kv_rank=RANK,
        object_group_id=0,
        cache_salt=salt,
    )


def payload(i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=generator).to(torch.bfloat16)


def chunk(data: torch.Tensor | None = None, shape: torch.Size = SHAPE) -> TensorMemoryObj:
    """A buffer as LMCache's L1 hands its adapters (KV_2LTD, one shape)."""
    raw = torch.zeros(shape.numel(), dtype=torch.bfloat16)
    if data is not None:
        raw.copy_(data.flatten())
    meta = MemoryObjMetadata(
        shape=shape,
        dtype=torch.bfloat16,
        address=0,
        phy_size=raw.numel() * 2,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[shape],
        dtypes=[torch.bfloat16],
    )
    return TensorMemoryObj(raw, meta, None)


def wait(fd: int, result: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """As LMCache's controllers wait: poll the descriptor, then ask."""
    deadline = time.monotonic() + timeout_s
    while (found := result()) is None:
        assert time.monotonic() < deadline, "the adapter never completed the task"
        if select.select([fd], [], [], 0.2)[0]:
            consume_fd(fd)
    return found


def store(adapter: KvstoreL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objs)
    return wait(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task))


def lookup(adapter: KvstoreL2Adapter, keys: list[ObjectKey]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {0: LAYOUT})
    bits = wait(
        adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task)
    )
    return [bits.test(i) for i in range(len(keys))]


def load(adapter: KvstoreL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    bits = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return [bits.test(i) for i in range(len(keys))]


@pytest.fixture
def adapters() -> Iterator[list[KvstoreL2Adapter]]:
    made: list[KvstoreL2Adapter] = []
    yield made
    for adapter in made:  # its loop thread and event descriptors
        adapter.close()


def adapter_for(made: list[KvstoreL2Adapter], holder: Holder, **more: Any) -> KvstoreL2Adapter:
    built = KvstoreL2Adapter(KvstoreL2AdapterConfig.from_dict(params(holder, **more)))
    made.append(built)
    return built


# --- through LMCache's MP-mode storage manager -------------------------------------


def storage_manager(holder: Holder) -> StorageManager:
    l2 = {
        "type": "plugin",
        "module_path": "kvstore.integrations.lmcache_mp",
        "class_name": "KvstoreL2Adapter",
        "adapter_params": params(holder),
    }
    config = parse_args(
        [
            "--l1-size-gb",
            str(16 / 1024),
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            json.dumps(l2),
        ]
    )
    return StorageManager(config)


def our_adapter(manager: StorageManager) -> KvstoreL2Adapter:
    ((_, adapter),) = manager.l2_adapters()
    assert isinstance(adapter, KvstoreL2Adapter)  # built by LMCache's plug-in loader
    return adapter


def prefetch(manager: StorageManager, keys: list[ObjectKey]) -> dict[int, torch.Tensor]:
    """LMCache's prefetch of ``keys`` (its L1 empty): each hit's tensor."""
    spec = PrefetchTaskSpec(
        key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]
    )
    handle = manager.submit_prefetch_task(spec, external_request_id="test")
    assert manager.wait_prefetch_status(handle, timeout=20.0)
    hits = manager.query_prefetch_status(handle).hit_cells[0].get_indices_list()
    got: dict[int, torch.Tensor] = {}
    if hits:
        with manager.read_prefetched_results([keys[i] for i in hits]) as objs:
            assert objs is not None
            got = {i: obj.tensor.clone() for i, obj in zip(hits, objs, strict=True)}
        manager.finish_read_prefetched([keys[i] for i in hits])
    return got


def test_lmcache_storage_manager_stores_and_a_fresh_one_prefetches_through_kvstore(
    holder: Holder,
) -> None:
    keys = [key(i) for i in range(4)]
    writer = storage_manager(holder)
    try:
        objs = writer.reserve_write(keys, LAYOUT)
        assert len(objs) == len(keys)
        for i, k in enumerate(keys):
            objs[k].tensor.copy_(payload(i))
        writer.finish_write(keys)  # LMCache's store controller takes it from here
        adapter = our_adapter(writer)
        deadline = time.monotonic() + 20
        while adapter.get_usage().total_bytes_used < 4 * SHAPE.numel() * 2:
            assert time.monotonic() < deadline, adapter.report_status()
            time.sleep(0.02)
        assert adapter.report_status()["puts"] == 4
    finally:
        writer.close()

    reader = storage_manager(holder)  # another server: nothing in its L1
    try:
        got = prefetch(reader, [*keys, key(99)])  # the fifth was never stored
        assert sorted(got) == [0, 1, 2, 3]
        for i in range(4):
            assert torch.equal(got[i], payload(i))
        status = our_adapter(reader).report_status()
        # Looked up and locked as a lease, loaded under it, unlocked: released.
        assert status["leases"] >= 1 and status["hits"] == 4
        assert status["locked_keys"] == 0 and status["leases_held"] == 0
    finally:
        reader.close()

    # The in-process plug-in's name and container for the same key: either
    # mode reads what the other stored (kvstore.integrations.kv2ltd).
    same = CacheEngineKey("toy", 2, 1, keys[2].chunk_hash, torch.bfloat16)
    assert chunk_name(keys[2], "bfloat16") == same.to_string()
    geometry = Geometry(LAYERS, HEADS, HEAD_DIM, "bf16", TOKENS)
    options = {k.removeprefix("kvstore."): v for k, v in holder.options().items()}
    in_process = ChunkStore(
        ChunkSettings.from_options(options, namespace="lmcache", geometry=geometry)
    )
    import asyncio

    async def read() -> bytes | None:
        try:
            return (await in_process.get_many([same.to_string()]))[0]
        finally:
            await in_process.close()

    body = asyncio.run(read())
    assert body is not None
    container = chunk_of(body, LAYERS, HIDDEN * 2, TOKENS)
    assert container is not None
    rows = payload(2)
    assert (
        bytes(container.layer(3).k) == rows[0, 3].contiguous().view(torch.uint8).numpy().tobytes()
    )
    assert (
        bytes(container.layer(3).v) == rows[1, 3].contiguous().view(torch.uint8).numpy().tobytes()
    )


# --- locks are leases -------------------------------------------------------------


def test_a_locked_chunk_is_not_evicted_under_pressure_and_its_lease_outlives_its_ttl(
    tmp_path: Path, adapters: list[KvstoreL2Adapter]
) -> None:
    holder = start_holder(tmp_path, capacity=12 * CHUNK_OCTETS)
    try:
        # Leases of 600 ms: the pressure below lasts longer, so the adapter
        # must renew them (LE1) for the locked chunks to survive it.
        adapter = adapter_for(adapters, holder, lease_ms=600)
        first = [key(i) for i in range(8)]
        assert store(adapter, first, [chunk(payload(i)) for i in range(8)]).is_successful()
        assert lookup(adapter, first[:2]) == [True, True]  # locked: two keys, one lease
        assert adapter.report_status()["leases_held"] == 1
        for batch in range(6):  # four times what the holder has room for, over ~1.5 s
            more = [key(100 + 8 * batch + i) for i in range(8)]
            store(adapter, more, [chunk(payload(100 + 8 * batch + i)) for i in range(8)])
            time.sleep(0.25)
        # Their unlocked neighbours, stored at the same time, were evicted ...
        assert not all(lookup(adapter, first[2:]))
        # ... the locked ones are still there, and load whole.
        out = [chunk(), chunk()]
        assert load(adapter, first[:2], out) == [True, True]
        assert torch.equal(out[0].tensor, payload(0)) and torch.equal(out[1].tensor, payload(1))
        adapter.submit_unlock(first[:2])
        adapter.submit_unlock(first[2:])  # the locks of the neighbours found above
        deadline = time.monotonic() + 5
        while adapter.report_status()["leases_held"] or adapter.report_status()["locked_keys"]:
            assert time.monotonic() < deadline, adapter.report_status()
            time.sleep(0.05)
    finally:
        holder.stop()


def test_a_key_locked_twice_stays_locked_until_unlocked_twice(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    adapter = adapter_for(adapters, holder)
    keys = [key(i) for i in range(3)]
    assert store(adapter, keys, [chunk(payload(i)) for i in range(3)]).is_successful()
    assert lookup(adapter, keys) == [True] * 3
    assert lookup(adapter, keys[:1]) == [True]
    assert adapter.report_status()["leases_held"] == 2
    adapter.submit_unlock(keys)
    time.sleep(0.2)
    status = adapter.report_status()
    assert status["locked_keys"] == 1 and status["leases_held"] == 1  # the second lookup's
    adapter.submit_unlock(keys[:1])
    adapter.submit_unlock([key(50)])  # never locked: nothing to do, no error
    assert adapter.report_status()["leases_held"] == 0


# --- failures are misses ------------------------------------------------------------


def test_a_holder_killed_mid_batch_gives_misses_and_failed_stores_not_errors(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    adapter = adapter_for(adapters, holder)
    keys = [key(i) for i in range(6)]
    assert store(adapter, keys, [chunk(payload(i)) for i in range(6)]).is_successful()
    assert lookup(adapter, keys) == [True] * 6  # locked at the holder
    # A store of 64 chunks in flight when the holder dies.
    many = [key(200 + i) for i in range(64)]
    task = adapter.submit_store_task(many, [chunk(payload(200 + i)) for i in range(64)])
    holder.kill()
    result = wait(
        adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task)
    )
    assert not result.is_successful()
    tried = adapter.report_status()["errors"]  # the stores in flight when it died
    out = [chunk() for _ in keys]
    assert load(adapter, keys, out) == [False] * 6  # misses, into untouched buffers
    assert not any(o.tensor.any() for o in out)
    adapter.submit_unlock(keys)  # its leases died with the holder: no error
    assert lookup(adapter, keys) == [False] * 6
    status = adapter.report_status()
    # Misses, not retries: at most one request a chunk loaded (each
    # refused at once by the dead holder), none for the lookups.
    assert 1 <= tried <= status["errors"] <= tried + len(keys)
    assert not status["is_healthy"]
    # Back (empty: host memory only): stores and finds again, no restart.
    holder.start()
    time.sleep(1.1)  # past down_backoff_s
    assert store(adapter, keys[:2], [chunk(payload(0)), chunk(payload(1))]).is_successful()
    assert lookup(adapter, keys[:3]) == [True, True, False]
    adapter.submit_unlock(keys[:2])


def test_lmcache_prefetch_from_a_dead_holder_is_a_miss(holder: Holder) -> None:
    manager = storage_manager(holder)
    try:
        holder.kill()
        assert prefetch(manager, [key(i) for i in range(4)]) == {}
        # A miss after at most one refused request a key, not retries.
        assert 1 <= our_adapter(manager).report_status()["errors"] <= 4
    finally:
        manager.close()


# --- tenants ------------------------------------------------------------------------


def test_cache_salt_keeps_tenants_apart_in_names_and_scopes(
    tmp_path: Path, adapters: list[KvstoreL2Adapter]
) -> None:
    holder = start_holder(tmp_path, scope_keys=2)
    try:
        bob_key = tmp_path / "scope-1.key"
        adapter = adapter_for(adapters, holder, salt_scopes={"bob": str(bob_key)})
        alice, bob, nobody = key(7, "alice"), key(7, "bob"), key(7)
        assert len({chunk_name(k, "bfloat16") for k in (alice, bob, nobody)}) == 3
        assert store(adapter, [alice], [chunk(payload(1))]).is_successful()
        # The same chunk hash under another salt, or none, is another chunk.
        assert lookup(adapter, [alice, bob, nobody]) == [True, False, False]
        assert store(adapter, [bob], [chunk(payload(2))]).is_successful()
        assert lookup(adapter, [bob]) == [True]
        out = [chunk(), chunk()]
        assert load(adapter, [alice, bob], out) == [True, True]
        assert torch.equal(out[0].tensor, payload(1)) and torch.equal(out[1].tensor, payload(2))
        adapter.submit_unlock([alice, bob])
        # Bob's chunk is in his own scope: a store of that scope finds it,
        # the default scope's does not.
        options = {k.removeprefix("kvstore."): v for k, v in holder.options().items()}
        geometry = Geometry(LAYERS, HEADS, HEAD_DIM, "bf16", TOKENS)
        import asyncio

        def held(scope_file: Path) -> bool:
            settings = ChunkSettings.from_options(
                {**options, "scope_key_file": str(scope_file)},
                namespace="lmcache",
                geometry=geometry,
            )
            found = ChunkStore(settings)

            async def ask() -> bool:
                try:
                    return await found.contains(chunk_name(bob, "bfloat16"))
                finally:
                    await found.close()

            return asyncio.run(ask())

        assert held(bob_key) and not held(holder.scope_key_file)
        usage = adapter.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"alice": 4096, "bob": 4096}
        # A salt without a scope of its own, where each needs one: refused.
        strict = adapter_for(
            adapters, holder, salt_scopes={"bob": str(bob_key)}, salt_scopes_only=True
        )
        assert not store(strict, [key(8, "carol")], [chunk(payload(3))]).is_successful()
        assert lookup(strict, [key(7, "alice"), bob]) == [False, True]
        strict.submit_unlock([bob])
    finally:
        holder.stop()


# --- the interface's other duties ---------------------------------------------------------


def test_byte_accounting_and_delete_follow_the_interface(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    adapter = adapter_for(adapters, holder)
    keys = [key(i) for i in range(3)]
    result = store(adapter, keys, [chunk(payload(i)) for i in range(3)])
    assert result.is_successful() and result.bytes_transferred() == 3 * 4096
    again = store(adapter, keys[:1], [chunk(payload(0))])  # held already: stored, not counted
    assert again.is_successful() and again.bytes_transferred() == 0
    assert adapter.get_usage().total_bytes_used == 3 * 4096
    assert lookup(adapter, keys[:1]) == [True]
    adapter.delete(keys)  # the locked one is kept, as LMCache's own adapters keep it
    assert adapter.get_usage().total_bytes_used == 4096
    adapter.submit_unlock(keys[:1])
    adapter.delete(keys[:1])
    assert adapter.get_usage().total_bytes_used == 0
    # KVSP has no client delete: the holder still serves them.
    assert lookup(adapter, keys) == [True] * 3
    adapter.submit_unlock(keys)
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3  # three distinct descriptors, as the interface demands


def test_objects_of_another_geometry_fail_their_task_not_the_caller(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    adapter = adapter_for(adapters, holder)
    odd = chunk(shape=torch.Size([2, LAYERS + 1, TOKENS, HIDDEN]))
    result = store(adapter, [key(1), key(2)], [chunk(payload(1)), odd])
    assert not result.is_successful()  # the interface's coarse error: the task failed
    assert adapter.get_usage().total_bytes_used == 4096  # the chunk that was stored counts
    assert lookup(adapter, [key(1), key(2)]) == [True, False]
    short = chunk(shape=torch.Size([2, LAYERS, TOKENS // 2, HIDDEN]))
    assert load(adapter, [key(1)], [short]) == [False]  # 16 tokens held, 8 asked
    assert not short.tensor.any()
    adapter.submit_unlock([key(1)])


def test_the_store_and_prefetch_threads_may_call_at_once(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    adapter = adapter_for(adapters, holder)
    base = [key(i) for i in range(8)]
    assert store(adapter, base, [chunk(payload(i)) for i in range(8)]).is_successful()
    failures: list[BaseException] = []

    def storing() -> None:
        try:
            for round_ in range(10):
                keys = [key(1000 + 8 * round_ + i) for i in range(8)]
                assert store(adapter, keys, [chunk(payload(i)) for i in range(8)]).is_successful()
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    def prefetching() -> None:
        try:
            for _ in range(10):
                assert lookup(adapter, base) == [True] * 8
                out = [chunk() for _ in base]
                assert load(adapter, base, out) == [True] * 8
                assert torch.equal(out[5].tensor, payload(5))
                adapter.submit_unlock(base)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=storing), threading.Thread(target=prefetching)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert adapter.get_usage().total_bytes_used == 88 * 4096
    deadline = time.monotonic() + 5
    while adapter.report_status()["leases_held"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_adapter_params_are_checked_with_clear_errors(holder: Holder, tmp_path: Path) -> None:
    good = params(holder)
    with pytest.raises(ConfigError, match="geometry"):
        KvstoreL2AdapterConfig.from_dict(
            {
                k: v
                for k, v in good.items()
                if k not in ("layers", "kv_heads", "head_dim", "kv_dtype", "chunk_size")
            }
        )
    with pytest.raises(ConfigError, match="head_dim"):
        KvstoreL2AdapterConfig.from_dict({**good, "head_dim": "eight"})
    with pytest.raises(ConfigError, match="salt_scopes"):
        KvstoreL2AdapterConfig.from_dict({**good, "salt_scopes": {"x": str(tmp_path / "none")}})
    with pytest.raises(ValueError, match="holders"):  # LMCache expects ValueError
        KvstoreL2AdapterConfig.from_dict({**good, "holders": []})
    # Issue 33: an unknown option is refused (it was ignored: 5 s, not 0.5),
    # and "false" is false (bool("false") was true).
    with pytest.raises(
        ConfigError, match=r'kvstore\.timout_s: unknown option; did you mean "timeout_s"'
    ):
        KvstoreL2AdapterConfig.from_dict({**good, "timout_s": 0.5})
    assert (
        KvstoreL2AdapterConfig.from_dict({**good, "salt_scopes_only": "false"}).salt_scopes_only
        is False
    )
    assert KvstoreL2AdapterConfig.from_dict({**good, "salt_scopes_only": "true"}).salt_scopes_only
    with pytest.raises(ConfigError, match=r"salt_scopes_only: 'maybe' is not true or false"):
        KvstoreL2AdapterConfig.from_dict({**good, "salt_scopes_only": "maybe"})
    with pytest.raises(ConfigError, match=r"kvstore\.max_lock_s: 'soon' is not a number"):
        KvstoreL2AdapterConfig.from_dict({**good, "max_lock_s": "soon"})
    # The geometry of a descriptor file, as the in-process plug-in reads it.
    descriptor = {
        "model": "toy-model",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
        "positional": "rope",
        "layers": LAYERS,
        "kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "kv_dtype": "bf16",
        "block_tokens": TOKENS,
        "layout": "kvsp-layout-1",
    }
    (tmp_path / "d.json").write_text(json.dumps(descriptor))
    from_file = {
        k: v
        for k, v in good.items()
        if k
        not in (
            "layers",
            "kv_heads",
            "head_dim",
            "kv_dtype",
            "chunk_size",
            "model",
            "model_digest",
            "tokenizer_digest",
        )
    }
    config = KvstoreL2AdapterConfig.from_dict(
        {**from_file, "descriptor_file": str(tmp_path / "d.json")}
    )
    assert config.settings.descriptor.layers == LAYERS
    assert "holders" in KvstoreL2AdapterConfig.help()
    assert os.environ.get("LMCACHE_TRACK_USAGE") == "false"  # no telemetry from the tests


def test_a_lease_lost_at_its_holder_does_not_cost_another_requests_lock(
    holder: Holder, adapters: list[KvstoreL2Adapter]
) -> None:
    # Two requests lock the same key (two leases). The first lease is lost
    # at the holder (released behind the adapter's back, as a restart would);
    # the first request's unlock must not release the second's live lease.
    adapter = adapter_for(adapters, holder, lease_ms=600)
    k = key(3)
    assert store(adapter, [k], [chunk(payload(3))]).is_successful()
    assert lookup(adapter, [k]) == [True]
    (first,) = list(adapter._leases)  # white-box: the first request's lease
    assert lookup(adapter, [k]) == [True]
    import asyncio

    asyncio.run_coroutine_threadsafe(first.store.release(first.pin), adapter._loop.loop).result(5)
    deadline = time.monotonic() + 5
    while not first.gone:  # its renewal finds it gone
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert adapter.report_status()["leases_held"] == 1
    adapter.submit_unlock([k])  # the first request's unlock
    time.sleep(1.0)  # past the second lease's TTL: kept by renewal, not released
    assert adapter.report_status()["leases_held"] == 1
    out = [chunk()]
    assert load(adapter, [k], out) == [True] and torch.equal(out[0].tensor, payload(3))
    adapter.submit_unlock([k])  # the second's: now released
    assert adapter.report_status()["leases_held"] == 0


def test_calls_after_close_fail_their_task_and_raise_nothing(holder: Holder) -> None:
    adapter = KvstoreL2Adapter(params(holder))
    adapter.close()
    task = adapter.submit_store_task([key(1)], [chunk(payload(1))])
    assert not adapter.pop_completed_store_tasks()[task].is_successful()
    task = adapter.submit_lookup_and_lock_task([key(1)], {0: LAYOUT})
    assert not adapter.query_lookup_and_lock_result(task).test(0)
    adapter.submit_unlock([key(1)])
