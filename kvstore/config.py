"""Configuration files (TOML): strict, every key typed, unknown keys are errors.

The role tables are the roles' own settings (:mod:`kvstore.settings`), the
one definition of their keys, types and defaults; ``[server]`` and
``[storage]`` are defined here. docs/configuration.md lists every key (and
is tested against these classes). A holder's file, with its usual keys and
their defaults::

    [server]
    host = "127.0.0.1"
    port = 8443
    certfile = "certs/server.pem"     # TLS 1.3 with client certificates (H1)
    keyfile = "certs/server.key"
    cafile = "certs/ca.pem"           # CA that signs client certificates
    insecure_http = false             # plain HTTP: loopback only, logged loudly
    http2 = false                     # offer HTTP/2 by ALPN (uvicorn's experimental zttp)
    shutdown_grace_s = 7.0            # SIGTERM: the whole stop within about this
    header_timeout_s = 10.0           # a request's headers must arrive within this
    log_level = "info"                # kvstore's own log lines: debug|info|warning|error
    log_format = "text"               # or "json": one object a line (docs/operations.md)
    access_log = true                 # one INFO line per request (principal, peer, status)
    workers = 1                       # holder processes, one per core ("auto": every
                                      # core); worker i on port + i (docs/workers.md)
    unix_socket = ""                  # also plain HTTP on this socket, for a proxy that
    trusted_proxy = ""                # terminates TLS: "unix" or a loopback address
                                      # whose client-identity header is believed
    trusted_proxy_header = "x-client-cert"  # or "x-forwarded-client-cert" (docs/proxy.md)
    proxy_port = 0                    # also plain HTTP on this loopback port, for a
                                      # proxy that connects over TCP (Istio); 0: none
    trusted_proxy_uid = -1            # the user id owning the proxy's TCP socket
                                      # (Istio: 1337); -1: not checked
    health_port = 0                   # /healthz and /readyz in plain HTTP for probes
                                      # without a certificate (Kubernetes); 0: off
    health_host = ""                  # its address; empty: every address
    reload_check_s = 10.0             # certificates and policies changed on disk are
                                      # read again (SIGHUP: at once); 0: SIGHUP only

    [holder]
    uri = "https://127.0.0.1:8443/kvsp/"   # public base URI (H7)
    policy = "policy.json"                 # principals -> roles and scopes (SEC1)
    descriptors = []                       # descriptor files: PUTs checked against them
    descriptors_only = true                # with descriptors: other compat_ids refused (409)
    replica_ttl_ms = 600000
    max_block_octets = 67108864
    body_timeout_base_s = 10.0             # a PUT's body: within this + size / the rate
    body_min_octets_per_s = 1048576        # (slow uploads are cut off, 408)
    index_uri = ""                         # Index Service to publish to (P1); empty: none
    client_certfile = ""                   # the holder's client certificate for the IS
    client_keyfile = ""

    [index]                           # the Index Service role (--roles index)
    uri = "https://127.0.0.1:8443/is/"
    policy = "policy.json"
    state = "memory"                  # memory | redis
    redis_url = "redis://127.0.0.1:6379/0"
    redis_prefix = "kvsp-index:"
    max_records = 1000000             # memory state cap
    max_ttl_ms = 600000
    max_lookup_keys = 8192
    descriptors = []                  # block_tokens per compat_id, for estimates

    [controller]                      # the Placement Controller role (--roles pc)
    uri = "https://127.0.0.1:8443/pc/"
    policy = "policy.json"
    sleep_idle_s = 60.0               # idle this long before a sleep request is accepted
    sleep_max_running = 0
    sleep_max_queued = 0
    index_uri = ""                    # the IS to look prompts up in (POST place)
    client_certfile = ""              # the PC's client certificate for the IS
    client_keyfile = ""
    descriptors = []                  # block_tokens per compat_id
    mean_service_ms = 0.0             # wait_us = queued x this (PL1)
    state = "memory"                  # memory | redis: shared by PC processes, and
                                      # read by an IS in another process (L2)
    redis_url = "redis://127.0.0.1:6379/0"
    redis_prefix = "kvsp-pc:"
    max_sessions = 100000
    max_sessions_per_instance = 10000
    prefetch = false                  # send the chosen instance a prefetch directive (PF1)
    prefetch_deadline_ms = 50
    prefetch_lease_ms = 2000
    migrate_interval_s = 0.5          # look for failed instances' sessions (CK5)
    session_idle_s = 600.0            # a session idle this long is not resumed
    start_command = ""                # PL3: starts an instance, prints its base URI
    start_above_ms = 0.0              # ... when the cheapest costs more (0: when none)
    start_timeout_s = 60.0
    start_cooldown_s = 30.0
                                      # (client_certfile also authenticates the PC
                                      # to instances: directives, resume, SEC1)

    [instance]                        # the Inference Instance role (--roles instance)
    uri = "https://127.0.0.1:8443/ii/"
    policy = "policy.json"            # directives only from principals with role "pc"
    controller_uri = ""               # the PC to report status to (S1); empty: none
    index_uri = ""                    # the IS, for records that verify every layer
    client_certfile = ""              # the instance's certificate for the PC and holders
    client_keyfile = ""
    status_ttl_ms = 3000              # reported every third of it
    sleep_idle_s = 0.0                # ask to sleep after this long idle (0: never)
    max_pending_directives = 16       # PF5
    prefill_tokens_per_s = 0.0        # reported until the engine measures its own
    decode_tokens_per_s = 0.0
                                      # (its blocks live in [storage]; with --roles
                                      # holder,instance the holder serves them)
    engine = ""                       # "reference": sessions on the reference engine
    engine_dir = ""                   # its weights and tokenizer (made on first use)
    engine_seed = 0
    engine_device = "cpu"             # or "cuda"
    block_tokens = 16
    scope_keys = []                   # files, each a scope key in hex (>= 32 octets)
    store_blocks_to = []              # holder URIs every completed block goes to (CK1)
    checkpoint_tokens = 32            # at most 64 (CK1)
    release_tokens = 4                # non-deterministic samplers: tokens per ack (CK3)
    max_sessions = 64
    max_running = 8                   # sessions decoding at once; the rest queue
    max_prompt_tokens = 4096
    max_output_tokens = 2048
    resume_deadline_ms = 4000         # a resume's restore (under the PC's 5 s)
    token_interval_ms = 0.0           # least time between a session's tokens
    greedy_deterministic = false      # claim greedy output bit-identical (R4, CK3)

    [storage]
    encryption_key_file = ""          # 32 raw octets; empty: no encryption at rest
    compress = false
    fast_layers = 0                   # 0: no split
    promote = true
    write_through = false             # PUT acknowledged once in a persistent tier
    demote_above = 0.9                # high watermark: drain a tier above this fill (0: off)
    demote_to = 0.0                   # low watermark: a drain stops there (0: 0.9 x above)
    lease_max_ttl_ms = 60000
    lease_max_octets_per_client = 8589934592
    verify_reads = false              # check every layer of every persistent read
    retry_after_s = 5.0               # a tier that failed is skipped this long
    retention_s = 0.0                 # blocks older than this leave every tier (0: kept)
    owner_ttl_s = 30.0                # a crashed holder's Redis/S3 prefix frees after this
    recover_first = false             # true: recover every block before listening

    [[storage.tiers]]                 # fastest first
    backend = "host"                  # device | host | lmdb | redis | s3
    capacity = 1073741824             # octets
    # further keys are the backend's options (path, url, bucket, ...)

Relative paths are resolved against the file's directory.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.backends.schema import SCHEMAS, OptionError, check_options, parse_size
from kvstore.storage.settings import StoreSettings

from .cores import available_cores
from .logs import FORMATS
from .settings import (
    ControllerSettings,
    HolderSettings,
    IndexSettings,
    InstanceSettings,
    is_key,
)


class ConfigError(ValueError):
    """A configuration file is wrong; the message names the key's path."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8443
    certfile: str = ""
    keyfile: str = ""
    cafile: str = ""
    insecure_http: bool = False
    http2: bool = False
    shutdown_grace_s: float = 7.0
    header_timeout_s: float = 10.0
    log_level: str = "info"
    #: "text" or "json" (one object a line, the same fields): kvstore's
    #: lines, uvicorn's and the access log alike (kvstore.logs).
    log_format: str = "text"
    #: One INFO line per request on the ``kvstore.access`` logger: method,
    #: path, status, octets in and out, duration, principal and peer.
    access_log: bool = True
    #: Holder processes, one per core (docs/workers.md); "auto" in the file:
    #: the cores this process may use, counted when the file is read.
    workers: int = 1
    #: A second listener, plain HTTP on this socket file (mode 0660), for a
    #: TLS-terminating proxy on the same host (docs/proxy.md).
    unix_socket: str = ""
    #: The peer whose client-identity header is believed: "unix" (the
    #: unix_socket's connections) or a loopback address; empty: none.
    trusted_proxy: str = ""
    #: The header it sets: "x-client-cert" (nginx) or "x-forwarded-client-cert"
    #: (Envoy, Istio); the other one is refused.
    trusted_proxy_header: str = "x-client-cert"
    #: A second listener, plain HTTP on loopback (127.0.0.1, or ::1 for an
    #: IPv6 trusted_proxy) at this port, for a proxy that reaches the
    #: application over TCP, as an Istio sidecar does; worker i on
    #: proxy_port + i. Only trusted_proxy's requests carry an identity there.
    proxy_port: int = 0
    #: With a loopback trusted_proxy: the user id that must own the proxy's
    #: end of each TCP connection (any local process can connect from any
    #: loopback address); -1: not checked. Required with proxy_port.
    trusted_proxy_uid: int = -1
    #: Liveness and readiness (``/healthz``, ``/readyz``: a status word, no
    #: detail) in plain HTTP on this port, for probes that have no client
    #: certificate (a kubelet's httpGet); worker i on health_port + i. 0: off.
    health_port: int = 0
    #: The address it listens on; empty: every address (a pod's probes come
    #: to its IP).
    health_host: str = ""
    #: How often the listener's certificate, key and CA and the policies are
    #: looked at: changed files are read again without a restart (SIGHUP
    #: does the same at once); 0: only on SIGHUP.
    reload_check_s: float = 10.0


# The role sections are the roles' own settings (kvstore/settings.py): one
# definition of every key, its type and its default.
HolderConfig = HolderSettings
IndexConfig = IndexSettings
ControllerConfig = ControllerSettings
InstanceConfig = InstanceSettings


@dataclass(frozen=True, slots=True)
class TierConfig:
    backend: str
    capacity: int
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StorageConfig(StoreSettings):
    """The ``[storage]`` section: the store's settings (:class:`StoreSettings`,
    which the store takes whole) and what is not the store's own."""

    encryption_key_file: str = ""
    compress: bool = False
    #: One owner per storage: a Redis or S3 owner record lapses this long
    #: after its holder stops renewing it (a crash); renewed every third.
    owner_ttl_s: float = 30.0
    #: Recover every stored block before listening (the old way: a large
    #: tier keeps the holder silent for minutes). Off: serve at once and
    #: recover in the background, blocks not reached yet found on demand.
    recover_first: bool = False
    tiers: tuple[TierConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = ServerConfig()
    holder: HolderSettings = field(default_factory=HolderSettings)
    index: IndexSettings = field(default_factory=IndexSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    instance: InstanceSettings = field(default_factory=InstanceSettings)
    storage: StorageConfig = StorageConfig()
    #: Directory relative paths are resolved against.
    root: Path = Path(".")
    #: The sections the file has (config check's roles, serve's warning).
    sections: frozenset[str] = frozenset()

    def roles_of_sections(self) -> tuple[str, ...]:
        """The roles whose sections the file has, in ROLE_SECTIONS's order."""
        return tuple(r for r, s in ROLE_SECTIONS.items() if s in self.sections)

    def path(self, value: str) -> Path:
        return (self.root / value).resolve() if value else Path()


_PATH_KEYS = {
    "certfile",
    "keyfile",
    "cafile",
    "policy",
    "encryption_key_file",
    "client_certfile",
    "client_keyfile",
    "engine_dir",
    "unix_socket",
}
#: Arrays of URIs, not of paths.
_URI_LISTS = {"store_blocks_to"}


def _section(cls: type, data: Any, where: str, root: Path) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a table")
    known = {f.name: f for f in fields(cls) if is_key(f)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known or key == "tiers":
            raise ConfigError(f"{where}.{key}: unknown key; known: {sorted(known)}")
        default = known[key].default
        expected = type(default) if default is not None else str
        if (cls, key) == (ServerConfig, "workers") and value == "auto":
            value = available_cores()
        if expected is tuple:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}.{key}: must be an array of strings")
            value = tuple(v if key in _URI_LISTS else str(root / v) for v in value)
        elif expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif expected is int and "octets" in key and isinstance(value, str):
            try:
                value = parse_size(value, f"{where}.{key}")  # "8GiB" as well as octets
            except OptionError as exc:
                raise ConfigError(str(exc)) from None
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{where}.{key}: must be {expected.__name__}, got {value!r}")
        if key in _PATH_KEYS and value:
            value = str(root / value)
        values[key] = value
    return cls(**values)


LOG_LEVELS = ("debug", "info", "warning", "error")


def parse(data: dict[str, Any], root: Path = Path(".")) -> Config:
    """Validate a parsed TOML document."""
    unknown = set(data) - {"server", "holder", "index", "controller", "instance", "storage"}
    if unknown:
        raise ConfigError(
            f"{sorted(unknown)[0]}: unknown section; known: controller, holder, index, "
            "instance, server, storage"
        )
    storage_data = dict(data.get("storage", {}))
    tiers_data = storage_data.pop("tiers", [])
    storage = _section(StorageConfig, storage_data, "storage", root)
    if not isinstance(tiers_data, list) or (not tiers_data and "storage" in data):
        raise ConfigError("storage.tiers: at least one [[storage.tiers]] is required")
    tiers = []
    for index, raw in enumerate(tiers_data):
        where = f"storage.tiers[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must be a table")
        options = dict(raw)
        backend = options.pop("backend", None)
        capacity = options.pop("capacity", None)
        if not isinstance(backend, str):
            raise ConfigError(f"{where}.backend: required, one of device, host, lmdb, redis, s3")
        if capacity is None:
            raise ConfigError(f'{where}.capacity: required, a positive size (octets or "4GiB")')
        try:
            capacity = parse_size(capacity, f"{where}.capacity")
            if backend in SCHEMAS:  # typed by its schema; an unknown one: check() names it
                options = check_options(backend, options, where)
        except OptionError as exc:
            raise ConfigError(str(exc)) from None
        if capacity <= 0:
            raise ConfigError(f"{where}.capacity: must be positive, got {capacity}")
        if "path" in options:
            options["path"] = str(root / options["path"])
        tiers.append(TierConfig(backend, capacity, options))
    server = _section(ServerConfig, data.get("server", {}), "server", root)
    if server.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"server.log_level: one of {', '.join(LOG_LEVELS)}, not {server.log_level!r}"
        )
    if server.log_format not in FORMATS:
        raise ConfigError(
            f"server.log_format: one of {', '.join(FORMATS)}, not {server.log_format!r}"
        )
    return Config(
        server=server,
        holder=_section(HolderConfig, data.get("holder", {}), "holder", root),
        index=_section(IndexConfig, data.get("index", {}), "index", root),
        controller=_section(ControllerConfig, data.get("controller", {}), "controller", root),
        instance=_section(InstanceConfig, data.get("instance", {}), "instance", root),
        storage=StorageConfig(**{**_asdict(storage), "tiers": tuple(tiers)}),
        root=root,
        sections=frozenset(data),
    )


#: Backends whose segments outlive the process (write_through needs one).
PERSISTENT_BACKENDS = frozenset({"lmdb", "redis", "s3"})
#: Where each role's settings are.
ROLE_SECTIONS = {"holder": "holder", "index": "index", "pc": "controller", "instance": "instance"}


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """A host name or address of this machine only (plain HTTP is refused elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(config: Config, roles: Sequence[str]) -> list[str]:
    """Every invariant of the values the ``roles`` need, each broken one named
    by its key (STYLE 16: they are checked here only). ``kvstore serve``
    refuses to start on the first; ``kvstore config check`` lists them all.
    What needs a file read (policies, descriptors, keys, certificates) is
    checked where the file is read."""
    out: list[str] = []
    for role in roles:
        if role not in ROLE_SECTIONS:
            return [f"roles: {role!r} unknown; available: {', '.join(ROLE_SECTIONS)}"]
        if not getattr(config, ROLE_SECTIONS[role]).policy:
            out.append(f"{ROLE_SECTIONS[role]}.policy: a policy file is required")
    if "holder" in roles or "instance" in roles:
        out += _check_storage(config.storage, max(1, config.server.workers))
    for section, role, states in (
        ("index", "index", ("memory", "redis", "replicated")),
        ("controller", "pc", ("memory", "redis")),
    ):
        state = getattr(config, section).state
        if role in roles and state not in states:
            out.append(f"{section}.state: {state!r} is not one of {', '.join(states)}")
    if "instance" in roles:
        out += _check_instance(config.instance)
    out += _check_limits(config, roles)
    server = config.server
    if server.workers < 1:
        out.append('server.workers: at least 1 (or "auto": one per core)')
    elif server.workers > 1:
        if tuple(roles) != ("holder",):
            out.append(
                f"server.workers: {server.workers} workers serve the holder role alone "
                f"(roles given: {','.join(roles)}); run the index, pc and instance "
                "roles in processes of their own"
            )
        if server.port == 0:
            out.append("server.port: workers listen on consecutive ports from it; not 0")
        if server.port + server.workers - 1 > 65535:
            out.append(f"server.port: {server.workers} workers from {server.port} pass 65535")
    out += _check_proxy(server)
    if server.insecure_http:
        if not is_loopback(server.host):
            out.append("server.insecure_http: refused on a non-loopback address")
        if server.http2:
            out.append("server.http2: offered by ALPN, so only with TLS")
    else:
        missing = [key for key in ("certfile", "keyfile", "cafile") if not getattr(server, key)]
        out += [f"server.{key}: required unless insecure_http = true" for key in missing]
    return out


def _check_proxy(server: ServerConfig) -> list[str]:
    """``unix_socket`` and ``trusted_proxy`` (docs/proxy.md)."""
    out: list[str] = []
    trusted = server.trusted_proxy
    if server.unix_socket and trusted != "unix":
        out.append('server.unix_socket: serves a proxy; set trusted_proxy = "unix"')
    if trusted == "unix" and not server.unix_socket:
        out.append('server.trusted_proxy: "unix" needs server.unix_socket')
    if trusted and trusted != "unix" and (trusted == "localhost" or not is_loopback(trusted)):
        out.append(
            f'server.trusted_proxy: {trusted!r}: "unix" or a loopback IP address only '
            "(a header from another host could be forged on the way)"
        )
    if server.trusted_proxy_header not in ("x-client-cert", "x-forwarded-client-cert"):
        out.append(
            f"server.trusted_proxy_header: {server.trusted_proxy_header!r}; one of "
            "x-client-cert (nginx), x-forwarded-client-cert (Envoy, Istio)"
        )
    if server.proxy_port:
        if not trusted or trusted == "unix":
            out.append(
                "server.proxy_port: serves a proxy over TCP; set trusted_proxy to "
                "its loopback address (127.0.0.6 for an Istio sidecar)"
            )
        if server.trusted_proxy_uid < 0:
            out.append(
                "server.proxy_port: set trusted_proxy_uid, the user id of the proxy "
                "(Istio's sidecar: 1337): any local process can connect from "
                "any loopback address"
            )
        count = max(1, server.workers)
        ours = set(range(server.proxy_port, server.proxy_port + count))
        if not 0 < server.proxy_port <= 65536 - count:
            out.append(
                f"server.proxy_port: {server.proxy_port}: a port, 1-65535, "
                "with room for every worker's"
            )
        elif ours & set(range(server.port, server.port + count)):
            out.append("server.proxy_port: overlaps the TLS listener's ports")
    if server.health_port:
        count = max(1, server.workers)
        ours = set(range(server.health_port, server.health_port + count))
        taken = set(range(server.port, server.port + count))
        if server.proxy_port:
            taken |= set(range(server.proxy_port, server.proxy_port + count))
        if not 0 < server.health_port <= 65536 - count:
            out.append(
                f"server.health_port: {server.health_port}: a port, 1-65535, "
                "with room for every worker's"
            )
        elif ours & taken:
            out.append("server.health_port: overlaps the TLS listener's or the proxy's ports")
    if server.reload_check_s < 0:
        out.append("server.reload_check_s: seconds, 0 or more (0: on SIGHUP only)")
    if server.health_host and not _is_address(server.health_host):
        out.append(f"server.health_host: {server.health_host!r}: an IP address (empty: every one)")
    if trusted and server.insecure_http:
        out.append(
            "server.trusted_proxy: not with insecure_http (a request without the "
            "proxy's header would be anonymous)"
        )
    return out


def _check_storage(cfg: StorageConfig, workers: int = 1) -> list[str]:
    from kvstore.backends import BACKENDS
    from kvstore.backends.schema import missing_extra

    out: list[str] = []
    if not cfg.tiers:
        out.append("storage.tiers: at least one [[storage.tiers]] is required")
    for index, tier in enumerate(cfg.tiers):
        if tier.backend not in BACKENDS:
            out.append(
                f"storage.tiers[{index}].backend: {tier.backend!r} is an unknown "
                f"backend; known: {', '.join(sorted(BACKENDS))}"
            )
            continue
        if (extra := missing_extra(tier.backend)) is not None:
            out.append(f"storage.tiers[{index}].backend: {extra}")
        map_size = tier.options.get("map_size", SCHEMAS["lmdb"]["map_size"].default)
        share = tier.capacity // workers  # each worker's own environment holds its share
        if tier.backend == "lmdb" and map_size <= share:
            # LMDB never grows its map: a capacity above it fills the map
            # first, and PUTs fail as "full" with room left by the count.
            each = f" (of each of {workers} workers)" if workers > 1 else ""
            out.append(
                f"storage.tiers[{index}].map_size: {map_size} octets, not above its "
                f"capacity{each} of {share}; LMDB's map must exceed the capacity "
                "(leave room for layer tables: capacity + 10%)"
            )
        deadline = tier.options.get("deadline_s")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float) or deadline <= 0
        ):
            out.append(f"storage.tiers[{index}].deadline_s: a positive number of seconds")
    if not cfg.owner_ttl_s > 0:
        out.append("storage.owner_ttl_s: a positive number of seconds")
    out += [f"storage.{problem}" for problem in cfg.problems()]
    if cfg.write_through and not any(t.backend in PERSISTENT_BACKENDS for t in cfg.tiers[1:]):
        out.append(
            "storage.write_through: needs a persistent tier (lmdb, redis, s3) below the first one"
        )
    return out


#: Keys that must be at least 1 (a limit of 0 would refuse everything, a
#: deadline of 0 would give up at once), by section.
_AT_LEAST_ONE = {
    "holder": ("max_block_octets", "max_json_octets", "max_lease_keys", "replica_ttl_ms"),
    "index": ("max_json_octets", "max_targets", "max_lookup_keys", "max_ttl_ms"),
    "controller": ("max_json_octets", "max_place_keys", "max_checkpoint_octets"),
    "instance": (
        "max_json_octets",
        "max_directive_blocks",
        "load_deadline_ms",
        "resume_deadline_ms",
    ),
}


def _check_limits(config: Config, roles: Sequence[str]) -> list[str]:
    out = []
    for role in roles:
        section = ROLE_SECTIONS[role]
        for key in _AT_LEAST_ONE[section]:
            if getattr(getattr(config, section), key) < 1:
                out.append(f"{section}.{key}: at least 1")
    return out


def _check_instance(cfg: InstanceConfig) -> list[str]:
    out: list[str] = []
    if cfg.status_ttl_ms < 300:
        out.append("instance.status_ttl_ms: at least 300 (reports go every third of it)")
    if cfg.max_pending_directives < 1:
        out.append("instance.max_pending_directives: at least 1")
    if cfg.engine not in ("", "reference"):
        out.append(f"instance.engine: {cfg.engine!r}; available: reference")
    if cfg.engine:
        if not 1 <= cfg.checkpoint_tokens <= 64:
            out.append("instance.checkpoint_tokens: 1 to 64 (CK1)")
        if cfg.release_tokens < 1 or cfg.max_sessions < 1 or cfg.max_running < 1:
            out.append("instance.release_tokens, max_sessions, max_running: at least 1")
        if cfg.block_tokens < 1:
            out.append("instance.block_tokens: at least 1")
    return out


def _asdict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


ENV_PREFIX = "KVSTORE_"
_SECTIONS = ("server", "holder", "index", "controller", "instance", "storage")
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _section_classes() -> dict[str, type]:
    return {
        "server": ServerConfig,
        "holder": HolderConfig,
        "index": IndexConfig,
        "controller": ControllerConfig,
        "instance": InstanceConfig,
        "storage": StorageConfig,
    }


def _env_value(name: str, raw: str, default: Any) -> Any:
    """``raw`` as the type of the key's default (the key's own type, not a guess)."""
    try:
        if isinstance(default, bool):
            if raw.strip().lower() not in _TRUE | _FALSE:
                raise ValueError("true or false")
            return raw.strip().lower() in _TRUE
        if isinstance(default, int):
            return int(raw.strip())
        if isinstance(default, float):
            value = float(raw.strip())
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError("a finite number")
            return value
        if isinstance(default, tuple):
            return [v.strip() for v in raw.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"{name}: {raw!r} is not {type(default).__name__} ({exc})") from None
    return raw


def apply_environment(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVSTORE_<SECTION>__<KEY>=value`` (two underscores) overrides
    ``[section] key``, the value read as the key's type (booleans true/false,
    numbers, arrays as comma-separated lists): ``KVSTORE_SERVER__PORT=9443``,
    ``KVSTORE_HOLDER__INDEX_URI=https://is:8443/is/``. Other ``KVSTORE_*``
    names (``KVSTORE_PORT``, which Kubernetes sets for a Service named
    kvstore) are not ours and are left alone. Tiers are set in the file."""
    classes = _section_classes()
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if section not in _SECTIONS:
            raise ConfigError(f"{name}: {section!r} is not a section ({', '.join(_SECTIONS)})")
        known = {f.name: f.default for f in fields(classes[section]) if is_key(f)}
        if key not in known or key == "tiers":
            raise ConfigError(
                f"{name}: {section}.{key}: unknown key; known: "
                f"{sorted(k for k in known if k != 'tiers')}"
            )
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: must be a table")
        auto = (section, key, raw.strip()) == ("server", "workers", "auto")
        target[key] = "auto" if auto else _env_value(name, raw, known[key])
    return out


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """A configuration file, with the environment's overrides (``KVSTORE_...``)."""
    import os

    file = Path(path)
    try:
        data = tomllib.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: {exc}") from exc
    data = apply_environment(data, os.environ if environ is None else environ)
    return parse(data, file.resolve().parent)
