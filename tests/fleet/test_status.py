"""The bridged engine's status to the PC (kvstore.fleet.status), read from
the engine's own metrics as vLLM exposes them, over real HTTP."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvstore.fleet.status import EngineStatus, engine_load
from kvstore.protocol.control import InstanceStatus

from ..conftest import free_port

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="toy"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="toy"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="toy"} 0.42
"""


def test_the_engine_s_load_from_its_metrics() -> None:
    assert engine_load(VLLM_METRICS) == (3, 7, 0.42)
    with pytest.raises(ValueError, match="num_requests"):
        engine_load("# nothing of vLLM's\nup 1\n")


class Controller:
    def __init__(self) -> None:
        self.statuses: list[InstanceStatus] = []

    async def put_status(self, status: InstanceStatus) -> str:
        self.statuses.append(status)
        return "active"


async def test_reports_what_the_engine_says_and_nothing_when_it_is_silent() -> None:
    body = {"text": VLLM_METRICS}

    async def metrics(_: Any) -> web.Response:
        return web.Response(text=body["text"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    controller = Controller()
    reporter = EngineStatus(
        controller,
        "https://vllm-0.test:8000/",
        f"http://127.0.0.1:{port}/metrics",
        ttl_ms=3000,
        batch_size=64,
        prefill_tokens_per_s=20000.0,
        decode_tokens_per_s=900.0,
    )
    try:
        async with aiohttp.ClientSession() as http:
            assert await reporter.report(http)
            [sent] = controller.statuses
            assert (sent.running, sent.queued, sent.kv_utilization) == (3, 7, 0.42)
            assert sent.prefill_tokens_per_s == 20000.0 and not sent.accepts_directives
            assert InstanceStatus.from_json(sent.to_json()) == sent  # the extension travels
            body["text"] = "garbage"
            assert not await reporter.report(http)
            assert len(controller.statuses) == 1 and reporter.failures == 1
    finally:
        await runner.cleanup()
