"""An S3 endpoint that errors or hangs (issue 9), through a fault-injecting
proxy on loopback in front of moto's server: the remote-storage tier
degrades, blocks in the other tiers are served, writes go elsewhere, reads
of what only S3 held fail fast as TierUnavailable (503 at a holder) rather
than hang, and the tier is used again once the endpoint is back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvstore.backends.host import HostTier
from kvstore.backends.s3 import S3Tier
from kvstore.storage import StoreSettings, TieredStore
from kvstore.storage.errors import TierUnavailable

from ..conftest import S3_CREDENTIALS, free_port
from .helpers import Clock, block, ref, size_of


class FaultProxy:
    """Forwards to ``target``; ``mode`` = "pass", "error" (503s) or "hang"."""

    def __init__(self, target: str) -> None:
        self.target, self.mode = target, "pass"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "error":
            return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
        if self.mode == "hang":
            await asyncio.sleep(5)
        assert self._client is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with self._client.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as upstream:
            payload = await upstream.read()
            drop = {"transfer-encoding", "content-length", "content-encoding", "connection"}
            return web.Response(
                status=upstream.status,
                body=payload,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in drop},
            )

    async def start(self) -> None:
        self._client = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()


@pytest.fixture
async def proxy(s3_endpoint: str) -> AsyncIterator[FaultProxy]:
    found = FaultProxy(s3_endpoint)
    await found.start()
    yield found
    await found.stop()


@pytest.mark.parametrize("fault", ["error", "hang"])
async def test_s3_errors_and_timeouts_degrade_and_recover(
    proxy: FaultProxy, s3_bucket: str, fault: str
) -> None:
    s3 = S3Tier(s3_bucket, endpoint_url=proxy.url, timeout_s=1.0, **S3_CREDENTIALS)
    clock = Clock()  # the tier's retry time passes when the test says
    store = TieredStore(
        [(HostTier(), 2 * size_of()), (s3, 20 * size_of())],
        StoreSettings(promote=False, retry_after_s=0.5, demote_above=0),
        clock=clock,
    )
    bodies = {n: block() for n in range(8)}
    for n in range(4):  # 0-1 pushed down to S3, 2-3 in host memory
        await store.put(ref(n), bodies[n])
    assert store.residency(ref(0))[0].tier == "remote-storage"
    proxy.mode = fault
    with pytest.raises(TierUnavailable):
        # Bounded by the tier's own deadline (timeout_s), never a hang: the
        # real HTTP peer is what is timed out here.
        await asyncio.wait_for(store.get(ref(0)), 30)
    assert store.snapshot().tiers[1].degraded
    for n in (2, 3):  # the other tier serves
        assert await store.get(ref(n)) == bodies[n]
    # Writes go on while S3 is away: what host memory must let go is not
    # written to the degraded tier (it is evicted, counted, withdrawn).
    await store.put(ref(4), bodies[4])
    assert await store.get(ref(4)) == bodies[4]
    assert store.stats.evictions == 1  # the one host memory let go
    assert ref(0) in store  # an unreachable tier is not data loss
    proxy.mode = "pass"
    clock.advance(0.6)  # past retry_after_s
    assert await store.get(ref(0)) == bodies[0]
    await store.put(ref(5), bodies[5])  # demotes into S3 again
    held = [n for n in (2, 3, 4, 5) if ref(n) in store]
    assert "remote-storage" in {store.residency(ref(n))[0].tier for n in held}
    for n in held:
        assert await store.get(ref(n)) == bodies[n]
    await store.close()


async def test_a_holder_over_a_failing_s3_answers_503_only_for_what_s3_alone_held(
    proxy: FaultProxy, s3_bucket: str
) -> None:
    # The same faults seen from a client of the holder: a block only S3 held
    # is a 503 problem with Retry-After (a miss the client can retry or
    # skip, never a hang or a 500); blocks in host memory are served; PUTs go on.
    import httpx

    from kvstore.holder import HolderSettings, create_app
    from kvstore.security import Policy

    from .helpers import COMPAT, SCOPE

    open_policy = Policy.from_json(
        {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
    )
    s3 = S3Tier(s3_bucket, endpoint_url=proxy.url, timeout_s=1.0, **S3_CREDENTIALS)
    clock = Clock()  # the tier's retry time passes when the test says
    store = TieredStore(
        [(HostTier(), 2 * size_of()), (s3, 20 * size_of())],
        StoreSettings(promote=False, retry_after_s=0.5, demote_above=0),
        clock=clock,
    )
    uri = "https://h.test/kvsp/"
    app = create_app(HolderSettings(uri, allow_anonymous=True), store, open_policy)
    bodies = {n: block() for n in range(5)}
    headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=uri) as client:
        for n in range(4):
            put = await client.put(
                f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}", content=bodies[n], headers=headers
            )
            assert put.status_code == 201
        proxy.mode = "error"
        # GETs try S3 (and fail fast); the HEAD, within the tier's retry
        # window, answers from the tier's failure without trying it.
        for method in ("GET", "GET", "HEAD"):
            got = await client.request(method, f"blocks/{COMPAT}/{SCOPE}/{ref(0).block_key}")
            assert got.status_code == 503, got.text
            assert got.headers["content-type"].startswith("application/problem+json")
            assert int(got.headers["retry-after"]) >= 1
        for n in (2, 3):
            got = await client.get(f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}")
            assert got.status_code == 200 and got.content == bodies[n]
        put = await client.put(
            f"blocks/{COMPAT}/{SCOPE}/{ref(4).block_key}", content=bodies[4], headers=headers
        )
        assert put.status_code == 201
        proxy.mode = "pass"
        clock.advance(0.6)  # past retry_after_s
        got = await client.get(f"blocks/{COMPAT}/{SCOPE}/{ref(0).block_key}")
        assert got.status_code == 200 and got.content == bodies[0]
    await store.close()
