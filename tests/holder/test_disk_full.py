"""Disk full on the LMDB path (issue 9): PUTs beyond the map fail with a clear
problem (507), and everything already stored goes on being served."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvstore.backends.lmdb import LmdbTier
from kvstore.holder import HolderSettings, create_app
from kvstore.storage import LeaseLimits, TieredStore

from ..storage.helpers import COMPAT, SCOPE, block, ref
from .conftest import HOLDER, POLICY, AsPrincipal, pem


async def test_a_full_lmdb_refuses_puts_and_serves_the_rest(tmp_path: Path, certs: Path) -> None:
    # A map far smaller than the configured capacity: the disk is "full"
    # long before the store thinks the tier is.
    tier = LmdbTier(str(tmp_path / "lmdb"), map_size=256 << 10)
    store = TieredStore([(tier, 64 << 20)], lease_limits=LeaseLimits())
    app = create_app(HolderSettings(HOLDER, max_block_octets=1 << 20), store, POLICY)
    transport = httpx.ASGITransport(AsPrincipal(app, pem(certs, "alice")))
    stored: dict[int, bytes] = {}
    async with httpx.AsyncClient(transport=transport, base_url=HOLDER) as alice:
        headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
        refused = None
        for n in range(200):
            body = block(section=2048)
            url = f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}"
            answer = await alice.put(url, content=body, headers=headers)
            if answer.status_code == 201:
                stored[n] = body
                continue
            refused = answer
            break
        assert refused is not None and stored, "the map never filled"
        assert refused.status_code == 507, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        problem = refused.json()
        assert problem["status"] == 507 and problem["title"] in (
            "Insufficient storage",
            "Storage tier full",
        )
        assert problem.get("detail")  # says what filled up
        # Nothing else broke: every acknowledged block is served, intact; a
        # lease works; the refused block is not half there.
        for n, body in stored.items():
            got = await alice.get(f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}")
            assert got.status_code == 200 and got.content == body
        missing = await alice.get(f"blocks/{COMPAT}/{SCOPE}/{ref(len(stored)).block_key}")
        assert missing.status_code == 404
        lease = await alice.post("leases", json={"block_keys": [ref(0).block_key], "ttl_ms": 1000})
        assert lease.status_code == 201
    await store.close()
