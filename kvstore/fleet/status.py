"""The bridged engine's status to the Placement Controller: a vLLM pod does
not report KVSP instance status (S1), so the PC would never place on it.
With ``controller_uri`` set, the bridge reports for it: its load read from
the engine's own Prometheus metrics (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``), its prefill
and decode rates as configured, no links (it fetches nothing from
holders), and ``kvstore_accepts_directives: false`` (it has no prefetch
API: the PC sends it none).

An engine whose metrics cannot be read is not reported (its status expires
at the PC, which then no longer places on it: S4).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..logs import Tally, describe
from ..protocol.control import InstanceStatus
from ..protocol.problems import KvspError

log = logging.getLogger("kvstore.events")

#: vLLM's gauges (its v1 metrics), summed over its label sets.
RUNNING, WAITING, KV_USAGE = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def engine_load(text: str) -> tuple[int, int, float]:
    """(running, waiting, KV cache use 0-1) from vLLM's /metrics text."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (RUNNING, WAITING, KV_USAGE):
                found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    if RUNNING not in found or WAITING not in found:
        raise ValueError(f"no {RUNNING} or {WAITING} in the engine's metrics")
    usage = min(max(found.get(KV_USAGE, 0.0), 0.0), 1.0)
    return int(found[RUNNING]), int(found[WAITING]), usage


class EngineStatus:
    """Reports the engine's status to the PC every third of ``ttl_ms``.
    ``controller``: a :class:`~kvstore.client.ControllerClient`."""

    def __init__(
        self,
        controller: Any,
        instance: str,
        metrics_url: str,
        *,
        ttl_ms: int,
        batch_size: int,
        prefill_tokens_per_s: float,
        decode_tokens_per_s: float,
    ) -> None:
        self.controller, self.instance, self.metrics_url = controller, instance, metrics_url
        self.ttl_ms, self.batch_size = ttl_ms, batch_size
        self.prefill, self.decode = prefill_tokens_per_s, decode_tokens_per_s
        self.reports = self.failures = 0
        self._failed = Tally(log, "status of %s not reported (%d time(s))")

    def status(self, running: int, waiting: int, usage: float) -> InstanceStatus:
        return InstanceStatus(
            instance=self.instance,
            epoch=1,
            state="active",
            running=running,
            queued=waiting,
            batch_size=self.batch_size,
            kv_utilization=usage,
            prefill_tokens_per_s=self.prefill,
            decode_tokens_per_s=self.decode,
            ttl_ms=self.ttl_ms,
            accepts_directives=False,
        )

    async def report(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(self.metrics_url) as answer:
                if answer.status != 200:
                    raise ValueError(f"{self.metrics_url} answered {answer.status}")
                load = engine_load(await answer.text())
            await self.controller.put_status(self.status(*load))
        except (aiohttp.ClientError, TimeoutError, ValueError, KvspError) as exc:
            self.failures += 1
            self._failed(self.instance, describe(exc))
            return False
        self.reports += 1
        return True

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                await self.report(http)
                await asyncio.sleep(self.ttl_ms / 3000)
