"""``kvstore events --config FILE``: a bridge built from its settings and run
until SIGTERM or SIGINT; at the stop the IS is told to void this instance's
residency (no one keeps it true any more)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from .. import logs
from ..config import ConfigError
from ..integrations.options import read_descriptor_file, read_scope_key
from ..logs import describe
from ..protocol.problems import KvspError
from ..protocol.residency import ResidencyUpdate
from ..reload import Reloader
from .bridge import Bridge
from .settings import EventsSettings

log = logging.getLogger("kvstore.events")


def build_bridge(settings: EventsSettings) -> Bridge:
    descriptor = read_descriptor_file(settings.descriptor_file, prefix="events.")
    keys = {
        salt: read_scope_key(file, f"salt_scopes.{salt}", prefix="events.")
        for salt, file in settings.salt_scopes.items()
    }
    if settings.scope_key_file:
        keys[""] = read_scope_key(settings.scope_key_file, "scope_key_file", prefix="events.")
    return Bridge(keys, descriptor.compat_id_hex, descriptor.block_tokens, settings.max_blocks)


async def serve_events(settings: EventsSettings) -> None:
    from ..client import ControllerClient, IndexClient
    from ..health import HealthListener, bind_health_port
    from ..tls import reloadable_client_context
    from .service import EventBridge

    bridge = build_bridge(settings)
    context = None
    if settings.index_uri.startswith("https:"):
        try:
            context = reloadable_client_context(
                settings.cafile, settings.certfile, settings.keyfile
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"events.certfile / keyfile / cafile: {exc}") from exc
    health = None
    if settings.metrics_port:
        sock = bind_health_port(settings.metrics_host, settings.metrics_port)
        health = HealthListener(sock, "events.metrics_port")
    async with IndexClient(settings.index_uri, context, timeout_s=10) as index:
        service = EventBridge(
            bridge,
            index,
            settings.instance,
            endpoint=settings.endpoint,
            replay_endpoint=settings.replay_endpoint,
            topic=settings.topic,
            ttl_ms=settings.ttl_ms,
            flush_ms=settings.flush_ms,
            max_update_keys=settings.max_update_keys,
            replay_timeout_s=settings.replay_timeout_s,
        )
        if health is not None:
            health.metrics, health.ready = service.metrics, service.ready
            await health.start()
        # Its certificate renewed (cert-manager) or SIGHUP: read again.
        reloader = Reloader(None, [], [], 10.0)
        reloader.start()
        running = asyncio.create_task(
            _with_status(service.run(), settings, context, ControllerClient),
            name="kvstore events",
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, running.cancel)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        try:
            await running
        except asyncio.CancelledError:
            pass
        finally:
            await reloader.stop()
            if health is not None:
                await health.stop()
            # Nothing keeps the residency true from now on: void it.
            try:
                async with asyncio.timeout(3):
                    await index.tell_residency(
                        ResidencyUpdate(settings.instance, settings.ttl_ms, clear=True)
                    )
                log.info("stopped: %s's residency withdrawn", settings.instance)
            except (KvspError, TimeoutError) as exc:
                log.warning(
                    "stopped: %s's residency not withdrawn (%s); it expires in %d ms",
                    settings.instance,
                    describe(exc),
                    settings.ttl_ms,
                )


async def _with_status(
    bridging: Any, settings: EventsSettings, context: Any, client_class: Any
) -> None:
    """The bridge, and the engine's status to the PC where one is set."""
    if not settings.controller_uri:
        await bridging
        return
    from .status import EngineStatus

    async with client_class(settings.controller_uri, context, timeout_s=10) as controller:
        reporter = EngineStatus(
            controller,
            settings.instance,
            settings.engine_metrics_url,
            ttl_ms=settings.ttl_ms,
            batch_size=settings.batch_size,
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
            decode_tokens_per_s=settings.decode_tokens_per_s,
        )
        reporting = asyncio.create_task(reporter.run(), name="engine status")
        try:
            await bridging
        finally:
            reporting.cancel()
            await asyncio.gather(reporting, return_exceptions=True)


def run(config: str) -> int:
    settings = EventsSettings.load(config)
    logs.setup(settings.log_level, settings.log_format)
    asyncio.run(serve_events(settings))
    return 0
