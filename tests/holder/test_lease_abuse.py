"""Lease abuse (issue 9, LE3, SEC3): a client leasing beyond its octet or TTL
quota, or creating leases in a loop, is refused (429 kvsp-lease-quota), and
cannot make the holder refuse other clients' PUTs or leases."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvstore.backends.host import HostTier
from kvstore.holder import HolderSettings, create_app
from kvstore.security import Policy, create_dev_certificates
from kvstore.storage import LeaseLimits, TieredStore

from ..storage.helpers import COMPAT, SCOPE, block, ref, size_of
from .conftest import HOLDER, AsPrincipal

HEADERS = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}


async def test_a_lease_hog_is_refused_and_others_go_on(tmp_path: Path) -> None:
    create_dev_certificates(tmp_path, ["alice", "mallory"])
    policy = Policy.from_json(
        {
            "principals": {
                p: {"read_scopes": [SCOPE], "write_scopes": [SCOPE]}
                for p in ("urn:kvstore:alice", "urn:kvstore:mallory")
            }
        }
    )
    # Room for 12 blocks; each client may pin 3 blocks' worth for 2 s at most.
    limits = LeaseLimits(
        max_octets_per_client=3 * size_of(), max_ttl_ms=2000, max_leases_per_client=20
    )
    store = TieredStore([(HostTier(), 12 * size_of())], lease_limits=limits)
    app = create_app(HolderSettings(HOLDER), store, policy)

    def as_(name: str) -> httpx.AsyncClient:
        cert = (tmp_path / f"client-{name}.pem").read_text()
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(AsPrincipal(app, cert)), base_url=HOLDER
        )

    async with as_("alice") as alice, as_("mallory") as mallory:
        for n in range(12):
            put = await alice.put(
                f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}", content=block(), headers=HEADERS
            )
            assert put.status_code == 201
        too_long = await mallory.post(
            "leases", json={"block_keys": [ref(0).block_key], "ttl_ms": 60_000}
        )
        assert too_long.status_code == 429  # longer than the quota's TTL
        assert too_long.json()["max_ttl_ms"] == 2000
        refused = 0
        for n in range(12):  # a loop of leases over every block
            got = await mallory.post(
                "leases", json={"block_keys": [ref(n).block_key], "ttl_ms": 2000}
            )
            if got.status_code == 429:
                assert got.json()["type"].endswith("#kvsp-lease-quota")
                refused += 1
            else:
                assert got.status_code == 201
        assert refused >= 8  # at most 3 blocks' worth pinned (one lease may be above)
        pinned = sum(1 for n in range(12) if store.leases.is_leased(ref(n)))
        assert pinned <= 4
        # Alice's PUTs still land (unpinned blocks make room), and her own
        # lease quota is untouched by mallory's.
        for n in range(12, 20):
            put = await alice.put(
                f"blocks/{COMPAT}/{SCOPE}/{ref(n).block_key}", content=block(), headers=HEADERS
            )
            assert put.status_code == 201, put.text
        mine = await alice.post("leases", json={"block_keys": [ref(19).block_key], "ttl_ms": 2000})
        assert mine.status_code == 201
