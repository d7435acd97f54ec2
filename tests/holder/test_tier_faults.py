"""Redis killed and restarted under a serving holder (issue 9): the
remote-memory tier degrades, blocks in the other tiers are served (no 5xx),
PUTs go elsewhere, a block only Redis held answers 503 while it is away and
404 once it is back empty, and the tier is used again."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.backends.redis import RedisTier
from kvstore.holder import HolderSettings, create_app
from kvstore.storage import StoreSettings, TieredStore

from ..conftest import RedisServer
from ..storage.helpers import COMPAT, SCOPE, Clock, block, ref, size_of, stored_size
from .conftest import HOLDER, POLICY, AsPrincipal, pem

HEADERS = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}


def url(n: int) -> str:
    return f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}"


async def test_redis_down_and_back_under_http(
    own_redis: RedisServer, tmp_path: Path, certs: Path
) -> None:
    redis = RedisTier(url=own_redis.url, prefix="fault:", timeout_s=1.0)
    clock = Clock()  # the tier's retry time passes when the test says
    store = TieredStore(
        [
            (HostTier(), 2 * size_of()),
            (redis, 2 * stored_size()),
            (LmdbTier(str(tmp_path / "lmdb")), 20 * size_of()),
        ],
        StoreSettings(promote=False, retry_after_s=0.2, demote_above=0),
        clock=clock,
    )
    app = create_app(HolderSettings(HOLDER), store, POLICY)
    transport = httpx.ASGITransport(AsPrincipal(app, pem(certs, "alice")))
    bodies = {n: block() for n in range(8)}
    async with httpx.AsyncClient(transport=transport, base_url=HOLDER) as alice:
        for n in range(5):  # 0 lands in LMDB, 1-2 in Redis, 3-4 in host memory
            assert (await alice.put(url(n), content=bodies[n], headers=HEADERS)).status_code == 201
        where = {n: store.residency(ref(n))[0].tier for n in range(5)}
        assert where == {
            0: "local-storage",
            1: "remote-memory",
            2: "remote-memory",
            3: "host",
            4: "host",
        }, where
        own_redis.kill()
        for n in (0, 3, 4):  # held in the other tiers: served, no 5xx
            got = await alice.get(url(n))
            assert got.status_code == 200 and got.content == bodies[n]
        away = await alice.get(url(1))
        assert away.status_code == 503 and away.headers["content-type"].startswith(
            "application/problem+json"
        )
        assert store.snapshot().tiers[1].degraded
        # Writes go on: what host memory pushes down skips Redis for LMDB.
        for n in (5, 6):
            assert (await alice.put(url(n), content=bodies[n], headers=HEADERS)).status_code == 201
        assert store.residency(ref(3))[0].tier == "local-storage"
        own_redis.start()  # back, and empty
        if store.snapshot().tiers[1].degraded:  # within its retry time: not asked (a 503)
            assert (await alice.get(url(1))).status_code == 503
        clock.advance(0.3)  # past retry_after_s: asked again
        gone = await alice.get(url(1))
        assert gone.status_code == 404  # a miss: the client recomputes or goes elsewhere
        assert (await alice.put(url(7), content=bodies[7], headers=HEADERS)).status_code == 201
        assert "remote-memory" in {store.residency(ref(n))[0].tier for n in (4, 5, 6)}
        for n in (0, 3, 4, 5, 6, 7):
            assert (await alice.get(url(n))).content == bodies[n]
    await store.close()
