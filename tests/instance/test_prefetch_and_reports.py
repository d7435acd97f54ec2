"""Edge cases of the instance's prefetch and reports."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.instance.reporter import Load, StatusReporter
from kvstore.protocol.problems import BadRequest
from kvstore.protocol.records import (
    LeaseGrant,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
)
from kvstore.storage import TieredStore

from ..storage.helpers import COMPAT, SCOPE, block, ref

SOURCE = "https://h.test/kvsp/"


class FakeHolders:
    """A holder client that answers ``body`` for every block."""

    def __init__(self, body: bytes, release_s: float = 0.0) -> None:
        self.body, self.release_s = body, release_s
        self.leased = self.released = 0

    async def lease(self, holder: str, keys: Any, ttl_ms: int, **kw: Any) -> LeaseGrant:
        self.leased += 1
        return LeaseGrant(str(uuid.uuid4()), ttl_ms, tuple(keys))

    async def get_block(self, *args: Any, **kw: Any) -> bytes:
        return self.body

    async def release_lease(self, holder: str, lease_id: str) -> None:
        await asyncio.sleep(self.release_s)
        self.released += 1


def directive(deadline_ms: int = 2000) -> PrefetchDirective:
    return PrefetchDirective(
        directive=str(uuid.uuid4()),
        scope_id=SCOPE,
        compat_id=COMPAT,
        blocks=(PrefetchBlock(ref(0).block_key, (SOURCE,)),),
        deadline_ms=deadline_ms,
        lease_ms=1000,
    )


async def finish(prefetcher: Prefetcher, directive_id: str) -> Any:
    for _ in range(300):
        if (status := prefetcher.status(directive_id)).state != "pending":
            return status
        await asyncio.sleep(0.01)
    raise AssertionError("still pending")


async def test_with_an_index_a_block_without_its_record_is_not_taken() -> None:
    # BL6: the holder's Repr-Digest covers whatever it sends; with an IS the
    # instance takes only replicas whose record checks every layer.
    class NoRecords:
        async def lookup(self, query: Any) -> LookupResponse:
            return LookupResponse(0, ())

    store = TieredStore([(HostTier(), 1 << 24)])
    prefetcher = Prefetcher(store, FakeHolders(block(layers=3)), index=NoRecords())
    run = prefetcher.submit(directive())
    assert (await finish(prefetcher, run.directive_id)).state == "failed"
    assert ref(0) not in store


async def test_a_deadline_during_the_release_keeps_the_block_and_frees_the_lease() -> None:
    store = TieredStore([(HostTier(), 1 << 24)])
    holders = FakeHolders(block(), release_s=0.5)
    prefetcher = Prefetcher(store, holders)
    run = prefetcher.submit(directive(deadline_ms=200))
    status = await finish(prefetcher, run.directive_id)
    assert status.state == "partial" and status.loaded == (ref(0).block_key,)
    await asyncio.sleep(0.6)
    assert holders.released == holders.leased == 1
    assert ref(0) in store


async def test_a_directive_id_is_one_directive_and_finished_runs_stay_small() -> None:
    prefetcher = Prefetcher(TieredStore([(HostTier(), 1 << 24)]), FakeHolders(block()))
    sent = directive()
    run = prefetcher.submit(sent)
    assert prefetcher.submit(sent) is run  # a repeat is the same run
    other = dataclasses.replace(sent, deadline_ms=99)
    with pytest.raises(BadRequest):
        prefetcher.submit(other)
    await finish(prefetcher, sent.directive)
    assert run.directive is None  # the blocks list is not kept after the run


async def test_a_late_answer_does_not_undo_the_pcs_state_change() -> None:
    # S6: the PC woke the instance (PUT state) while a report was on its way;
    # that report's answer ("sleeping") must not put it back to sleep.
    gate = asyncio.Event()
    lifecycle = Lifecycle(state="sleeping")

    class SlowPC:
        async def put_status(self, status: Any) -> str:
            await gate.wait()
            return "sleeping"

    reporter = StatusReporter("https://ii.test/ii/", SlowPC(), lifecycle, Load())
    report = asyncio.create_task(reporter.report())
    await asyncio.sleep(0.05)
    lifecycle.set_by_pc("active")
    gate.set()
    assert await report == "sleeping"
    assert lifecycle.state == "active"


async def test_pending_directives_beyond_the_quota_are_429() -> None:
    # PF5, SEC3: while max_pending directives are pending, another is refused
    # with 429 (kvsp-lease-quota), and accepted again once they finished.
    import httpx

    from kvstore.instance.app import create_app
    from kvstore.security import Policy
    from kvstore.settings import InstanceSettings

    store = TieredStore([(HostTier(), 1 << 24)])
    prefetcher = Prefetcher(store, FakeHolders(block(layers=3), release_s=0.5), max_pending=1)
    policy = Policy.from_json({"principals": {"anonymous": {"roles": ["pc"]}}})
    app = create_app(
        InstanceSettings("http://ii.test/ii/", allow_anonymous=True),
        prefetcher,
        policy,
        Lifecycle(),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://ii.test/ii/"
    ) as pc:
        first = await pc.post("prefetch", json=directive().to_json())
        assert first.status_code == 202
        refused = await pc.post("prefetch", json=directive().to_json())
        assert refused.status_code == 429, refused.text
        assert refused.json()["type"].endswith("#kvsp-lease-quota")
        await finish(prefetcher, first.json()["directive"])
        assert (await pc.post("prefetch", json=directive().to_json())).status_code == 202
    await prefetcher.close()
