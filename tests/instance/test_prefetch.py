"""The instance's prefetch directives against real holder servers (loopback
HTTP): leases, fetch, verification, placement, publication (PF1-PF5)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvstore.backends.host import HostTier
from kvstore.client import HolderClient
from kvstore.holder import HolderSettings
from kvstore.holder import create_app as create_holder
from kvstore.instance.app import create_app
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.protocol.records import PrefetchBlock, PrefetchDirective
from kvstore.security import Policy
from kvstore.settings import InstanceSettings
from kvstore.storage import LeaseLimits, TieredStore

from ..conftest import free_port
from ..holder.conftest import AsPrincipal, RecordingPublisher
from ..storage.helpers import COMPAT, SCOPE, block, ref

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)


class Holder:
    def __init__(self) -> None:
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}/kvsp/"
        self.store = TieredStore([(HostTier(), 64 << 20)], lease_limits=LeaseLimits())
        app = create_holder(HolderSettings(self.uri, allow_anonymous=True), self.store, OPEN)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        )


@pytest.fixture
async def holders() -> AsyncIterator[list[Holder]]:
    found = [Holder(), Holder()]
    tasks = [asyncio.create_task(h.server.serve()) for h in found]
    while not all(h.server.started for h in found):
        await asyncio.sleep(0.01)
    yield found
    for h in found:
        h.server.should_exit = True
    await asyncio.gather(*tasks)


def directive(blocks: list[PrefetchBlock], deadline_ms: int = 5000) -> PrefetchDirective:
    return PrefetchDirective(
        directive=str(uuid.uuid4()),
        scope_id=SCOPE,
        compat_id=COMPAT,
        blocks=tuple(blocks),
        deadline_ms=deadline_ms,
        lease_ms=2000,
    )


async def wait(prefetcher: Prefetcher, directive_id: str) -> Any:
    for _ in range(500):
        status = prefetcher.status(directive_id)
        if status.state != "pending":
            return status
        await asyncio.sleep(0.01)
    raise AssertionError("directive still pending")


async def test_blocks_are_fetched_placed_and_published(holders: list[Holder]) -> None:
    # PF2: for each block it lacks, a lease at a source, the fetch, the
    # placement in its own tiers and the publication of its new replica; a
    # source that lacks the block (404) is a miss and the next one is tried.
    first, second = holders
    zero, one = block(), block(layers=4)
    await first.store.put(ref(0), zero)
    await second.store.put(ref(1), one)
    mine = TieredStore([(HostTier(), 64 << 20)])
    published = RecordingPublisher(mine)  # hears of blocks from the store's events
    async with HolderClient() as client:
        prefetcher = Prefetcher(mine, client)
        run = prefetcher.submit(
            directive(
                [
                    PrefetchBlock(ref(0).block_key, (first.uri,)),
                    PrefetchBlock(
                        ref(1).block_key, (first.uri, second.uri)
                    ),  # first has no block 1
                ]
            )
        )
        status = await wait(prefetcher, run.directive.directive)
    assert status.state == "complete"
    assert status.loaded == (ref(0).block_key, ref(1).block_key)
    assert await mine.get(ref(0)) == zero and await mine.get(ref(1)) == one
    assert [r for _, r in published.events] == [ref(0), ref(1)]
    # Leases were released at the sources (LE1): nothing stays pinned.
    assert not first.store.leases.is_leased(ref(0))
    assert not second.store.leases.is_leased(ref(1))


async def test_nothing_to_fetch_anywhere_is_failed_and_some_is_partial(
    holders: list[Holder],
) -> None:
    first, _ = holders
    await first.store.put(ref(0), block())
    async with HolderClient(timeout_s=2) as client:
        prefetcher = Prefetcher(TieredStore([(HostTier(), 64 << 20)]), client)
        unreachable = f"http://127.0.0.1:{free_port()}/kvsp/"
        none = prefetcher.submit(directive([PrefetchBlock(ref(5).block_key, (first.uri,))]))
        assert (await wait(prefetcher, none.directive.directive)).state == "failed"
        some = prefetcher.submit(
            directive(
                [
                    PrefetchBlock(ref(0).block_key, (unreachable, first.uri)),
                    PrefetchBlock(ref(6).block_key, (first.uri,)),
                ]
            )
        )
        status = await wait(prefetcher, some.directive.directive)
    assert status.state == "partial" and status.loaded == (ref(0).block_key,)


async def test_the_deadline_stops_a_directive(holders: list[Holder]) -> None:
    # PF4: at the deadline the instance stops and reports partial.
    first, _ = holders

    class Slow(HolderClient):
        async def get_block(self, *args: Any, **kw: Any) -> bytes:
            await asyncio.sleep(1)
            return await super().get_block(*args, **kw)

    await first.store.put(ref(0), block())
    async with Slow() as client:
        prefetcher = Prefetcher(TieredStore([(HostTier(), 64 << 20)]), client)
        run = prefetcher.submit(directive([PrefetchBlock(ref(0).block_key, (first.uri,))], 100))
        status = await wait(prefetcher, run.directive.directive)
    assert status.state == "partial" and status.loaded == ()


async def test_the_resources_take_directives_from_the_pc_only(
    holders: list[Holder], tmp_path: Path
) -> None:
    # PF1: 202 with Location; PF3: its state; PF5, SEC1: only the PC, and a
    # bounded number pending; S4: none while not active; S3: PUT state.
    from kvstore.security import create_dev_certificates

    create_dev_certificates(tmp_path, ["pc", "tenant"])
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:pc": {"roles": ["pc"]},
                "urn:kvstore:tenant": {"read_scopes": ["*"]},
            }
        }
    )
    first, _ = holders
    await first.store.put(ref(0), block())
    async with HolderClient() as client:
        prefetcher = Prefetcher(TieredStore([(HostTier(), 64 << 20)]), client, max_pending=1)
        lifecycle = Lifecycle()
        app = create_app(InstanceSettings("https://ii.test/ii/"), prefetcher, policy, lifecycle)

        def as_(name: str) -> httpx.AsyncClient:
            wrapped = AsPrincipal(app, (tmp_path / f"client-{name}.pem").read_text())
            return httpx.AsyncClient(
                transport=httpx.ASGITransport(wrapped), base_url="https://ii.test/ii/"
            )

        body = directive([PrefetchBlock(ref(0).block_key, (first.uri,))]).to_json()
        async with as_("pc") as pc, as_("tenant") as tenant:
            assert (await tenant.post("prefetch", json=body)).status_code == 403
            accepted = await pc.post("prefetch", json=body)
            assert accepted.status_code == 202, accepted.text
            location = accepted.headers["location"]
            assert location == f"/ii/prefetch/{body['directive']}"
            other = {**body, "directive": str(uuid.uuid4())}
            busy = await pc.post("prefetch", json=other)
            assert busy.status_code in (202, 429)  # 429 while the first is pending
            await wait(prefetcher, body["directive"])
            state = (await pc.get(location.removeprefix("/ii/"))).json()
            assert state["state"] == "complete" and state["loaded"] == [ref(0).block_key]
            assert (await tenant.get(location.removeprefix("/ii/"))).status_code == 403
            assert (await pc.get(f"prefetch/{uuid.uuid4()}")).status_code == 404
            assert (await pc.put("state", json={"state": "draining"})).status_code == 200
            refused = await pc.post("prefetch", json={**body, "directive": str(uuid.uuid4())})
            assert refused.status_code == 409 and lifecycle.state == "draining"
            assert (await pc.put("state", json={"state": "failed"})).status_code == 400
            assert (await tenant.put("state", json={"state": "active"})).status_code == 403
        await prefetcher.close()
