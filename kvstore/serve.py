"""Run roles built from a configuration (:mod:`.build`) under uvicorn (``kvstore serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from . import logs
from .build import (
    build_controller,
    build_holder,
    build_index,
    build_instance,
    build_publisher,
    build_store,
    controller_state,
    index_in_process,
)
from .config import ROLE_SECTIONS, Config, ConfigError, check
from .health import HealthListener, bind_health_port
from .http import EXCEPTION_HANDLERS, role_of
from .lifespan import Listening, Service, Shutdown, Step, run_steps, running
from .listener import (
    bind_listener,
    bind_proxy_port,
    bind_unix_socket,
    check_tls_files,
    close_socket,
    server_class,
    uvicorn_config,
)
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import render_roles
from .protocol.wire import NO_STORE
from .reload import Reloader, tls_files
from .seams import PublisherStatsSource, Snapshots
from .seat import Seat, SeatService
from .security import Policy
from .storage import TieredStore

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from .holder.publisher import IndexPublisher

log = logging.getLogger("kvstore.serve")


def readiness(
    store: Snapshots | None, publisher: PublisherStatsSource | None
) -> tuple[bool, dict[str, Any]]:
    """``/readyz``: every tier reachable, and for a holder the IS it publishes
    to; with a store, how far its recovery is (not a condition: it serves
    meanwhile)."""
    checks: dict[str, Any] = {}
    if store is not None:
        checks["tiers"] = {
            f"{i}:{t.kind}": "degraded" if t.degraded else "ok"
            for i, t in enumerate(store.tier_snapshots())
        }
        # A restart serves while it recovers (ready: blocks not reached yet
        # are found on demand); how far it is, for an operator to see.
        checks["recovery"] = store.recovery_progress().to_json()
    if publisher is not None:
        checks["index"] = "ok" if publisher.index_reachable else "unreachable"
    flat = [*checks.get("tiers", {}).values(), checks.get("index", "ok")]
    return all(v == "ok" for v in flat), checks


def compose(
    apps: Sequence[Starlette],
    store: TieredStore | None = None,
    publisher: IndexPublisher | None = None,
    closing: Sequence[Step] = (),
    *,
    services: Sequence[Service] = (),
    listening: Listening | None = None,
    shutdown: Shutdown | None = None,
    seat: Seat | None = None,
) -> Starlette:
    """One app for one listener: each role's app mounted at its base path
    (longest first), ``/metrics`` of every role (labelled ``role``), and ``/healthz`` (the
    process answers) and ``/readyz`` outside every KVSP base path; no role
    is needed for those two (the TLS handshake still asks for a client
    certificate).

    Its lifespan enters every role's lifespan in one exit stack, in the
    order given, then runs ``services`` (the store's retention sweep) once
    ``listening``; at the stop they go in reverse (users before what they
    use: the sweep first, the holder's spill and withdrawals after the
    instance), sharing what ``shutdown`` left when the stop reached them,
    and then ``closing`` runs (the store and the states the roles shared).
    A worker's ``/readyz`` also lists every worker of its set (``seat``)."""

    async def health(request: Request) -> Response:
        ok, checks = (True, {}) if request.url.path == "/healthz" else readiness(store, publisher)
        if seat is not None and request.url.path == "/readyz":
            checks["workers"] = seat.states()  # this one's readiness is its own
        body = json.dumps({"status": "ok" if ok else "unavailable", **checks}).encode()
        return Response(
            body,
            200 if ok else 503,
            headers={"Cache-Control": NO_STORE},
            media_type="application/json",
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(run_steps, closing, "closing the store")
            for role in apps:
                await stack.enter_async_context(role.router.lifespan_context(role))
            await stack.enter_async_context(running(services, after=listening))
            yield
            if shutdown is not None:
                shutdown.freeze()

    roles = sorted((role_of(a) for a in apps), key=lambda r: -len(r.base))

    async def all_metrics(request: Request) -> Response:
        # Every role of the process in one scrape, each sample labelled
        # with its role, and the process's own figures; a scraper must be
        # allowed every role's (each role's alone is at {base}metrics).
        for role in roles:
            role.require_scraper(request)
        parts = [(role.name or role.base.strip("/"), role.metrics) for role in roles]
        return Response(
            render_roles(parts),
            headers={"Cache-Control": NO_STORE},
            media_type=METRICS_CONTENT_TYPE,
        )

    routes: list[BaseRoute] = [
        Route("/healthz", health),  # any method, as a probe may send
        Route("/readyz", health),
        Route("/metrics", all_metrics, methods=["GET"]),
        *(Mount(r.base, app=r.mountable) for r in roles),
    ]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.router.redirect_slashes = False
    return app


async def serve(
    config: Config, roles: tuple[str, ...] = ("holder",), seat: Seat | None = None
) -> None:
    """Run the configured roles on one listener until interrupted.

    Everything is built first (a bad configuration fails here, before the
    listener binds), the store recovers what its persistent tiers hold, then
    uvicorn serves :func:`compose` of the role apps: their lifespans start
    their background parts and, at a signal, stop them (see ``Server``).
    ``seat``: this process is that worker of a supervised set (:mod:`.workers`)."""
    if not roles:
        raise ConfigError("roles: none given; available: holder, index, pc, instance")
    problems = check(config, roles)
    if problems:
        raise ConfigError(problems[0])
    listening, shutdown = Listening(False), Shutdown(config.server.shutdown_grace_s)
    closing: list[Step] = []
    # Every file the start needs is read, and the listener bound, before any
    # tier is opened or recovered: a failed start touches no storage.
    check_tls_files(config)
    listener = bind_listener(config)
    closing.append(lambda: close_socket(listener))
    health = None
    try:
        if config.server.health_port:
            # Probes without a client certificate (Kubernetes): alive from
            # here on, ready once built and serving (docs/operations.md).
            health = HealthListener(
                bind_health_port(config.server.health_host, config.server.health_port)
            )
            closing.append(health.stop)
            await health.start()
        policies: list[tuple[str, Policy]] = []
        app: ASGIApp = await _build(
            config, roles, listening, shutdown, closing, seat, health, policies
        )
        if config.server.trusted_proxy:
            from .proxy import ForwardedIdentity

            uid = config.server.trusted_proxy_uid
            app = ForwardedIdentity(
                app,
                config.server.trusted_proxy,
                config.server.trusted_proxy_header,
                uid if uid >= 0 else None,
            )
        proxy_sockets = []
        path = config.server.unix_socket
        if path:
            unix = bind_unix_socket(path)
            closing.append(lambda: close_socket(unix, path))  # also if the start fails
            proxy_sockets.append((unix, f"unix:{path}"))
        if config.server.proxy_port:
            tcp, where = bind_proxy_port(config.server.trusted_proxy, config.server.proxy_port)
            closing.append(lambda: close_socket(tcp))
            proxy_sockets.append((tcp, where))
        server = server_class()(uvicorn_config(config, app), listening, shutdown, proxy_sockets)
    except BaseException:
        # Built this far: the tiers and states made are closed again.
        await run_steps(closing, "closing after a failed start")
        raise
    scheme = "http" if config.server.insecure_http else "https"
    log.info(
        "serving %s on %s://%s:%s", ",".join(roles), scheme, config.server.host, config.server.port
    )
    # Certificates and policies rotated without a restart: SIGHUP, or their
    # files changing (kvstore.reload).
    tls = getattr(server.config, "kvstore_tls", None)
    files = (
        []
        if tls is None
        else tls_files(config.server.certfile, config.server.keyfile, config.server.cafile)
    )
    reloader = Reloader(tls, policies, files, config.server.reload_check_s)
    loop = asyncio.get_running_loop()
    hangup = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        hangup = True
    reloader.start()
    try:
        await server.serve(sockets=[listener])
    finally:
        await reloader.stop()
        if hangup:
            loop.remove_signal_handler(signal.SIGHUP)


async def _build(
    config: Config,
    roles: Sequence[str],
    listening: Listening,
    shutdown: Shutdown,
    closing: list[Step],
    seat: Seat | None = None,
    health: HealthListener | None = None,
    policies: list[tuple[str, Policy]] | None = None,
) -> Starlette:
    """The composed app of ``roles``; what to close at the end goes to
    ``closing``; ``health`` answers ready once the listener serves; each
    role's policy (its file and the object it was given, for a reload) to
    ``policies``."""
    store = publisher = pc_state = None
    apps: list[Starlette] = []
    services: list[Service] = []
    if "holder" in roles or "instance" in roles:
        store = build_store(config)
        # The store's own stop: a spill the holder did not do already, then
        # its claims given back and its tiers closed (the roles that use it
        # stopped before).
        closing += [lambda: store.spill(shutdown.share(0.6)), store.close]
        # One owner per storage: every persistent tier is claimed before any
        # of it is read (a second holder on the same LMDB directory, Redis or
        # S3 prefix is refused here with one line), and kept while serving.
        from .storage.owner import owner_name

        # The holder serves while it recovers (a large tier would keep it
        # silent for minutes): blocks the scan has not reached are found on
        # demand; recover_first waits for the scan instead.
        found = await store.open(
            owner_name(_serving(config, roles)),
            config.storage.owner_ttl_s,
            background=not config.storage.recover_first,
        )
        await store.measure_read_rates()
        if config.storage.retention_s > 0:
            from .storage.retention import RetentionSweeper

            services.append(RetentionSweeper(store))
    if "holder" in roles:
        assert store is not None
        publisher = build_publisher(config, store)
        apps.append(build_holder(config, store, publisher, listening, shutdown))
        if not config.storage.recover_first:
            # kvstore.storage logs the scan's end ("recovery: N blocks in T s").
            log.info("holder %s: recovering its stored blocks while serving", config.holder.uri)
        else:
            log.info("holder %s: %d blocks recovered", config.holder.uri, found)
    if "instance" in roles:
        # Its blocks are in the store; with the holder role the holder
        # serves and publishes them (an instance is a holder of its tiers).
        assert store is not None
        apps.append(build_instance(config, store, publisher is not None, listening))
        log.info("instance %s", config.instance.uri)
    if "pc" in roles or ("index" in roles and config.controller.state == "redis"):
        # The IS estimates from the PC's instance status (L2): the PC's
        # state in this process, or the Redis PC processes share.
        pc_state = controller_state(config)
        closing.append(pc_state.close)  # closed after the roles stopped, like the IS's
    index_app = local = None
    if "index" in roles:
        index_app, index_state = build_index(config, pc_state)
        closing.append(index_state.close)
        closing.append(index_app.state.residency.close)
        if index_in_process(config, roles):
            # The PC's placer asks this process's IS directly (issue 20).
            from .index.local import LocalIndex

            local = LocalIndex(index_state, role_of(index_app).counters, index_app.state.residency)
    if "pc" in roles:
        assert pc_state is not None
        apps.append(build_controller(config, pc_state, listening, local))
        log.info(
            "controller %s (%s state%s)",
            config.controller.uri,
            config.controller.state,
            ", the IS in process" if local else "",
        )
    if index_app is not None:
        apps.append(index_app)
        log.info("index %s (%s state)", config.index.uri, config.index.state)
    if policies is not None:
        for role_app in apps:
            role = role_of(role_app)
            if role.name in ROLE_SECTIONS:
                section = getattr(config, ROLE_SECTIONS[role.name])
                policies.append((section.policy, role.policy))
    if health is not None:

        def ready() -> bool:
            return listening.is_set() and readiness(store, publisher)[0]

        health.ready = ready
    if seat is not None:
        services.append(SeatService(seat))  # up once it listens
        for role_app in apps:
            role_of(role_app).metrics.labels = {"worker": str(seat.index)}
    return compose(
        apps,
        store,
        publisher,
        closing,
        services=services,
        listening=listening,
        shutdown=shutdown,
        seat=seat,
    )


def _serving(config: Config, roles: Sequence[str]) -> str:
    """What this process serves, as an owner record names it."""
    if "holder" in roles:
        return f"holder {config.holder.uri or config.server.port}"
    return f"instance {config.instance.uri or config.server.port}"


def setup_logging(config: Config, seat: Seat | None = None) -> None:
    """kvstore's own lines at server.log_level (INFO: normal events, WARNING:
    what an operator should look at), the access log, uvicorn's and other
    libraries' lines (at WARNING) in server.log_format (kvstore.logs)."""
    server = config.server
    logs.setup(
        server.log_level,
        server.log_format,
        server.access_log,
        worker=seat.index if seat is not None else None,
    )


def run(config: Config, roles: tuple[str, ...] = ("holder",), seat: Seat | None = None) -> int:
    """The roles in this process (``seat``: as a worker of a supervised
    set); the exit status. A configuration of several workers is the
    supervisor's (:func:`kvstore.workers.supervise`), which runs this in
    each worker's process."""
    if config.server.workers > 1:
        raise ConfigError("server.workers above 1: kvstore.workers.supervise runs the set")
    setup_logging(config, seat)
    asyncio.run(serve(config, roles, seat))
    return 0
