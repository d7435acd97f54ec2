"""``kvstore bench holder``: a real holder process against a bare uvicorn baseline.

Both servers run as separate processes on loopback with the same TLS
settings; the client is aiohttp (kvstore.client's data path), which is not
the bottleneck at these rates on this kind of machine (httpx would be).
Bodies are 2 MiB blocks of 32 layers. Rows:

* GET whole block / layer range, host and LMDB tiers, 1, 4 and 16 concurrent
  clients, plain HTTP and mutual TLS: holder GB/s against bare uvicorn;
* PUT: holder GB/s against bare uvicorn reading the body and dropping it,
  and keeping it (as the host tier does), and against one SHA-256 pass over
  the same bodies (the holder must digest every layer once);
* verified fetch (Repr-Digest + layer digests, BL6): against 2 x SHA-256,
  and against the same fetch unverified (what verification costs in wall
  time at one client), one block at a time and four at once
  (``HolderClient.get_blocks``);
* workers (``[server] workers``, docs/workers.md): aggregate GET over mTLS
  at 16 clients of a holder run as 2 workers against the same holder as 1
  worker, both driven by the same load generator in a process of its own
  (:mod:`.loadgen`); the blocks are spread evenly over the workers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..protocol import container as kc
from . import Result

COMPAT = hashlib.sha256(b"bench-holder").hexdigest()
SCOPE = "b" * 32
LAYERS = 32


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ports(count: int) -> int:
    """A free port whose next ``count - 1`` are free too (a holder's workers)."""
    for _ in range(50):
        first, held = _port(), []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports")


def nginx_binary() -> str | None:
    """nginx's path, where installed (Debian's is in /usr/sbin, off a user's PATH)."""
    import shutil

    debian = Path("/usr/sbin/nginx")
    return shutil.which("nginx") or (str(debian) if debian.exists() else None)


def _wait(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("server exited during start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start")


class Servers:
    """Certificates, a holder and a bare baseline, per (tier, tls) combination."""

    def __init__(self, root: Path) -> None:
        from ..security import create_dev_certificates

        self.root = root
        create_dev_certificates(root / "certs", ["bench"])
        (root / "policy.json").write_text(
            json.dumps(
                {
                    "principals": {
                        "urn:kvstore:bench": {"read_scopes": ["*"], "write_scopes": ["*"]},
                        "anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]},
                    }
                }
            )
        )
        self.processes: list[subprocess.Popen[bytes]] = []

    def client_ssl(self) -> ssl.SSLContext:
        from ..tls import client_context

        certs = self.root / "certs"
        return client_context(
            str(certs / "ca.pem"), str(certs / "client-bench.pem"), str(certs / "client-bench.key")
        )

    def holder(
        self,
        tier: str,
        tls: bool,
        http2: bool = False,
        workers: int = 1,
        unix_socket: Path | None = None,
        prefault: bool = True,
    ) -> str:
        """A holder process (its first worker's base URI); with ``unix_socket``
        also there, for a trusted proxy (docs/proxy.md). A host tier of 1 GiB
        is ``prefault``-ed (kvstore/backends/host.py), as a dedicated cache server's
        should be: a PUT then measures the server, not the kernel's first
        touch of fresh pages. (An older holder, without the option, needs
        ``prefault=False``.)"""
        port = _ports(workers)
        scheme = "https" if tls else "http"
        files = 'certfile = "certs/server.pem"\nkeyfile = "certs/server.key"\n'
        server = (
            (files + 'cafile = "certs/ca.pem"\n' if tls else "insecure_http = true\n")
            + ("http2 = true\n" if http2 else "")
            + (f'unix_socket = "{unix_socket}"\ntrusted_proxy = "unix"\n' if unix_socket else "")
        )
        tier_cfg = (
            'backend = "host"\ncapacity = 1073741824\n' + ("prefault = true\n" if prefault else "")
            if tier == "host"
            else f'backend = "lmdb"\ncapacity = 4294967296\npath = "lmdb-{port}"\n'
            "map_size = 5368709120\nsync = false\n"
        )
        config = self.root / f"holder-{port}.toml"
        config.write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {port}\n'
            + (f"workers = {workers}\n" if workers > 1 else "")
            + f"{server}\n"
            f'[holder]\nuri = "{scheme}://127.0.0.1:{port}/kvsp/"\npolicy = "policy.json"\n'
            f"max_block_octets = 16777216\n\n[storage]\npromote = false\n\n"
            f"[[storage.tiers]]\n{tier_cfg}"
        )
        log = self.root / f"holder-{port}.log"
        with log.open("wb") as out:  # the process keeps its own descriptor
            process = subprocess.Popen(
                [sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        try:
            for worker in range(workers):
                _wait(port + worker, process)
        except RuntimeError as exc:  # what it said, not only that it did not start
            said = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{exc}; its output:\n{said}") from None
        return f"{scheme}://127.0.0.1:{port}/kvsp/"

    def load(
        self, urls: list[str], clients: int, seconds: float, tls: bool = True
    ) -> tuple[float, float]:
        """GB/s of GETs of ``urls`` by the load generator, a process of its
        own, and the cores it kept busy itself meanwhile."""
        certs = self.root / "certs"
        command = [
            sys.executable,
            "-m",
            "kvstore.bench.loadgen",
            *urls,
            "--clients",
            str(clients),
            "--seconds",
            str(seconds),
        ]
        if tls:
            command += [
                "--cafile",
                str(certs / "ca.pem"),
                "--certfile",
                str(certs / "client-bench.pem"),
                "--keyfile",
                str(certs / "client-bench.key"),
            ]
        out = subprocess.run(command, capture_output=True, check=True, timeout=seconds + 60)
        figures = json.loads(out.stdout.decode().strip().splitlines()[-1])
        if figures["errors"] or not figures["requests"]:
            raise RuntimeError(f"load generator: {figures}")
        elapsed = float(figures["seconds"])
        return float(figures["octets"]) / elapsed / 1e9, float(figures["cpu_seconds"]) / elapsed

    def bare(self, octets: int, tls: bool, store: bool = False) -> str:
        """Bare uvicorn (:mod:`.bare`); ``store``: it keeps what is PUT."""
        port = _port()
        command = [
            sys.executable,
            "-m",
            "kvstore.bench.bare",
            "--port",
            str(port),
            "--octets",
            str(octets),
            *(["--store"] if store else []),
        ]
        if tls:
            command += ["--tls-dir", str(self.root / "certs")]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.processes.append(process)
        _wait(port, process)
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}/kvsp/"

    def nginx(self, octets: int, tls: bool, upstream: Path | None = None) -> str | None:
        """nginx serving the same octets as a static file (None when not
        installed); with ``upstream``, proxying to that unix socket instead,
        the client certificate passed on as docs/proxy.md configures it."""
        binary = nginx_binary()
        if binary is None:
            return None
        port = _port()
        prefix = self.root / f"nginx-{port}"
        (prefix / "logs").mkdir(parents=True)
        (prefix / "www" / "kvsp").mkdir(parents=True)
        (prefix / "www" / "kvsp" / "block").write_bytes(bytes(octets))
        certs = self.root / "certs"
        ssl_lines = (
            f"ssl_certificate {certs}/server.pem; ssl_certificate_key {certs}/server.key;"
            f" ssl_client_certificate {certs}/ca.pem; ssl_verify_client on;"
            " ssl_protocols TLSv1.3;"
            if tls
            else ""
        )
        (prefix / "nginx.conf").write_text(
            "user root; worker_processes 1; daemon off; pid nginx.pid; error_log logs/error.log;\n"
            "events { worker_connections 256; }\n"
            "http { access_log off; sendfile on; keepalive_requests 100000;\n"
            f"  server {{ listen 127.0.0.1:{port}{' ssl' if tls else ''}; {ssl_lines}\n"
            f"    root {prefix}/www;\n"
            + (
                "    location /kvsp/ { default_type application/kvsp-block; } } }\n"
                if upstream is None
                else "    location /kvsp/ { proxy_pass http://kvstore; proxy_http_version 1.1;\n"
                '      proxy_set_header Connection ""; proxy_buffering on;\n'
                "      proxy_buffer_size 1m; proxy_buffers 8 1m; proxy_busy_buffers_size 2m;\n"
                "      proxy_set_header X-Client-Cert $ssl_client_escaped_cert;\n"
                '      proxy_set_header X-Forwarded-Client-Cert "";\n'
                "      proxy_request_buffering off; client_max_body_size 64m; } }\n"
                f"  upstream kvstore {{ server unix:{upstream}; keepalive 32; }} }}\n"
            )
        )
        process = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        try:
            _wait(port, process)
        except RuntimeError:
            return None
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}/kvsp/"

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _blocks(count: int, octets: int) -> list[tuple[str, bytes]]:
    section = octets // (2 * LAYERS)
    out = []
    for _ in range(count):
        secs = [(os.urandom(section), os.urandom(section)) for _ in range(LAYERS)]
        out.append((os.urandom(32).hex(), bytes(kc.encode(secs, token_count=16))))
    return out


async def _rate(
    total_octets: int, work: Callable[[int], Awaitable[None]], concurrency: int, seconds: float
) -> float:
    """GB/s of ``work(i)`` calls (each moving total_octets / calls) for about ``seconds``."""
    done = 0
    moved = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        nonlocal done, moved
        while time.perf_counter() < deadline:
            i = done
            done += 1
            await work(i)
            moved += total_octets

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return moved / (time.perf_counter() - start) / 1e9


async def _run(quick: bool) -> list[Result]:
    import aiohttp

    octets = 2 << 20
    seconds = 0.5 if quick else 2.0
    # Clients at once: 1, 4 and 16 (quick: 1 and 16).
    levels = (1, 16) if quick else (1, 4, 16)
    blocks = _blocks(4 if quick else 8, octets)
    results: list[Result] = []
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-holder-"))
    servers = Servers(root)
    try:
        combos = (
            [("host", False), ("host", True)]
            if quick
            else [("host", False), ("host", True), ("lmdb", True)]
        )
        bare = {tls: servers.bare(len(blocks[0][1]), tls) for tls in (False, True)}
        half = len(blocks[0][1]) // 2
        bare_half = {tls: servers.bare(half, tls) for tls in (False, True)}
        nginx = {tls: servers.nginx(len(blocks[0][1]), tls) for tls in (False, True)}
        for tier, tls in combos:
            context: Any = servers.client_ssl() if tls else False
            holder = servers.holder(tier, tls)
            connector = aiohttp.TCPConnector(ssl=context, limit=64)
            async with aiohttp.ClientSession(connector=connector) as session:
                records = []
                for key, data in blocks:
                    async with session.put(
                        f"{holder}blocks/{COMPAT}/{SCOPE}/{key}",
                        data=data,
                        headers={"If-None-Match": "*"},
                    ) as response:
                        assert response.status == 201, await response.text()
                        records.append(await response.json())

                def getter(base: str, params: dict[str, str] | None = None) -> Any:
                    async def get(i: int) -> None:
                        key = blocks[i % len(blocks)][0]
                        async with session.get(
                            f"{base}blocks/{COMPAT}/{SCOPE}/{key}", params=params
                        ) as response:
                            await response.read()

                    return get

                label = f"{tier}, {'mTLS' if tls else 'plain'}"
                for clients in levels:
                    ours = await _rate(len(blocks[0][1]), getter(holder), clients, seconds)
                    base = await _rate(len(blocks[0][1]), getter(bare[tls]), clients, seconds)
                    results.append(
                        Result(
                            f"GET whole, {label}, c={clients}",
                            "GB/s",
                            ours,
                            "bare uvicorn GET",
                            base,
                            0.7,
                        )
                    )
                    static_base = nginx[tls]
                    if tier == "host" and static_base is not None:
                        static = await _rate(
                            len(blocks[0][1]),
                            _static_getter(session, static_base),
                            clients,
                            seconds,
                        )
                        # Issue 19: over mTLS within 0.8 of nginx's mTLS.
                        results.append(
                            Result(
                                f"GET whole, {label}, c={clients}",
                                "GB/s",
                                ours,
                                "nginx static file",
                                static,
                                0.8 if tls else None,
                            )
                        )
                ours = await _rate(half, getter(holder, {"layers": "0-15"}), 1, seconds)
                base = await _rate(half, getter(bare_half[tls]), 1, seconds)
                results.append(
                    Result(
                        f"GET layers 0-15, {label}, c=1",
                        "GB/s",
                        ours,
                        "bare uvicorn GET, same size",
                        base,
                        0.5,
                    )
                )
                if tier == "host":
                    keeping = servers.bare(0, tls, store=True)
                    results += await _put_and_verify(
                        session, holder, bare[tls], context, records, seconds, label, keeping
                    )
        results += await _http2_cost(servers, blocks, seconds)
        if (nginx_mtls := nginx[True]) is not None:
            results += await _behind_nginx(servers, blocks, seconds, nginx_mtls, levels)
        results += await _workers_scaling(servers, blocks, seconds, levels)
    finally:
        servers.close()
    return results


async def _http2_cost(
    servers: Servers, blocks: list[tuple[str, bytes]], seconds: float
) -> list[Result]:
    """H1's SHOULD: HTTP/2 against HTTP/1.1 on the same holder, one client library (httpx)."""
    import httpx

    holder = servers.holder("host", True, http2=True)
    context = servers.client_ssl()
    size = len(blocks[0][1])
    rates = {}
    for http2 in (False, True):
        async with httpx.AsyncClient(verify=context, http2=http2, timeout=30) as client:
            for key, data in blocks:
                await client.put(
                    f"{holder}blocks/{COMPAT}/{SCOPE}/{key}",
                    content=data,
                    headers={"If-None-Match": "*"},
                )

            async def get(i: int, client: Any = client) -> None:
                key = blocks[i % len(blocks)][0]
                response = await client.get(f"{holder}blocks/{COMPAT}/{SCOPE}/{key}")
                assert response.status_code == 200

            rates[http2] = await _rate(size, get, 1, seconds)
    return [
        Result(
            "GET whole, host, mTLS, HTTP/2 (httpx)",
            "GB/s",
            rates[True],
            "same holder, HTTP/1.1 (httpx)",
            rates[False],
            None,
        )
    ]


async def _behind_nginx(
    servers: Servers,
    blocks: list[tuple[str, bytes]],
    seconds: float,
    static: str,
    levels: tuple[int, ...],
) -> list[Result]:
    """The holder behind nginx doing the mutual TLS, on a unix socket
    (docs/proxy.md), against nginx serving the same octets itself."""
    import aiohttp

    sock = servers.root / f"kvstore-{os.getpid()}.sock"
    servers.holder("host", True, unix_socket=sock)
    proxied = servers.nginx(len(blocks[0][1]), True, upstream=sock)
    if proxied is None:
        return []
    results = []
    connector = aiohttp.TCPConnector(ssl=servers.client_ssl(), limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        for key, data in blocks:
            url = f"{proxied}blocks/{COMPAT}/{SCOPE}/{key}"
            async with session.put(url, data=data, headers={"If-None-Match": "*"}) as response:
                assert response.status == 201, await response.text()

        async def get(i: int) -> None:
            url = f"{proxied}blocks/{COMPAT}/{SCOPE}/{blocks[i % len(blocks)][0]}"
            async with session.get(url) as response:
                assert response.status == 200
                await response.read()

        for clients in levels:
            ours = await _rate(len(blocks[0][1]), get, clients, seconds)
            direct = await _rate(
                len(blocks[0][1]), _static_getter(session, static), clients, seconds
            )
            results.append(
                Result(
                    f"GET whole, behind nginx (mTLS there), c={clients}",
                    "GB/s",
                    ours,
                    "nginx static file, mTLS",
                    direct,
                    0.8,
                )
            )
    return results


async def _workers_scaling(
    servers: Servers,
    blocks: list[tuple[str, bytes]],
    seconds: float,
    levels: tuple[int, ...] = (1, 4, 16),
) -> list[Result]:
    """Issue 19's goal: 2 workers >= 1.6 x 1 worker, aggregate GET over mTLS
    at 16 clients (the other levels are shown, without a goal)."""
    from ..client import HolderClient
    from ..holderset import rank
    from ..workers import worker_uri

    rates: dict[tuple[int, int], float] = {}
    busy: dict[tuple[int, int], float] = {}
    for workers in (1, 2):
        first = servers.holder("host", True, workers=workers)
        uris = [worker_uri(first, i) for i in range(workers)]
        urls = []
        async with HolderClient(servers.client_ssl()) as client:
            for i, (_, data) in enumerate(blocks):
                # Keys chosen so that each worker holds the same share.
                key = os.urandom(32).hex()
                while rank(uris, key)[0] != uris[i % workers]:
                    key = os.urandom(32).hex()
                await client.put_block(uris[i % workers], COMPAT, SCOPE, key, data)
                urls.append(f"{uris[i % workers]}blocks/{COMPAT}/{SCOPE}/{key}")
        for clients in levels:
            rates[workers, clients], busy[workers, clients] = await asyncio.to_thread(
                servers.load, urls, clients, seconds
            )
    from ..cores import available_cores

    # The load generator's own share of the machine: where it takes one of
    # two cores, two workers share the other (docs/workers.md).
    out = []
    for clients in levels:
        out += [
            Result(
                f"GET whole, host, mTLS, c={clients}, 2 workers (load generator apart)",
                "GB/s",
                rates[2, clients],
                "1 worker, same load generator",
                rates[1, clients],
                1.6 if clients == 16 else None,
            ),
            Result(
                f"load generator's own CPU, 1 worker, c={clients} "
                f"(machine: {available_cores()} cores)",
                "cores",
                busy[1, clients],
            ),
        ]
    return out


def _static_getter(session: Any, base: str) -> Callable[[int], Awaitable[None]]:
    async def get(i: int) -> None:
        async with session.get(f"{base}block") as response:
            assert response.status == 200
            await response.read()

    return get


async def _put_and_verify(
    session: Any,
    holder: str,
    bare: str,
    context: Any,
    records: list[dict[str, Any]],
    seconds: float,
    label: str,
    keeping: str,
) -> list[Result]:
    from ..client import HolderClient
    from ..protocol.records import ReplicaRecord

    fresh = _blocks(4, 2 << 20)
    size = len(fresh[0][1])

    def putter(base: str) -> Callable[[int], Awaitable[None]]:
        async def put(i: int) -> None:
            url = f"{base}blocks/{COMPAT}/{SCOPE}/{os.urandom(32).hex()}"
            data = fresh[i % len(fresh)][1]
            async with session.put(url, data=data, headers={"If-None-Match": "*"}) as response:
                assert response.status == 201

        return put

    ours = await _rate(size, putter(holder), 1, seconds)
    base = await _rate(size, putter(bare), 1, seconds)
    # The same, keeping each body in memory as the host tier does: new
    # memory for every block (its page faults cost about as much as a
    # SHA-256 pass here), which the discarding baseline never pays.
    kept = await _rate(size, putter(keeping), 1, seconds)
    start = time.perf_counter()
    for _, data in fresh * 4:
        hashlib.sha256(data).digest()
    sha = len(fresh) * 4 * size / (time.perf_counter() - start) / 1e9
    parsed = [ReplicaRecord.from_json(r) for r in records]
    client = HolderClient(context)

    async def verified(i: int) -> None:
        record = parsed[i % len(parsed)]
        await client.get_block(holder, COMPAT, SCOPE, record.block_key, record=record)

    async def unverified(i: int) -> None:
        # The same GET through the same kind of pooled aiohttp session, with
        # the body read and nothing hashed: what verification costs on top.
        record = parsed[i % len(parsed)]
        url = f"{holder}blocks/{COMPAT}/{SCOPE}/{record.block_key}"
        async with session.get(url) as response:
            assert response.status == 200
            await response.read()

    fetched = await _rate(size, verified, 1, seconds)
    plain = await _rate(size, unverified, 1, seconds)

    async def verified_4(i: int) -> None:
        # One caller, four blocks at once (HolderClient.get_blocks).
        batch = [parsed[(i * 4 + j) % len(parsed)] for j in range(4)]
        await client.get_blocks(
            holder, COMPAT, SCOPE, [r.block_key for r in batch], records=batch, concurrency=4
        )

    async def unverified_4(i: int) -> None:
        await asyncio.gather(*(unverified(i * 4 + j) for j in range(4)))

    fetched_4 = await _rate(4 * size, verified_4, 1, seconds)
    plain_4 = await _rate(4 * size, unverified_4, 1, seconds)
    await client.close()
    return [
        Result(f"PUT, {label}, c=1", "GB/s", ours, "bare uvicorn PUT", base, 0.8),
        Result(f"PUT, {label}, c=1", "GB/s", ours, "bare uvicorn PUT keeping the body", kept, 0.8),
        Result(f"PUT, {label}, c=1", "GB/s", ours, "one sha256 pass", sha, 0.8),
        Result(
            f"verified fetch (BL6), {label}, c=1", "GB/s", fetched, "2 x sha256 time", sha / 2, 0.8
        ),
        Result(
            f"verified fetch (BL6), {label}, c=1",
            "GB/s",
            fetched,
            "unverified fetch, same client",
            plain,
            0.8,
        ),
        Result(
            f"verified fetch (BL6), {label}, 4 blocks at once",
            "GB/s",
            fetched_4,
            "unverified, 4 at once, same client",
            plain_4,
            0.8,
        ),
    ]


def run(quick: bool = False) -> list[Result]:
    return asyncio.run(_run(quick))
