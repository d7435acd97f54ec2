"""The parts of each role, built from a configuration: the store, the
holder's publisher, the PC's state, the instance's engine and sessions, the
IS's state, and each role's app (:mod:`.serve` composes and runs them)."""

from __future__ import annotations

import dataclasses
import json
import logging
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from .config import Config, ConfigError
from .holder import create_app
from .lifespan import Listening, Shutdown
from .protocol.compat import parse_descriptor
from .protocol.problems import KvspError
from .seams import Lookups
from .security import Policy
from .storage import SegmentSealer, TieredStore

if TYPE_CHECKING:
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
    ``client_keyfile`` (SEC1), with the server's CA; None when not set.
    A reload (SIGHUP, its files changed) gives it the files again."""
    from .tls import reloadable_client_context

    if not (cfg.client_certfile and cfg.client_keyfile and config.server.cafile):
        return None
    return reloadable_client_context(config.server.cafile, cfg.client_certfile, cfg.client_keyfile)


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
    from .integrations.options import read_scope_key
    from .protocol.keys import scope_id

    keys = [read_scope_key(file, "scope_keys", prefix="instance.") for file in files]
    return {scope_id(key).hex(): key for key in keys}


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
    residency = None
    if cfg.state in ("redis", "replicated"):
        # Residency shared by every IS process of this Redis (docs/events.md).
        from .index.shared_residency import SharedResidency

        residency = SharedResidency(
            cfg.redis_url,
            cfg.redis_prefix,
            cluster=cfg.redis_cluster,
            max_records=cfg.max_records,
            max_ttl_ms=cfg.max_ttl_ms,
        )
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
    app = create_index(settings, state, Policy.load(cfg.policy), statuses, residency)
    return app, state
