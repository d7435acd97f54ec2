"""``kvstore bench store``: put and get GB/s per tier, beside raw baselines.

For each tier, ``count`` blocks of ``block_mib`` MiB (32 layers) are stored
and read back through the :class:`TieredStore`, and the same octets through
the tier's own library with nothing around it:

=============  ==========================================
tier           baseline
=============  ==========================================
host           put: one SHA-256 pass over the octets (the work B3
               requires; a dict put stores a reference and moves no
               octets); get: a dict get, both sides copying the octets
               out as a send would
local-storage  raw ``lmdb`` put/get (same map, same sync)
remote-memory  raw redis-py SET/GET
remote-storage raw aiobotocore put_object/get_object
=============  ==========================================

A store put decodes the container and hashes every layer (B3): work a raw
put does not do. LMDB runs with ``sync=False`` on both sides: fsync time is
the disk's, not ours, and made the comparison noise. Reads are consumed as a
server would send them (the chunk stream, no join). A last pair of rows
shows the cost of AES-GCM on LMDB.

Tier movement (issue 36) has rows of its own for LMDB, Redis and S3, apart
from the store's obligations toward a new block (decoding it, its layer
digests, B3, and its Repr-Digest, BL4, which a put pays once): a demotion
of blocks already held, from host memory into the tier (the segment's
checksum made, its layer table in the same batch call), against the raw
put; a read back through the segment loader (the tier's get and the
checksum checked: what a promotion and a cold GET read), against the raw
get.

Restart recovery (issue 36): an LMDB tier holding N sealed blocks of 128
KiB is opened by a new store, which finds them again. Rows: milliseconds a
block at each N, against the same tier recovered by reading and checking
every segment (what a tier that cannot size its keys without reading them
gets, and every tier got before), and against the figure at the smallest N
(flat as N grows: goal <= 1.5). And the restart as a holder makes it: the
store opened with its scan in the background, the time until a GET of the
block the scan reaches last is served, against the whole recovery first
(goal: 2 s whatever N).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvstore.protocol import container as kc
from kvstore.protocol._bytes import BytesLike
from kvstore.storage import BlockRef, SegmentSealer, TieredStore
from kvstore.storage.records import Segment
from kvstore.storage.settings import StoreSettings
from kvstore.storage.tier import Tier

from . import Result

COMPAT = hashlib.sha256(b"bench").hexdigest()
SCOPE = "0" * 32


def _blocks(count: int, block_octets: int, layers: int = 32) -> list[tuple[BlockRef, bytes]]:
    section = block_octets // (2 * layers)
    out = []
    for n in range(count):
        secs = [(os.urandom(section), os.urandom(section)) for _ in range(layers)]
        key = hashlib.sha256(n.to_bytes(4, "big") + os.urandom(8)).hexdigest()
        out.append((BlockRef(COMPAT, SCOPE, key), bytes(kc.encode(secs, token_count=16))))
    return out


async def _best(fn: Callable[[], Awaitable[None]], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - start)
    return best


async def _measure_store(
    make_tier: Callable[[], Tier],
    blocks: list[tuple[BlockRef, bytes]],
    repeat: int,
    sealer: SegmentSealer | None = None,
    consume: Callable[[BytesLike], None] | None = None,
) -> tuple[float, float]:
    """(put seconds, get seconds) for all blocks through a fresh store each round;
    ``consume`` is called on each chunk read."""
    puts, gets = [], []
    for _ in range(repeat):
        tier = make_tier()
        store = TieredStore([(tier, 1 << 40)], StoreSettings(promote=False), sealer=sealer)
        start = time.perf_counter()
        for ref, data in blocks:
            await store.put(ref, data)
        puts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for ref, _ in blocks:
            async for chunk in store.read(ref):
                if consume is not None:
                    consume(chunk)
        gets.append(time.perf_counter() - start)
        for ref, _ in blocks:
            await store.delete(ref)
        await store.close()
    return min(puts), min(gets)


async def _measure_movement(
    make_tier: Callable[[], Tier], blocks: list[tuple[BlockRef, bytes]], repeat: int
) -> tuple[float, float]:
    """(demotion seconds, read-back seconds) for all blocks between a host
    tier and a fresh ``make_tier()`` below it: tier movement alone, of
    blocks the store already holds and digested. A demotion writes each
    segment below (its checksum made, the layer table in the same batch
    call) and deletes it above; a read back is what a promotion or a cold
    GET reads, through the segment loader (the tier's get, its checksum
    checked)."""
    from kvstore.backends.host import HostTier

    demotions, reads = [], []
    for _ in range(repeat):
        store = TieredStore(
            [(HostTier(), 1 << 40), (make_tier(), 1 << 40)],
            StoreSettings(promote=False, demote_above=0),
        )
        for ref, data in blocks:
            await store.put(ref, data)
        infos = [store.info(ref) for ref, _ in blocks]
        start = time.perf_counter()
        for info in infos:
            await info.claim.take()
            try:
                await store.placement.demote(info, info.segments[0], make_room=False)
            finally:
                info.claim.give()
        demotions.append(time.perf_counter() - start)
        assert all(i.segments[0].slot == 1 for i in infos), "a demotion did not happen"
        start = time.perf_counter()
        for info in infos:
            await store.loader.load(info, info.segments[0])
        reads.append(time.perf_counter() - start)
        for ref, _ in blocks:
            await store.delete(ref)
        await store.close(spill=False)
    return min(demotions), min(reads)


def _rows(
    tier: str,
    octets: int,
    ours: tuple[float, float],
    raw: tuple[float, float],
    what: str,
    moves: tuple[float, float] | None = None,
) -> list[Result]:
    """A tier's rows against its raw client: the store's put (its own
    obligations, B3 and BL4, included) and get; with ``moves`` (see
    :func:`_measure_movement`), tier movement alone: a demotion's write
    against the raw put, a read back against the raw get."""
    gb = octets / 1e9
    rows = [
        Result(f"{tier} put", "GB/s", gb / ours[0], f"{what} put", gb / raw[0], goal=0.7),
        Result(f"{tier} get", "GB/s", gb / ours[1], f"{what} get", gb / raw[1], goal=0.7),
    ]
    if moves is not None:
        rows += [
            Result(f"{tier} demotion", "GB/s", gb / moves[0], f"{what} put", gb / raw[0], 0.7),
            Result(f"{tier} read back", "GB/s", gb / moves[1], f"{what} get", gb / raw[1], 0.7),
        ]
    return rows


async def bench_host(blocks: list[tuple[BlockRef, bytes]], repeat: int) -> list[Result]:
    from kvstore.backends.host import HostTier

    octets = sum(len(d) for _, d in blocks)
    # The host tier keeps the very bytes object and a read yields views of
    # it: a raw dict put or get moves no octets (a reference, in microseconds:
    # thousands of "GB/s", and a ratio of 0.00). Both sides of the get copy
    # what they read into one send buffer, as a server's socket write would.
    sink = bytearray(max(len(d) for _, d in blocks))

    def copy_out(chunk: BytesLike) -> None:
        sink[: len(chunk)] = chunk

    ours = await _measure_store(HostTier, blocks, repeat, consume=copy_out)
    table = {ref.block_key: data for ref, data in blocks}

    async def get() -> None:
        for ref, _ in blocks:
            copy_out(table[ref.block_key])

    async def hash_once() -> None:
        for _, data in blocks:
            hashlib.sha256(data).digest()

    # A put must hash every layer (B3): against one SHA-256 pass over the same
    # octets, the ratio shows what the store adds beyond that mandatory work.
    hashed = await _best(hash_once, repeat)
    raw_get = await _best(get, repeat)
    gb = octets / 1e9
    return [
        Result("host put", "GB/s", gb / ours[0], "one sha256 pass", gb / hashed, goal=0.8),
        Result("host get", "GB/s", gb / ours[1], "dict get, same copy out", gb / raw_get, 0.7),
    ]


async def bench_lmdb(blocks: list[tuple[BlockRef, bytes]], repeat: int) -> list[Result]:
    import lmdb

    from kvstore.backends.lmdb import LmdbTier

    octets = sum(len(d) for _, d in blocks)
    root = tempfile.mkdtemp(prefix="kvstore-bench-")
    try:
        counter = iter(range(10**6))

        def fresh() -> LmdbTier:
            # sync=False as the raw side (module docstring): fsync is the disk's time.
            return LmdbTier(
                os.path.join(root, f"s{next(counter)}"),
                map_size=4 * octets + (64 << 20),
                sync=False,
            )

        ours = await _measure_store(fresh, blocks, repeat)
        moves = await _measure_movement(fresh, blocks, repeat)
        sealed = await _measure_store(fresh, blocks, repeat, SegmentSealer(bytes(32)))
        # A fresh map each round, as the store gets: new pages cost page faults.
        envs = iter(
            lmdb.open(
                os.path.join(root, f"raw{i}"),
                map_size=4 * octets + (64 << 20),
                readahead=False,
                sync=False,
            )
            for i in range(10**6)
        )
        env = next(envs)

        async def put() -> None:
            nonlocal env
            env = next(envs)
            for ref, data in blocks:
                with env.begin(write=True) as txn:
                    txn.put(ref.block_key.encode(), data)

        async def get() -> None:
            for ref, _ in blocks:
                with env.begin(buffers=True) as txn:
                    value = txn.get(ref.block_key.encode())
                    assert value is not None
                    bytes(value)

        raw = (await _best(put, repeat), await _best(get, repeat))
        env.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = octets / 1e9
    rows = _rows("local-storage (LMDB)", octets, ours, raw, "raw lmdb", moves)
    rows += [
        Result("LMDB put, AES-GCM on", "GB/s", gb / sealed[0], "LMDB put, off", gb / ours[0], 0.7),
        Result("LMDB get, AES-GCM on", "GB/s", gb / sealed[1], "LMDB get, off", gb / ours[1], 0.7),
    ]
    return rows


RECOVERY_BLOCK_LAYERS = 8
RECOVERY_SECTION = 8 << 10  # 8 layers x 2 x 8 KiB: 128 KiB a block


async def _recovery_ms(path: str, count: int, sealer: SegmentSealer, unsized: bool) -> float:
    """Milliseconds a block to recover the ``count`` blocks stored at ``path``."""
    from kvstore.backends.lmdb import LmdbTier

    tier: Any = LmdbTier(path, map_size=count * (160 << 10) + (64 << 20), sync=False)
    if unsized:
        # As a tier that cannot size its keys, whose restart reads and
        # checks every segment: the baseline.
        listed = tier.sized_keys

        async def no_sizes() -> AsyncIterator[tuple[str, int | None]]:
            async for key, _ in listed():
                yield key, None

        tier.sized_keys = no_sizes
    store = TieredStore([(tier, count * (160 << 10))], sealer=sealer)
    start = time.perf_counter()
    found = await store.recover()
    seconds = time.perf_counter() - start
    await store.close(spill=False)
    if found != count:
        raise RuntimeError(f"recovered {found} of {count} blocks")
    return 1000 * seconds / count


async def _serving_ms(path: str, count: int, sealer: SegmentSealer) -> float:
    """Milliseconds from a store's start until a GET of a block the
    background scan has not reached (the last it lists) is served: what a
    holder restarted over ``count`` blocks keeps its clients waiting."""
    from kvstore.backends.lmdb import LmdbTier

    tier = LmdbTier(path, map_size=count * (160 << 10) + (64 << 20), sync=False)
    store = TieredStore([(tier, count * (160 << 10))], sealer=sealer)
    last = max(_recovery_ref(n) for n in range(count))
    start = time.perf_counter()
    await store.open(background=True)
    await store.get(BlockRef(COMPAT, SCOPE, last))
    seconds = time.perf_counter() - start
    await store.recovered()
    found = len(store)
    await store.close(spill=False)
    if found != count:
        raise RuntimeError(f"recovered {found} of {count} blocks in the background")
    return 1000 * seconds


def _recovery_ref(n: int) -> str:
    return hashlib.sha256(b"recover%d" % n).hexdigest()


async def _store_for_recovery(path: str, count: int, sealer: SegmentSealer) -> None:
    """``count`` sealed blocks and their layer tables in LMDB, as a store
    leaves them (written in large transactions: the setup is not measured)."""
    from kvstore.backends.lmdb import LmdbTier
    from kvstore.storage.records import BlockInfo, layer_table, repr_digest_of

    layers = [
        (os.urandom(RECOVERY_SECTION), os.urandom(RECOVERY_SECTION))
        for _ in range(RECOVERY_BLOCK_LAYERS)
    ]
    data = bytes(kc.encode(layers, token_count=16))
    container = kc.decode(data)
    tier = LmdbTier(path, map_size=count * (160 << 10) + (64 << 20), sync=False)
    try:
        items: list[tuple[str, BytesLike]] = []
        for n in range(count):
            ref = BlockRef(COMPAT, SCOPE, _recovery_ref(n))
            last = RECOVERY_BLOCK_LAYERS - 1
            info = BlockInfo(
                ref,
                container.codec,
                container.token_count,
                layer_table(container),
                [Segment(ref, 0, last, 0, len(data))],
                whole_repr_digest=repr_digest_of(data),
                stored_at=time.time(),
            )
            items.append((ref.segment_key(0, last), sealer.seal(ref.segment_name(0, last), data)))
            items.append((ref.meta_key, sealer.seal(ref.meta_name, info.meta())))
            if len(items) >= 2000:
                await tier.put_many(items)
                items = []
        if items:
            await tier.put_many(items)
    finally:
        await tier.close()


async def bench_recovery(counts: tuple[int, ...]) -> list[Result]:
    sealer = SegmentSealer(bytes(32))
    rows: list[Result] = []
    first: float | None = None
    root = tempfile.mkdtemp(prefix="kvstore-bench-recover-")
    try:
        for count in counts:
            path = os.path.join(root, f"n{count}")
            await _store_for_recovery(path, count, sealer)
            ms = await _recovery_ms(path, count, sealer, unsized=False)
            every = await _recovery_ms(path, count, sealer, unsized=True)
            serving = await _serving_ms(path, count, sealer)
            shutil.rmtree(path, ignore_errors=True)
            what = f"restart recovery, LMDB sealed, {count:,} blocks of 128 KiB"
            # A holder serves while it recovers: its first answer comes
            # after one block's recovery, not the whole scan (goal: 2 s).
            rows.append(
                Result(
                    f"restart, {count:,} blocks: a GET of the last block served",
                    "ms",
                    serving,
                    "the whole recovery first",
                    ms * count,
                )
            )
            rows.append(
                Result(f"restart, {count:,} blocks: first GET served", "ms", serving, goal=2000)
            )
            rows.append(
                Result(
                    what,
                    "ms a block",
                    ms,
                    "every segment read and checked",
                    every,
                    direction="lower",
                )
            )
            rows.append(Result(f"{what}: blocks/s", "blocks/s", 1000 / ms))
            if first is None:
                first = ms
            else:
                rows.append(
                    Result(
                        f"{what}: ms a block",
                        "ms a block",
                        ms,
                        f"the same at {counts[0]:,} blocks",
                        first,
                        1.5,
                        direction="lower",
                    )
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


async def bench_redis(
    blocks: list[tuple[BlockRef, bytes]], repeat: int, url: str, cluster: bool = False
) -> list[Result]:
    """The tier through the store against redis-py's own SET/GET of the same
    octets, on one node or (``cluster``) a Redis Cluster, keys spread over
    its masters alike (one hash tag per block)."""
    from kvstore.backends.redis import RedisTier

    from ..redis_client import connect

    octets = sum(len(d) for _, d in blocks)
    prefix = f"bench{os.getpid()}:"
    ours = await _measure_store(
        lambda: RedisTier(url=url, prefix=prefix, cluster=cluster), blocks, repeat
    )
    moves = None
    if not cluster:  # the movement of one node's rows stands for both
        moves = await _measure_movement(lambda: RedisTier(url=url, prefix=prefix), blocks, repeat)
    client: Any = connect(url, cluster=cluster)
    names = [f"{prefix}{{{ref.block_key}}}" for ref, _ in blocks]

    async def put() -> None:
        for name, (_, data) in zip(names, blocks, strict=True):
            await client.set(name, data)

    async def get() -> None:
        for name in names:
            await client.get(name)

    raw = (await _best(put, repeat), await _best(get, repeat))
    for name in names:
        await client.delete(name)
    await client.aclose()
    if cluster:
        return _rows(
            "remote-memory (Redis Cluster, 3 masters)", octets, ours, raw, "raw redis-py cluster"
        )
    return _rows("remote-memory (Redis)", octets, ours, raw, "raw redis-py", moves)


async def bench_s3(
    blocks: list[tuple[BlockRef, bytes]], repeat: int, endpoint: str
) -> list[Result]:
    from aiobotocore.session import get_session

    from kvstore.backends.s3 import S3Tier

    octets = sum(len(d) for _, d in blocks)
    creds = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    bucket = f"kvstore-bench-{os.getpid()}"
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", **creds
    ) as client:
        await client.create_bucket(Bucket=bucket)

        def fresh() -> S3Tier:
            return S3Tier(
                bucket,
                endpoint_url=endpoint,
                region="us-east-1",
                access_key_id="bench",
                secret_access_key="bench",
            )

        ours = await _measure_store(fresh, blocks, repeat)
        moves = await _measure_movement(fresh, blocks, repeat)

        async def put() -> None:
            for ref, data in blocks:
                await client.put_object(Bucket=bucket, Key="raw/" + ref.block_key, Body=data)

        async def get() -> None:
            for ref, _ in blocks:
                response = await client.get_object(Bucket=bucket, Key="raw/" + ref.block_key)
                async with response["Body"] as body:
                    await body.read()

        raw = (await _best(put, repeat), await _best(get, repeat))
    return _rows("remote-storage (S3, moto)", octets, ours, raw, "raw aiobotocore", moves)


def _start_moto() -> tuple[Any, str] | None:
    """moto's server on a free loopback port, when moto is installed."""
    import socket
    import subprocess
    import sys

    try:
        import moto.server  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    process.kill()
    return None


async def _run(
    count: int,
    block_mib: float,
    repeat: int,
    redis_url: str | None,
    s3_endpoint: str | None,
    cluster_url: str | None = None,
    recovery: tuple[int, ...] = (1000,),
) -> list[Result]:
    blocks = _blocks(count, int(block_mib * (1 << 20)))
    results = await bench_host(blocks, repeat)
    results += await bench_lmdb(blocks, repeat)
    if redis_url:
        results += await bench_redis(blocks, repeat, redis_url)
    if cluster_url:
        results += await bench_redis(blocks, repeat, cluster_url, cluster=True)
    if s3_endpoint:
        results += await bench_s3(blocks, repeat, s3_endpoint)
    results += await bench_recovery(recovery)
    return results


def run(
    *,
    quick: bool = False,
    redis_url: str | None = "redis://127.0.0.1:6379/0",
    s3_endpoint: str | None = None,
    start_moto: bool = True,
    start_cluster: bool = True,
) -> list[Result]:
    """All store benchmarks; S3 runs against ``s3_endpoint`` or a moto server
    started here, the Redis Cluster rows against a 3-master cluster started
    here when redis-server and redis-cli are installed."""
    from . import redis_cluster

    moto = cluster = None
    if s3_endpoint is None and start_moto:
        moto = _start_moto()
        s3_endpoint = moto[1] if moto else None
    if start_cluster and redis_cluster.available():
        cluster = redis_cluster.start_cluster()
    try:
        # Quick: two rounds, as one alone is the cold one (thread pool, first page faults).
        return asyncio.run(
            _run(
                4 if quick else 16,
                2.0,
                2 if quick else 5,
                redis_url,
                s3_endpoint,
                cluster.url if cluster else None,
                (1000,) if quick else (1000, 16_000, 64_000),
            )
        )
    finally:
        if moto is not None:
            moto[0].kill()
            moto[0].wait()
        if cluster is not None:
            cluster.stop()
