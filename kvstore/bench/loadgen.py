"""A load generator in a process of its own (``python -m kvstore.bench.loadgen``).

``kvstore bench holder`` measures a holder's aggregate GET rate with it, so
that the client's TLS and HTTP work does not share a process (and a GIL)
with the bench, and both servers compared face the same client. It GETs
the given URLs round robin from ``--clients`` concurrent tasks over one
pooled aiohttp session for ``--seconds`` and prints one JSON line:
``{"octets", "seconds", "requests", "errors", "cpu_seconds"}`` (its own CPU
time while timed: on a machine of few cores, how much of them the client
itself takes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
from collections.abc import Sequence


async def _run(
    urls: Sequence[str], clients: int, seconds: float, context: ssl.SSLContext | bool
) -> dict[str, float]:
    import aiohttp

    octets = requests = errors = 0
    connector = aiohttp.TCPConnector(ssl=context, limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        # One round first: connections open and TLS handshakes are not timed.
        for url in urls[:clients]:
            async with http.get(url) as response:
                await response.read()
        start = time.perf_counter()
        deadline = start + seconds
        turn = 0

        async def client() -> None:
            nonlocal octets, requests, errors, turn
            while time.perf_counter() < deadline:
                url = urls[turn % len(urls)]
                turn += 1
                async with http.get(url) as response:
                    body = await response.read()
                    if response.status != 200:
                        errors += 1
                        continue
                octets += len(body)
                requests += 1

        cpu = time.process_time()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return {
        "octets": octets,
        "seconds": elapsed,
        "requests": requests,
        "errors": errors,
        "cpu_seconds": cpu,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--cafile")
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args(argv)
    context: ssl.SSLContext | bool = False
    if args.cafile:
        from ..tls import client_context

        context = client_context(args.cafile, args.certfile, args.keyfile)
    result = asyncio.run(_run(args.urls, args.clients, args.seconds, context))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
