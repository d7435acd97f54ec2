"""Build roles from a configuration and run them under uvicorn (``kvstore serve``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import shlex
import ssl
import time
from pathlib import Path
from typing import Any

from .config import Config, ConfigError
from .holder import HolderSettings, create_app
from .protocol.compat import parse_descriptor
from .security import Policy
from .storage import LeaseLimits, SegmentSealer, TieredStore

log = logging.getLogger("kvstore.serve")


def build_store(config: Config) -> TieredStore:
    """The TieredStore a configuration describes (backends imported lazily)."""
    from backends import create_tier

    cfg = config.storage
    if not cfg.tiers:
        raise ConfigError("storage.tiers: at least one [[storage.tiers]] is required")
    key = None
    if cfg.encryption_key_file:
        key = Path(cfg.encryption_key_file).read_bytes()
        if len(key) != 32:
            raise ConfigError("storage.encryption_key_file: must hold exactly 32 octets")
    tiers = []
    for index, tier in enumerate(cfg.tiers):
        options = dict(tier.options)
        deadline = options.pop("deadline_s", None)  # the manager's, not the backend's
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float) or deadline <= 0
        ):
            raise ConfigError(f"storage.tiers[{index}].deadline_s: a positive number of seconds")
        try:
            made = create_tier(tier.backend, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"storage.tiers[{index}]: {exc}") from exc
        if deadline is not None:
            made.deadline_s = float(deadline)
        tiers.append((made, tier.capacity))
    if not 0 <= cfg.demote_above < 1:
        raise ConfigError("storage.demote_above: a fraction of a tier's capacity, "
                          "0 <= x < 1 (0: off)")  # fmt: skip
    if cfg.write_through and not any(t.persistent for t, _ in tiers[1:]):
        raise ConfigError("storage.write_through: needs a persistent tier (lmdb, redis, s3) "
                          "below the first one")  # fmt: skip
    return TieredStore(
        tiers,
        sealer=SegmentSealer(key, compress=cfg.compress),
        lease_limits=LeaseLimits(
            max_octets_per_client=cfg.lease_max_octets_per_client,
            max_ttl_ms=cfg.lease_max_ttl_ms,
        ),
        promote=cfg.promote,
        write_through=cfg.write_through,
        demote_above=cfg.demote_above or None,
        fast_layers=cfg.fast_layers or None,
        retention_s=cfg.retention_s or None,
    )


def index_client(config: Config, section: str) -> Any:
    """An IndexClient for ``<section>.index_uri``, authenticating with the
    section's client certificate when the index is https; None when unset."""
    from .client import IndexClient
    from .security import client_context

    cfg = getattr(config, section)
    if not cfg.index_uri:
        return None
    context = None
    if cfg.index_uri.startswith("https:"):
        if not (cfg.client_certfile and cfg.client_keyfile and config.server.cafile):
            raise ConfigError(f"{section}.client_certfile: required for an https index")
        context = client_context(config.server.cafile, cfg.client_certfile, cfg.client_keyfile)
    return IndexClient(cfg.index_uri, context)


def build_publisher(config: Config, store: TieredStore) -> Any:
    """An IndexPublisher when ``holder.index_uri`` is set, else None."""
    from .holder.publisher import IndexPublisher

    index = index_client(config, "holder")
    if index is None:
        return None
    return IndexPublisher(index, store, config.holder.uri, config.holder.replica_ttl_ms)


def build_holder(config: Config, store: TieredStore, publisher: Any = None) -> Any:
    cfg = config.holder
    if not cfg.policy:
        raise ConfigError("holder.policy: a policy file is required")
    descriptors = {}
    for file in cfg.descriptors:
        descriptor = parse_descriptor(json.loads(Path(file).read_text()))
        descriptors[descriptor.compat_id_hex] = descriptor
    settings = HolderSettings(
        holder_uri=cfg.uri,
        max_block_octets=cfg.max_block_octets,
        body_timeout_base_s=cfg.body_timeout_base_s,
        body_min_octets_per_s=cfg.body_min_octets_per_s,
        replica_ttl_ms=cfg.replica_ttl_ms,
        descriptors=descriptors,
        allow_anonymous=config.server.insecure_http,
    )
    return create_app(settings, store, Policy.load(cfg.policy), publisher)


def controller_state(config: Config) -> Any:
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

        return RedisControllerState(cfg.redis_url, cfg.redis_prefix, **rules)
    raise ConfigError(f"controller.state: {cfg.state!r} is not 'memory' or 'redis'")


def build_controller(config: Config, state: Any) -> Any:
    """The Placement Controller app over ``state``."""
    from .controller.app import ControllerSettings
    from .controller.app import create_app as create_controller

    cfg = config.controller
    if not cfg.policy:
        raise ConfigError("controller.policy: a policy file is required")
    index = index_client(config, "controller")
    settings = ControllerSettings(
        cfg.uri,
        allow_anonymous=config.server.insecure_http,
        block_tokens=_block_tokens(cfg.descriptors),
        mean_service_ms=cfg.mean_service_ms,
        prefetch=cfg.prefetch,
        prefetch_deadline_ms=cfg.prefetch_deadline_ms,
        prefetch_lease_ms=cfg.prefetch_lease_ms,
        migrate_interval_s=cfg.migrate_interval_s,
        session_idle_s=cfg.session_idle_s,
        start_command=tuple(shlex.split(cfg.start_command)),
        start_above_ms=cfg.start_above_ms,
        start_timeout_s=cfg.start_timeout_s,
        start_cooldown_s=cfg.start_cooldown_s,
    )
    return create_controller(
        settings, state, Policy.load(cfg.policy), index, instance_client(config)
    )


def instance_client(config: Config) -> Any:
    """The PC's client of instances, with its client certificate (SEC1)."""
    from .client import InstanceClient
    from .security import client_context

    cfg = config.controller
    context = None
    if cfg.client_certfile and cfg.client_keyfile and config.server.cafile:
        context = client_context(config.server.cafile, cfg.client_certfile, cfg.client_keyfile)
    # Short: a hung instance must not hold up a placement's directive or a
    # migration round (each candidate that does not answer costs this long).
    return InstanceClient(context, timeout_s=5.0)


def build_instance(config: Config, store: TieredStore, publisher: Any) -> tuple[Any, list[Any]]:
    """The Inference Instance app over ``store``, and what to start and close
    with it (its status reporter, prefetcher and clients)."""
    from .client import ControllerClient, HolderClient, IndexClient
    from .instance.app import InstanceSettings, Lifecycle, create_app
    from .instance.prefetch import Prefetcher
    from .instance.reporter import Load, StatusReporter
    from .security import client_context

    cfg = config.instance
    if not cfg.policy:
        raise ConfigError("instance.policy: a policy file is required")
    if cfg.status_ttl_ms < 300:
        raise ConfigError("instance.status_ttl_ms: at least 300 (reports go every third of it)")
    if cfg.max_pending_directives < 1:
        raise ConfigError("instance.max_pending_directives: at least 1")
    if publisher is None:
        log.warning("instance without the holder role: prefetched blocks are not published")
    context = None
    if cfg.client_certfile and cfg.client_keyfile and config.server.cafile:
        context = client_context(config.server.cafile, cfg.client_certfile, cfg.client_keyfile)
    holders = HolderClient(context)
    index = IndexClient(cfg.index_uri, context) if cfg.index_uri else None
    prefetcher = Prefetcher(store, holders, publisher=publisher, index=index,
                            max_pending=cfg.max_pending_directives)  # fmt: skip
    lifecycle = Lifecycle()
    settings = InstanceSettings(cfg.uri, allow_anonymous=config.server.insecure_http)
    load = Load(prefill_tokens_per_s=cfg.prefill_tokens_per_s,
                decode_tokens_per_s=cfg.decode_tokens_per_s)  # fmt: skip
    controller = ControllerClient(cfg.controller_uri, context) if cfg.controller_uri else None
    sessions = None
    if cfg.engine:
        sessions = build_sessions(config, store, publisher, prefetcher, holders, controller,
                                  lifecycle, load)  # fmt: skip
    from .instance.shards import Shards

    policy = Policy.load(cfg.policy)
    shards = Shards(store, prefetcher, policy, cfg.block_tokens)
    app = create_app(settings, prefetcher, policy, lifecycle, sessions, shards)
    # Closed in this order: sessions before the prefetcher and clients they use.
    parts: list[Any] = [*([sessions] if sessions is not None else []), prefetcher, holders]
    parts += [index] if index is not None else []
    if controller is not None:
        reporter = StatusReporter(cfg.uri, controller, lifecycle, load, store,
                                  ttl_ms=cfg.status_ttl_ms,
                                  idle_s=cfg.sleep_idle_s or None)  # fmt: skip
        parts += [reporter, controller]
    return app, parts


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
    config: Config, store: TieredStore, publisher: Any, prefetcher: Any, holders: Any,
    controller: Any, lifecycle: Any, load: Any,
) -> Any:  # fmt: skip
    """The instance's engine and its sessions ([instance] engine)."""
    from .instance.sessions import Sessions, SessionSettings

    cfg = config.instance
    if cfg.engine != "reference":
        raise ConfigError(f"instance.engine: {cfg.engine!r}; available: reference")
    if not 1 <= cfg.checkpoint_tokens <= 64:
        raise ConfigError("instance.checkpoint_tokens: 1 to 64 (CK1)")
    if cfg.release_tokens < 1 or cfg.max_sessions < 1 or cfg.max_running < 1:
        raise ConfigError("instance.release_tokens, max_sessions, max_running: at least 1")
    if cfg.block_tokens < 1:
        raise ConfigError("instance.block_tokens: at least 1")
    try:
        from .instance.reference import ReferenceEngine
    except ImportError as exc:
        raise ConfigError(f"instance.engine: the engine extra is not installed ({exc})") from exc
    directory = engine_directory(config)
    engine = ReferenceEngine(directory, block_tokens=cfg.block_tokens, seed=cfg.engine_seed,
                             device=cfg.engine_device)  # fmt: skip
    log.info("engine %s, compat_id %s", engine.descriptor.model,
                engine.descriptor.compat_id_hex)  # fmt: skip
    scope_keys = read_scope_keys(cfg.scope_keys)
    if not scope_keys:
        log.warning("instance.scope_keys: none; no session can start")
    settings = SessionSettings(
        cfg.uri, checkpoint_tokens=cfg.checkpoint_tokens, release_tokens=cfg.release_tokens,
        max_sessions=cfg.max_sessions, max_running=cfg.max_running,
        max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens,
        resume_deadline_s=cfg.resume_deadline_ms / 1000, store_to=cfg.store_blocks_to,
        token_interval_s=cfg.token_interval_ms / 1000,
        greedy_deterministic=cfg.greedy_deterministic,
    )  # fmt: skip
    return Sessions(settings, engine, store, scope_keys, lifecycle, load,
                    prefetcher=prefetcher, publisher=publisher, controller=controller,
                    holders=holders)  # fmt: skip


def engine_directory(config: Config) -> str:
    """Where the instance's engine keeps its weights and tokenizer (made on first use)."""
    return config.instance.engine_dir or str(config.root / ".kvstore" / "engine")


def _block_tokens(files: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for file in files:
        descriptor = parse_descriptor(json.loads(Path(file).read_text()))
        out[descriptor.compat_id_hex] = descriptor.block_tokens
    return out


def build_index(config: Config, statuses: Any = None) -> tuple[Any, Any]:
    """The Index Service app and its state."""
    from .index import IndexSettings, MemoryState
    from .index import create_app as create_index

    cfg = config.index
    if not cfg.policy:
        raise ConfigError("index.policy: a policy file is required")
    state: Any
    if cfg.state == "memory":
        state = MemoryState(max_records=cfg.max_records)
    elif cfg.state == "redis":
        from .index.redis_state import RedisState

        state = RedisState(cfg.redis_url, cfg.redis_prefix)
    else:
        raise ConfigError(f"index.state: {cfg.state!r} is not 'memory' or 'redis'")
    block_tokens = _block_tokens(cfg.descriptors)
    settings = IndexSettings(
        cfg.uri,
        max_ttl_ms=cfg.max_ttl_ms,
        max_lookup_keys=cfg.max_lookup_keys,
        block_tokens=block_tokens,
        allow_anonymous=config.server.insecure_http,
    )
    return create_index(settings, state, Policy.load(cfg.policy), statuses), state


class Dispatcher:
    """Several role apps on one listener, chosen by their base paths (longest first);
    anything else (``/metrics``) goes to the first role."""

    def __init__(self, apps: list[tuple[str, Any]]) -> None:
        self.apps = sorted(apps, key=lambda item: -len(item[0]))
        self.default = apps[0][1]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        for base, app in self.apps:
            if path.startswith(base):
                await app(scope, receive, send)
                return
        await self.default(scope, receive, send)


class Health:
    """``/healthz`` (the process answers) and ``/readyz`` (every tier
    reachable, and for a holder the IS it publishes to), outside every KVSP
    base path, before the roles' apps; no role is needed (the TLS handshake
    still asks for a client certificate)."""

    def __init__(self, app: Any, store: TieredStore | None = None, publisher: Any = None) -> None:
        self.app, self.store, self.publisher = app, store, publisher

    def ready(self) -> tuple[bool, dict[str, Any]]:
        checks: dict[str, Any] = {}
        if self.store is not None:
            checks["tiers"] = {
                f"{i}:{t['tier']}": "degraded" if t["degraded"] else "ok"
                for i, t in enumerate(self.store.health())
            }
        if self.publisher is not None:
            checks["index"] = "ok" if self.publisher.index_reachable else "unreachable"
        flat = [*checks.get("tiers", {}).values(), checks.get("index", "ok")]
        return all(v == "ok" for v in flat), checks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if path not in ("/healthz", "/readyz"):
            await self.app(scope, receive, send)
            return
        ok, checks = (True, {}) if path == "/healthz" else self.ready()
        body = json.dumps({"status": "ok" if ok else "unavailable", **checks}).encode()
        await send({"type": "http.response.start", "status": 200 if ok else 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"cache-control", b"no-store"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGTERM / SIGINT end ``serve`` rather
        than the process: uvicorn raises the signal again once it stopped
        serving, which would kill the process before kvstore's own shutdown
        (withdrawals, closing the tiers) runs."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                self.stop_started = time.monotonic()
                log.info("stopping (signal %d): in-flight requests get %.0f s", sig,
                            self.config.timeout_graceful_shutdown or 0)  # fmt: skip
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def _ignore_signals() -> None:
    """During kvstore's own shutdown: SIGTERM / SIGINT are logged, not obeyed
    (uvicorn restored the default handlers, which would cut it short)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def noted(sig: int, frame: Any) -> None:
        log.warning("signal %d while stopping: finishing the shutdown first", sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noted)


def _Server(config: Any) -> Any:
    return _server_class()(config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(config: Config, app: Any) -> Any:
    import uvicorn

    from .tlsscope import http1_protocol

    server = config.server
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "http": http1_protocol(server.header_timeout_s),
        # SIGTERM: stop accepting, let in-flight requests finish this long.
        "timeout_graceful_shutdown": server.shutdown_grace_s,
    }
    if server.insecure_http:
        if not _is_loopback(server.host):
            raise ConfigError("server.insecure_http: refused on a non-loopback address")
        where = f"{server.host}:{server.port}"
        log.warning("PLAIN HTTP on %s: no TLS, no client identity (development only)", where)
    else:
        missing = [k for k in ("certfile", "keyfile", "cafile") if not getattr(server, k)]
        if missing:
            raise ConfigError(f"server.{missing[0]}: required unless insecure_http = true")
        options.update(
            ssl_certfile=server.certfile,
            ssl_keyfile=server.keyfile,
            ssl_ca_certs=server.cafile,
            ssl_cert_reqs=ssl.CERT_REQUIRED,  # H1: both sides authenticate
        )
    if server.http2:
        if server.insecure_http:
            raise ConfigError("server.http2: offered by ALPN, so only with TLS")
        try:
            from .tlsscope import http2_protocol

            options["http"] = http2_protocol()  # H1 SHOULD: h2 or http/1.1 by ALPN
        except ImportError as exc:
            raise ConfigError(f"server.http2: needs the http2 extra ({exc})") from exc
    uv = uvicorn.Config(app, log_level="warning", lifespan="off", **options)
    uv.load()
    if uv.ssl is not None:
        uv.ssl.minimum_version = ssl.TLSVersion.TLSv1_3  # H1: TLS 1.3 or later
    return uv


async def serve(config: Config, roles: tuple[str, ...] = ("holder",)) -> None:
    """Run the configured roles on one listener until interrupted."""
    from urllib.parse import urlsplit

    unknown = set(roles) - {"holder", "index", "pc", "instance"}
    if unknown or not roles:
        raise ConfigError(
            f"roles: {sorted(unknown) or roles} unknown; available: holder, index, pc, instance"
        )
    store = publisher = index_state = pc_state = migrator = starter = sweeper = None
    stopping: dict[str, Any] = {}
    instance_parts: list[Any] = []
    try:
        apps: list[tuple[str, Any]] = []
        if "holder" in roles or "instance" in roles:
            store = build_store(config)
            found = await store.recover()
            await store.measure_read_rates()
        if "holder" in roles:
            assert store is not None
            publisher = build_publisher(config, store)
            apps.append((urlsplit(config.holder.uri).path, build_holder(config, store, publisher)))
            log.info("holder %s: %d blocks recovered", config.holder.uri, found)
        if "instance" in roles:
            # Its blocks are in the store; with the holder role the holder
            # serves and publishes them (an instance is a holder of its tiers).
            assert store is not None
            instance_app, instance_parts = build_instance(config, store, publisher)
            apps.append((urlsplit(config.instance.uri).path, instance_app))
            log.info("instance %s", config.instance.uri)
        if "pc" in roles or ("index" in roles and config.controller.state == "redis"):
            # The IS estimates from the PC's instance status (L2): the PC's
            # state in this process, or the Redis PC processes share.
            pc_state = controller_state(config)
        if "pc" in roles:
            controller_app = build_controller(config, pc_state)
            migrator = controller_app.state.migrator
            starter = controller_app.state.starter
            apps.append((urlsplit(config.controller.uri).path, controller_app))
            log.info("controller %s (%s state)", config.controller.uri,
                        config.controller.state)  # fmt: skip
        if "index" in roles:
            index_app, index_state = build_index(config, pc_state)
            apps.append((urlsplit(config.index.uri).path, index_app))
            log.info("index %s (%s state)", config.index.uri, config.index.state)
        app = Health(apps[0][1] if len(apps) == 1 else Dispatcher(apps), store, publisher)
        server = _Server(uvicorn_config(config, app))
        stopping["server"] = server
        sweeper = None
        if store is not None and config.storage.retention_s > 0:
            from .storage.retention import RetentionSweeper

            sweeper = RetentionSweeper(store)
        background: list[Any] = [p for p in (publisher, migrator, sweeper) if p is not None]
        background += [p for p in instance_parts if hasattr(p, "start")]

        async def start_when_listening() -> None:
            # The publisher's first round republishes what was recovered, the
            # status reporter reports: both may talk to roles of this very
            # listener, so they start once it listens.
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.02)
            for part in background:
                part.start()

        starting = asyncio.create_task(start_when_listening(), name="kvstore-start")
        stopping["starting"] = starting
        scheme = "http" if config.server.insecure_http else "https"
        log.info("serving %s on %s://%s:%s", ",".join(roles), scheme, config.server.host,
                    config.server.port)  # fmt: skip
        await server.serve()
    finally:
        # One deadline for the whole stop (the signal started it): what the
        # listener's grace left goes to spilling and withdrawing, at least a
        # second each. A second signal meanwhile is logged, not obeyed.
        _ignore_signals()
        if "starting" in stopping:
            stopping["starting"].cancel()
        grace = config.server.shutdown_grace_s
        began = getattr(stopping.get("server"), "stop_started", None)
        left = max(0.0, grace - (time.monotonic() - began)) if began is not None else grace
        spill_s, withdraw_s = max(1.0, 0.6 * left), max(1.0, 0.4 * left)
        # Users first, then what they use: the instance's prefetches and
        # reports, the publisher, and only then the store and states. One
        # failing close does not skip the others.
        closes: list[Any] = []
        for part in instance_parts:
            closes.append(part.stop if hasattr(part, "stop") else part.close)
        if starter is not None:
            closes.append(starter.close)  # the instances it started go on
        if migrator is not None:
            closes += [migrator.stop, migrator.instances.close]
        if publisher is not None:
            closes.append(publisher.stop)
        if sweeper is not None:
            closes.append(sweeper.stop)
        if store is not None:
            # Graceful shutdown: what only memory holds goes down to a
            # persistent tier while there is room and time (a restart serves
            # it again) ...
            closes.append(lambda: store.spill(spill_s))
        if publisher is not None:
            # ... and the replicas that still do not survive the process
            # leave the IS; the rest stays published.
            # (withdrawals queued while the IS was away go too, P3)
            closes += [lambda: publisher.drain(withdraw_s / 2),
                       lambda: publisher.withdraw_volatile(withdraw_s / 2),
                       publisher.index.close]  # fmt: skip
        for closable in (store, index_state, pc_state):
            if closable is not None:
                closes.append(closable.close)
        for close in closes:
            try:
                await close()
            except Exception:
                log.exception("while shutting down")


def run(config: Config, roles: tuple[str, ...] = ("holder",)) -> None:
    # Other libraries at WARNING; kvstore's own lines at server.log_level
    # (INFO: normal events, WARNING: what an operator should look at).
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("kvstore").setLevel(config.server.log_level.upper())
    asyncio.run(serve(config, roles))
