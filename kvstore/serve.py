"""Build roles from a configuration and run them under uvicorn (``kvstore serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from .config import ROLE_SECTIONS, Config, ConfigError, check
from .health import HealthListener, bind_health_port
from .holder import create_app
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
from .protocol.compat import parse_descriptor
from .protocol.problems import KvspError
from .protocol.wire import NO_STORE
from .reload import Reloader, tls_files
from .seams import Lookups, PublisherStatsSource, Snapshots
from .seat import Seat, SeatService
from .security import Policy
from .storage import SegmentSealer, TieredStore

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from .client import ControllerClient, HolderClient, IndexClient, InstanceClient
    from .controller.state import ControllerState
    from .holder.publisher import IndexPublisher
    from .index.app import StatusSource
    from .index.state import IndexState
    from .instance.lifecycle import Lifecycle
    from .instance.prefetch import Prefetcher
    from .instance.reporter import Load
    from .instance.sessions import Sessions
    from .settings import InstanceSettings

log = logging.getLogger("kvstore.serve")


def build_store(config: Config) -> TieredStore:
    """The TieredStore a configuration describes (backends imported lazily)."""
    from kvstore.backends import create_tier

    cfg = config.storage
    key = None
    if cfg.encryption_key_file:
        key = Path(cfg.encryption_key_file).read_bytes()
        if len(key) != 32:
            raise ConfigError("storage.encryption_key_file: must hold exactly 32 octets")
    tiers = []
    for index, tier in enumerate(cfg.tiers):
        options = dict(tier.options)
        deadline = options.pop("deadline_s", None)  # the manager's, not the backend's
        where = f"storage.tiers[{index}]"
        try:
            made = create_tier(tier.backend, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        except ImportError as exc:
            raise ConfigError(f"{where}.backend: {exc}") from None
        except OSError as exc:  # a directory that cannot be made or opened
            raise ConfigError(
                f"{where}.path: {exc.filename or options.get('path')}: {exc.strerror}"
            ) from None
        except KvspError as exc:  # TierUnavailable: LMDB cannot open its environment
            raise ConfigError(f"{where}: {exc.detail}") from None
        if deadline is not None:
            made.deadline_s = float(deadline)
        tiers.append((made, tier.capacity))
    # The section is the store's settings (StoreSettings), taken whole.
    return TieredStore(tiers, cfg, sealer=SegmentSealer(key, compress=cfg.compress))


def index_client(config: Config, section: str) -> IndexClient | None:
    """An IndexClient for ``<section>.index_uri``, authenticating with the
    section's client certificate when the index is https; None when unset."""
    from .client import IndexClient

    cfg = getattr(config, section)
    if not cfg.index_uri:
        return None
    context = None
    if cfg.index_uri.startswith("https:"):
        context = _client_context(config, cfg)
        if context is None:
            raise ConfigError(f"{section}.client_certfile: required for an https index")
    return IndexClient(cfg.index_uri, context)


def _client_context(config: Config, cfg: Any) -> ssl.SSLContext | None:
    """The client context of a role section's ``client_certfile`` /
    ``client_keyfile`` (SEC1), with the server's CA; None when not set."""
    from .tls import client_context

    if not (cfg.client_certfile and cfg.client_keyfile and config.server.cafile):
        return None
    return client_context(config.server.cafile, cfg.client_certfile, cfg.client_keyfile)


def build_publisher(config: Config, store: TieredStore) -> IndexPublisher | None:
    """An IndexPublisher when ``holder.index_uri`` is set, else None."""
    from .holder.publisher import IndexPublisher

    index = index_client(config, "holder")
    if index is None:
        return None
    return IndexPublisher(index, store, config.holder.uri, config.holder.replica_ttl_ms)


def build_holder(
    config: Config,
    store: TieredStore,
    publisher: IndexPublisher | None = None,
    listening: Listening | None = None,
    shutdown: Shutdown | None = None,
) -> Starlette:
    """The holder app over ``store``, with its publisher (see :func:`.holder.create_app`)."""
    cfg = config.holder
    descriptors = {}
    for file in cfg.descriptors:
        descriptor = parse_descriptor(json.loads(Path(file).read_text()))
        descriptors[descriptor.compat_id_hex] = descriptor
    # The [holder] section is the holder's settings; serve adds what it
    # derives: the descriptors its files hold, plain-HTTP development mode.
    settings = dataclasses.replace(
        cfg, known_descriptors=descriptors, allow_anonymous=config.server.insecure_http
    )
    return create_app(
        settings, store, Policy.load(cfg.policy), publisher, listening=listening, shutdown=shutdown
    )


def controller_state(config: Config) -> ControllerState:
    """The PC's state a configuration describes ([controller] state)."""
    from .controller.state import MemoryControllerState, SleepPolicy

    cfg = config.controller
    rules: dict[str, Any] = {
        "sleep_policy": SleepPolicy(cfg.sleep_max_running, cfg.sleep_max_queued, cfg.sleep_idle_s),
        "max_sessions": cfg.max_sessions,
        "max_sessions_per_owner": cfg.max_sessions_per_instance,
    }
    if cfg.state == "memory":
        return MemoryControllerState(**rules)
    if cfg.state == "redis":
        from .controller.redis_state import RedisControllerState

        return RedisControllerState(
            cfg.redis_url, cfg.redis_prefix, cluster=cfg.redis_cluster, **rules
        )
    raise ConfigError(f"controller.state: {cfg.state!r} is not 'memory' or 'redis'")


def index_in_process(config: Config, roles: Sequence[str]) -> bool:
    """The PC's placer asks this process's IS directly: both roles here, and
    ``controller.index_uri`` unset or naming this IS."""
    return (
        "pc" in roles
        and "index" in roles
        and (config.controller.index_uri in ("", config.index.uri))
    )


def build_controller(
    config: Config,
    state: ControllerState,
    listening: Listening | None = None,
    local_index: Lookups | None = None,
) -> Starlette:
    """The Placement Controller app over ``state``; ``local_index``: the IS
    of this process, asked in process (no HTTP, no JSON) instead of over
    ``controller.index_uri``."""
    from .controller.app import create_app as create_controller

    cfg = config.controller
    index: Any = local_index if local_index is not None else index_client(config, "controller")
    settings = dataclasses.replace(
        cfg,
        block_tokens=_block_tokens(cfg.descriptors),
        allow_anonymous=config.server.insecure_http,
    )
    instances = instance_client(config)
    closing = [c.close for c in (instances, index) if c is not None]
    return create_controller(
        settings,
        state,
        Policy.load(cfg.policy),
        index,
        instances,
        closing=closing,
        listening=listening,
    )


def instance_client(config: Config) -> InstanceClient:
    """The PC's client of instances, with its client certificate (SEC1)."""
    from .client import InstanceClient

    context = _client_context(config, config.controller)
    # Short: a hung instance must not hold up a placement's directive or a
    # migration round (each candidate that does not answer costs this long).
    return InstanceClient(context, timeout_s=5.0)


def build_instance(
    config: Config,
    store: TieredStore,
    with_holder: bool = False,
    listening: Listening | None = None,
) -> Starlette:
    """The Inference Instance app over ``store``; its lifespan runs its
    sessions and status reporter and closes the clients made here."""
    from .client import ControllerClient, HolderClient, IndexClient
    from .instance.app import create_app
    from .instance.lifecycle import Lifecycle
    from .instance.prefetch import Prefetcher
    from .instance.reporter import Load, StatusReporter

    cfg = config.instance
    if not with_holder:
        log.warning("instance without the holder role: prefetched blocks are not published")
    context = _client_context(config, cfg)
    holders = HolderClient(context)
    index = IndexClient(cfg.index_uri, context) if cfg.index_uri else None
    prefetcher = Prefetcher(store, holders, index=index, max_pending=cfg.max_pending_directives)
    lifecycle = Lifecycle()
    settings = dataclasses.replace(cfg, allow_anonymous=config.server.insecure_http)
    load = Load(
        prefill_tokens_per_s=cfg.prefill_tokens_per_s, decode_tokens_per_s=cfg.decode_tokens_per_s
    )
    controller = ControllerClient(cfg.controller_uri, context) if cfg.controller_uri else None
    sessions = None
    if cfg.engine:
        sessions = build_sessions(
            config, settings, store, prefetcher, holders, controller, lifecycle, load
        )
    from .instance.shards import Shards

    policy = Policy.load(cfg.policy)
    shards = Shards(store, prefetcher, policy, cfg.block_tokens)
    reporter = None
    if controller is not None:
        reporter = StatusReporter(
            cfg.uri,
            controller,
            lifecycle,
            load,
            store,
            ttl_ms=cfg.status_ttl_ms,
            idle_s=cfg.sleep_idle_s or None,
        )
    # Closed after the sessions and the prefetcher that use them.
    closing = [c.close for c in (holders, index, controller) if c is not None]
    return create_app(
        settings,
        prefetcher,
        policy,
        lifecycle,
        sessions,
        shards,
        reporter=reporter,
        closing=closing,
        listening=listening,
    )


def read_scope_keys(files: tuple[str, ...]) -> dict[str, bytes]:
    """Scope keys from files of hex text (at least 32 octets each), by scope ID."""
    from .protocol.keys import scope_id

    keys: dict[str, bytes] = {}
    for file in files:
        try:
            key = bytes.fromhex(Path(file).read_text().strip())
            keys[scope_id(key).hex()] = key
        except (OSError, ValueError) as exc:
            raise ConfigError(f"instance.scope_keys: {file}: {exc}") from exc
    return keys


def build_sessions(
    config: Config,
    settings: InstanceSettings,
    store: TieredStore,
    prefetcher: Prefetcher,
    holders: HolderClient,
    controller: ControllerClient | None,
    lifecycle: Lifecycle,
    load: Load,
) -> Sessions:
    """The instance's engine and its sessions ([instance] engine)."""
    from .instance.sessions import Sessions

    cfg = config.instance
    try:
        from .instance.reference import ReferenceEngine
    except ImportError as exc:
        raise ConfigError(f"instance.engine: the engine extra is not installed ({exc})") from exc
    directory = engine_directory(config)
    try:
        engine = ReferenceEngine(
            directory, block_tokens=cfg.block_tokens, seed=cfg.engine_seed, device=cfg.engine_device
        )
    except ImportError as exc:  # torch, transformers: imported when the engine is made
        raise ConfigError(
            f"instance.engine: the reference engine needs {exc.name or exc}, "
            "which is not installed (pip install 'kvsp-kvstore[engine]')"
        ) from None
    log.info("engine %s, compat_id %s", engine.descriptor.model, engine.descriptor.compat_id_hex)
    scope_keys = read_scope_keys(cfg.scope_keys)
    if not scope_keys:
        log.warning("instance.scope_keys: none; no session can start")
    return Sessions(
        settings,
        engine,
        store,
        scope_keys,
        lifecycle,
        load,
        prefetcher=prefetcher,
        controller=controller,
        holders=holders,
    )


def engine_directory(config: Config) -> str:
    """Where the instance's engine keeps its weights and tokenizer (made on first use)."""
    return config.instance.engine_dir or str(config.root / ".kvstore" / "engine")


def _block_tokens(files: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for file in files:
        descriptor = parse_descriptor(json.loads(Path(file).read_text()))
        out[descriptor.compat_id_hex] = descriptor.block_tokens
    return out


def build_index(
    config: Config, statuses: StatusSource | None = None
) -> tuple[Starlette, IndexState]:
    """The Index Service app and its state."""
    from .index import MemoryState
    from .index import create_app as create_index

    cfg = config.index
    state: IndexState
    if cfg.state == "memory":
        state = MemoryState(max_records=cfg.max_records)
    elif cfg.state == "redis":
        from .index.redis_state import RedisState

        state = RedisState(cfg.redis_url, cfg.redis_prefix, cluster=cfg.redis_cluster)
    elif cfg.state == "replicated":
        from .index.replicated import ReplicatedState

        state = ReplicatedState(
            cfg.redis_url,
            cfg.redis_prefix,
            cluster=cfg.redis_cluster,
            max_records=cfg.max_records,
            max_ttl_ms=cfg.max_ttl_ms,
        )
    else:
        raise ConfigError(f"index.state: {cfg.state!r} is not memory, redis or replicated")
    settings = dataclasses.replace(
        cfg,
        block_tokens=_block_tokens(cfg.descriptors),
        allow_anonymous=config.server.insecure_http,
    )
    return create_index(settings, state, Policy.load(cfg.policy), statuses), state


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
        if index_in_process(config, roles):
            # The PC's placer asks this process's IS directly (issue 20).
            from .index.local import LocalIndex

            local = LocalIndex(index_state, role_of(index_app).counters)
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
    """Other libraries at WARNING; kvstore's own lines at server.log_level
    (INFO: normal events, WARNING: what an operator should look at)."""
    who = f"[worker {seat.index}] " if seat is not None else ""
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s %(name)s {who}%(message)s"
    )
    logging.getLogger("kvstore").setLevel(config.server.log_level.upper())


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
