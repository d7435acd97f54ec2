"""Placement with instance residency (issue 38): ``POST place`` prefers the
engine that still holds the prompt's prefix in its own memory while its
queue allows, and the idle cold one when the warm one's queue is long; a
bridged engine gets no prefetch directive; the Index Service answering is
the real one (in-process), told by the warm engine's own certificate."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.client import InstanceClient
from kvstore.controller.app import create_app
from kvstore.controller.placement import rank
from kvstore.controller.state import MemoryControllerState
from kvstore.index import IndexSettings, MemoryState
from kvstore.index import create_app as create_index
from kvstore.protocol.control import Link
from kvstore.protocol.records import LookupRequest, LookupResponse
from kvstore.protocol.wire import role_id
from kvstore.security import Policy, create_dev_certificates
from kvstore.settings import ControllerSettings

from ..holder.conftest import AsPrincipal
from .conftest import Instances
from .test_directives import COMPAT, H1, KEYS, SCOPE, shape, status

IS = "https://index.test/is/"


class InProcessIndex:
    """The PC's lookups through the real IS app (in-process transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def lookup(self, query: LookupRequest) -> LookupResponse:
        response = await self.client.post(
            "lookup", content=query.encode(), headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 200, response.text
        return LookupResponse.from_json(response.json())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("residency-pc")
    create_dev_certificates(directory, ["alice", "pc", "warm"])
    return directory


async def test_the_warm_engine_while_its_queue_allows(instances: Instances, certs: Path) -> None:
    warm, cold = instances.uri("warm"), instances.uri("cold")
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:alice": {"read_scopes": ["*"]},
                "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
                **{
                    f"urn:kvstore:{name}": {
                        "roles": ["instance"],
                        "instance": uri,
                        "write_scopes": [SCOPE],
                    }
                    for name, uri in (("warm", warm), ("cold", cold))
                },
            }
        }
    )
    index_app = create_index(IndexSettings(IS), MemoryState(), policy)

    def as_(name: str, app: Any, base: str) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
        return httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=base)

    async with (
        as_("warm", index_app, IS) as bridge,
        as_("pc", index_app, IS) as pc_lookups,
        InstanceClient() as client,
    ):
        # The warm engine's bridge tells the IS: the first 4 blocks, on its GPU.
        told = await bridge.post(
            f"residency/{role_id(warm)}",
            json={
                "instance": warm,
                "ttl_ms": 30_000,
                "add": [
                    {
                        "scope_id": SCOPE,
                        "compat_id": COMPAT,
                        "medium": "GPU",
                        "block_keys": KEYS[:4],
                    }
                ],
            },
        )
        assert told.status_code == 200, told.text
        state = MemoryControllerState()
        warm_status = dataclasses.replace(status(warm), accepts_directives=False)
        await state.put_status(warm_status)
        await state.put_status(status(cold))
        settings = ControllerSettings(
            "https://pc.test/pc/",
            block_tokens={COMPAT: 256},
            prefetch=True,
            mean_service_ms=2.0,
        )
        app = create_app(settings, state, policy, InProcessIndex(pc_lookups), client)
        body = {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": KEYS[:5], "tokens": 1280}
        async with as_("alice", app, "https://pc.test/pc/") as alice:
            chosen = (await alice.post("place", json=body)).json()
            assert chosen["instance"] == warm, chosen
            by = {c["instance"]: c for c in chosen["candidates"]}
            # 4 of 5 blocks are in its memory: only the fifth is recomputed.
            assert by[warm]["resident_tokens"] == 1024
            assert by[warm]["recompute_us"] == pytest.approx(1e6 * 256 / 40000)
            assert by[cold]["recompute_us"] == pytest.approx(1e6 * 1280 / 40000)
            assert "resident_tokens" not in by[cold]
            assert instances.prefetched == []  # a bridged engine takes no directive
            # Its queue grows past what recomputing elsewhere costs: the cold one.
            await state.put_status(dataclasses.replace(warm_status, queued=20))
            chosen = (await alice.post("place", json=body)).json()
            assert chosen["instance"] == cold, chosen
            # The residency gone (the engine cleared its cache): cost alike, idle wins.
            await bridge.post(
                f"residency/{role_id(warm)}",
                json={"instance": warm, "ttl_ms": 30_000, "clear": True},
            )
            await state.put_status(warm_status)
            chosen = (await alice.post("place", json=body)).json()
            assert all("resident_tokens" not in c for c in chosen["candidates"])


def test_a_resident_prefix_is_neither_fetched_nor_recomputed() -> None:
    # 6 matched blocks at H1; the warm instance holds the first 4 itself: it
    # fetches only 2, the other fetches 6 (PL1 with fetch_us 0 for the 4).
    far, warm = "https://far.test/", "https://warm.test/"
    link = Link(H1, 1000.0, 100.0)  # slow: fetching costs
    ranked = rank(
        [status(far, link), status(warm, link)],
        [((shape(H1),), 6)],
        total_tokens=6 * 32,
        block_tokens=32,
        mean_service_us=0.0,
        resident={warm: 4},
    )
    by = {c.instance: c for c in ranked}
    assert ranked[0].instance == warm
    assert by[warm].resident_tokens == 128
    assert by[warm].fetch_us is not None and by[far].fetch_us is not None
    assert by[warm].fetch_us < by[far].fetch_us / 2
    # Resident past what was matched: nothing fetched, the rest recomputed.
    beyond = rank(
        [status(warm, link)],
        [((shape(H1),), 2)],
        total_tokens=6 * 32,
        block_tokens=32,
        mean_service_us=0.0,
        resident={warm: 5},
    )
    assert beyond[0].fetch_us == 0.0 and beyond[0].recompute_us == pytest.approx(1e6 * 32 / 40000)
