"""``kvstore bench fetch`` (issue 35): the engine-side data path,
:class:`kvstore.fetch.BlockFetcher`, at the speed of prefill.

One client process (this one) fetches 2 MiB blocks of 32 layers over mutual
TLS from three servers in processes of their own:

* a holder with one worker and with two (``[server] workers``), each block
  stored at the worker its key ranks first (the holder set's rendezvous);
* nginx serving the same containers as static files, with their
  ``Repr-Digest`` (a server that costs little CPU, so the client's own
  cost shows).

For each, with K = 1, 2 and this machine's cores threads: GB/s verified
(Repr-Digest and every layer against the replica record, BL6) beside the
same fetch unverified; the client's CPU seconds per verified GB (this
process's own rusage: the servers are other processes); and the break-even
prefill rate for an 8B-class model (128 KiB of KV a token): the tokens a
second above which recomputing beats this fetch. Then K = 2 against K = 1
at nginx, the fetcher against the path before it (aiohttp on one event
loop, each body's digests taken in threads by :mod:`kvstore.verify`: what
``HolderClient.get_blocks`` was), and PUT through the pool against
``HolderClient.put_block`` (aiohttp).

On a machine whose cores the servers share with the client (this kind has
2), a server that needs a core competes with the client's threads: the
figures against nginx say what the client itself can do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..client import HolderClient
from ..cores import available_cores
from ..fetch import BlockFetcher, BlockRequest
from ..holderset import rank
from ..protocol.records import ReplicaRecord
from ..protocol.wire import block_path, repr_digest
from . import Result
from .holder import COMPAT, SCOPE, Servers, _blocks, _port, _wait, nginx_binary

#: KV octets a token of an 8B-class model (Llama 3 8B: 32 layers x 8 KV heads
#: x 128 x 2 (K, V) x 2 octets).
TOKEN_OCTETS = 128 * 1024
#: What one engine should be able to load (the figure for a 32-core host).
TARGET_GBS = 5.0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclasses.dataclass(frozen=True, slots=True)
class Rate:
    gbs: float
    cpu_per_gb: float


def _measure(round_trip: Callable[[], int], seconds: float) -> Rate:
    """GB/s of repeated ``round_trip()`` calls (each returns the octets it
    moved) for about ``seconds``, after one unmeasured call, and this
    process's CPU seconds per GB meanwhile."""
    round_trip()
    cpu, start = _cpu(), time.perf_counter()
    moved = 0
    while time.perf_counter() - start < seconds:
        moved += round_trip()
    elapsed = time.perf_counter() - start
    gb = moved / 1e9
    return Rate(gb / elapsed, (_cpu() - cpu) / gb)


def _fetch_rate(fetcher: BlockFetcher, requests: list[BlockRequest], seconds: float) -> Rate:
    def round_trip() -> int:
        moved = 0
        for done in fetcher.fetch_all(requests):
            if not done.ok:
                raise RuntimeError(f"block {done.request.block_key}: {done.errors}")
            assert done.data is not None
            moved += len(done.data)
        return moved

    return _measure(round_trip, seconds)


def _nginx(servers: Servers, files: dict[str, tuple[bytes, str]]) -> str | None:
    """nginx with mutual TLS serving ``files`` (path under /kvsp/ -> octets,
    Repr-Digest) as static files with their Repr-Digest; None when nginx is
    not installed."""
    binary = nginx_binary()
    if binary is None:
        return None
    port = _port()
    prefix = servers.root / f"nginx-fetch-{port}"
    (prefix / "logs").mkdir(parents=True)
    digests = []
    for path, (data, digest) in files.items():
        file = prefix / "www" / "kvsp" / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data)
        digests.append(f'    "/kvsp/{path}" "{digest}";\n')
    certs = servers.root / "certs"
    (prefix / "nginx.conf").write_text(
        "user root; worker_processes 1; daemon off; pid nginx.pid; error_log logs/error.log;\n"
        "events { worker_connections 256; }\n"
        "http { access_log off; sendfile off; output_buffers 2 1m; keepalive_requests 100000;\n"
        "  map_hash_bucket_size 256;\n"
        '  map $uri $repr_digest {\n    default "";\n' + "".join(digests) + "  }\n"
        f"  server {{ listen 127.0.0.1:{port} ssl;\n"
        f"    ssl_certificate {certs}/server.pem; ssl_certificate_key {certs}/server.key;\n"
        f"    ssl_client_certificate {certs}/ca.pem; ssl_verify_client on;\n"
        "    ssl_protocols TLSv1.3;\n"
        f"    root {prefix}/www;\n"
        "    location /kvsp/ { default_type application/kvsp-block;\n"
        "      add_header Repr-Digest $repr_digest always; } } }\n"
    )
    process = subprocess.Popen(
        [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    servers.processes.append(process)
    try:
        _wait(port, process)
    except RuntimeError as exc:
        log = prefix / "logs" / "error.log"
        raise RuntimeError(
            f"nginx did not start: {log.read_text()[-500:] if log.exists() else ''}"
        ) from exc
    return f"https://127.0.0.1:{port}/kvsp/"


async def _store(
    client: HolderClient, shards: list[str], blocks: list[tuple[str, bytes]]
) -> list[ReplicaRecord]:
    """Each block at the shard its key ranks first; their records."""
    return list(
        await asyncio.gather(
            *(
                client.put_block(rank(shards, key)[0], COMPAT, SCOPE, key, data)
                for key, data in blocks
            )
        )
    )


def run(quick: bool = False, threads: int | None = None) -> list[Result]:
    seconds = 0.5 if quick else 2.0
    cores = threads or available_cores()
    ks = sorted({1, 2, cores})
    blocks = _blocks(8 if quick else 16, 2 << 20)
    size = len(blocks[0][1])
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-fetch-"))
    servers = Servers(root)
    results: list[Result] = []
    try:
        context = servers.client_ssl()
        one = servers.holder("host", True)
        two = servers.holder("host", True, workers=2)
        port = int(two.split(":")[2].split("/")[0])
        shards = {
            "holder, 1 worker": [one],
            "holder, 2 workers": [two, f"https://127.0.0.1:{port + 1}/kvsp/"],
        }

        async def put_all() -> dict[str, list[ReplicaRecord]]:
            client = HolderClient(context)
            try:
                return {name: await _store(client, at, blocks) for name, at in shards.items()}
            finally:
                await client.close()

        records = asyncio.run(put_all())
        files = {block_path(COMPAT, SCOPE, key): (data, repr_digest(data)) for key, data in blocks}
        nginx = _nginx(servers, files)
        if nginx is not None:
            records["nginx"] = [
                dataclasses.replace(r, holder=nginx) for r in records["holder, 1 worker"]
            ]
        verified: dict[tuple[str, int], float] = {}
        # Each block lands in a buffer of its own, reused round after round,
        # as an engine's pinned host buffers are (a new buffer for every
        # block costs its page faults, about a third of the decryption).
        buffers = [bytearray(size) for _ in blocks]
        for server, held in records.items():
            requests = [
                BlockRequest(COMPAT, SCOPE, r.block_key, [r], into=b)
                for r, b in zip(held, buffers, strict=True)
            ]
            for k in ks:
                with BlockFetcher(context, threads=k) as fetcher:
                    checked = _fetch_rate(fetcher, requests, seconds)
                with BlockFetcher(context, threads=k, verify=False) as fetcher:
                    plain = _fetch_rate(fetcher, requests, seconds)
                verified[server, k] = checked.gbs
                results += [
                    Result(
                        f"fetch verified (BL6), {server}, K={k}",
                        "GB/s",
                        checked.gbs,
                        "unverified, same K",
                        plain.gbs,
                        0.8,
                    ),
                    Result(
                        f"client CPU per verified GB, {server}, K={k}",
                        "core-s/GB",
                        checked.cpu_per_gb,
                        goal=2.5,
                        direction="lower",
                    ),
                    Result(
                        f"break-even prefill (128 KiB/token), {server}, K={k}",
                        "tokens/s",
                        checked.gbs * 1e9 / TOKEN_OCTETS,
                    ),
                ]
                if server == "nginx" and k == max(ks):
                    results.append(
                        Result(
                            f"cores for {TARGET_GBS:g} GB/s verified into one engine",
                            "cores",
                            TARGET_GBS * checked.cpu_per_gb,
                            direction="lower",
                        )
                    )
        if nginx is not None and 2 in ks:
            results.append(
                Result(
                    "fetch verified, nginx, K=2",
                    "GB/s",
                    verified["nginx", 2],
                    "K=1",
                    verified["nginx", 1],
                    1.6,
                )
            )
        results += _against_client(
            context, records["holder, 1 worker"], one, blocks, buffers, max(ks), seconds
        )
    finally:
        servers.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


def _against_client(
    context: object,
    held: list[ReplicaRecord],
    holder: str,
    blocks: list[tuple[str, bytes]],
    buffers: list[bytearray],
    k: int,
    seconds: float,
) -> list[Result]:
    """The fetcher at K threads against ``HolderClient`` (aiohttp on one
    event loop) with as many requests in flight, GET and PUT."""
    size = len(blocks[0][1])
    requests = [
        BlockRequest(COMPAT, SCOPE, r.block_key, [r], into=b)
        for r, b in zip(held, buffers, strict=True)
    ]
    keys = [r.block_key for r in held]
    with BlockFetcher(context, threads=k, put_threads=k) as fetcher:  # type: ignore[arg-type]
        ours = _fetch_rate(fetcher, requests, seconds)

        def put_round() -> int:
            futures = [
                fetcher.put(holder, COMPAT, SCOPE, os.urandom(32).hex(), data) for _, data in blocks
            ]
            for future in futures:
                future.result()
            return size * len(blocks)

        ours_put = _measure(put_round, seconds)

    async def theirs() -> tuple[Rate, Rate]:
        client = HolderClient(context)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        try:

            async def get_round() -> int:
                # The path before kvstore.fetch: aiohttp on this loop, each
                # body's two digests in threads (kvstore.verify), 4 in flight.
                gate = asyncio.Semaphore(max(k, 4))

                async def one(record: ReplicaRecord) -> None:
                    async with gate:
                        await client.get_block(
                            holder, COMPAT, SCOPE, record.block_key, record=record
                        )

                await asyncio.gather(*(one(r) for r in held))
                return size * len(keys)

            async def put_round() -> int:
                gate = asyncio.Semaphore(max(k, 4))

                async def one(data: bytes) -> None:
                    async with gate:
                        await client.put_block(holder, COMPAT, SCOPE, os.urandom(32).hex(), data)

                await asyncio.gather(*(one(data) for _, data in blocks))
                return size * len(blocks)

            rates = []
            for work in (get_round, put_round):
                await work()
                cpu, start, moved = _cpu(), loop.time(), 0
                while loop.time() - start < seconds:
                    moved += await work()
                gb = moved / 1e9
                rates.append(Rate(gb / (loop.time() - start), (_cpu() - cpu) / gb))
            return rates[0], rates[1]
        finally:
            await client.close()

    get, put = asyncio.run(theirs())
    return [
        Result(
            f"fetch verified, holder, K={k}",
            "GB/s",
            ours.gbs,
            f"aiohttp + kvstore.verify, {max(k, 4)} in flight",
            get.gbs,
        ),
        Result(
            f"client CPU per verified GB, holder, K={k}",
            "core-s/GB",
            ours.cpu_per_gb,
            "aiohttp + kvstore.verify",
            get.cpu_per_gb,
            direction="lower",
        ),
        Result(
            f"PUT through the pool, holder, K={k}",
            "GB/s",
            ours_put.gbs,
            f"HolderClient.put_block, {max(k, 4)} at once",
            put.gbs,
        ),
    ]
