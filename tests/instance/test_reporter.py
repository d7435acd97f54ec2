"""Status reports from an instance to a real PC over loopback HTTP (S1-S6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from kvstore.backends.host import HostTier
from kvstore.client import ControllerClient
from kvstore.controller.app import create_app
from kvstore.controller.state import MemoryControllerState, SleepPolicy
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.reporter import Load, StatusReporter
from kvstore.protocol.control import Link
from kvstore.security import Policy
from kvstore.settings import ControllerSettings
from kvstore.storage import TieredStore

from ..conftest import free_port
from ..storage.helpers import block, ref

II = "https://ii.test/kvsp/"


@pytest.fixture
async def pc() -> AsyncIterator[tuple[MemoryControllerState, str]]:
    state = MemoryControllerState(sleep_policy=SleepPolicy(idle_for_s=0))
    policy = Policy.from_json(
        {"principals": {"anonymous": {"roles": ["instance"], "instance": II}}}
    )
    port = free_port()
    uri = f"http://127.0.0.1:{port}/pc/"
    app = create_app(ControllerSettings(uri, allow_anonymous=True), state, policy)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield state, uri
    server.should_exit = True
    await task


async def test_reports_carry_the_start_epoch_and_real_numbers(pc: Any) -> None:
    # S1, S2, R3: the epoch is the start time in ms; the load and the fill
    # of the fastest tier are what the instance has.
    state, uri = pc
    store = TieredStore([(HostTier(), 4 * len(block()))])
    await store.put(ref(0), block())
    load = Load(
        running=2,
        queued=1,
        prefill_tokens_per_s=40000.0,
        decode_tokens_per_s=3000.0,
        links=(Link("https://h1.test/kvsp/", 1e5, 20.0),),
    )
    async with ControllerClient(uri) as client:
        before = int(time.time() * 1000)
        reporter = StatusReporter(II, client, Lifecycle(), load, store, ttl_ms=600)
        assert await reporter.report() == "active"
        entry, _ = await state._instance(II)
        assert entry is not None
        status = entry.status
        assert before - 5000 <= status.epoch <= int(time.time() * 1000)
        assert (status.running, status.queued, status.prefill_tokens_per_s) == (2, 1, 40000.0)
        assert status.kv_utilization == pytest.approx(0.25, abs=0.05)
        assert status.links == load.links
        # S1: reported every ttl/3; once it stops, the PC sees it failed.
        reporter.start()
        await asyncio.sleep(0.7)
        assert reporter.reports >= 3
        await reporter.stop()
        await asyncio.sleep(0.7)
        assert await state.state_of(II) == "failed"


async def test_sleeping_handshake_and_waking(pc: Any) -> None:
    # S3: idle long enough, it asks to sleep, the PC answers draining; S5:
    # with nothing running it reports sleeping; S6: only the PC wakes it.
    state, uri = pc
    lifecycle = Lifecycle()
    async with ControllerClient(uri) as client:
        reporter = StatusReporter(II, client, lifecycle, Load(), ttl_ms=60_000, idle_s=0.0)
        assert await reporter.report() == "draining" and lifecycle.state == "draining"
        assert await reporter.report() == "sleeping" and lifecycle.state == "sleeping"
        assert await state.state_of(II) == "sleeping"
        await state.set_state(II, "active")  # what the PC's PUT state does at the PC
        lifecycle.state = "active"  # ... and at the instance (its PUT state resource)
        reporter.idle_s = None
        assert await reporter.report() == "active" and lifecycle.state == "active"
