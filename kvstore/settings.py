"""What each role runs with: the one definition of every role setting (STYLE 16).

Each class here is at once a role's settings (``create_app(settings, ...)``)
and a section of the configuration file (``[holder]``, ``[index]``,
``[controller]``, ``[instance]``): :mod:`kvstore.config` fills them from the
TOML file and the ``KVSTORE_<SECTION>__<KEY>`` overrides, checks the
invariants between values in one place (:func:`kvstore.config.check`), and
``docs/configuration.md`` is tested against these fields and defaults.

A field whose metadata is :data:`RUNTIME` is not a key of the file: it is
what ``kvstore serve`` derives for the role from other sections or from the
files a key names (the descriptors a file lists, plain-HTTP development
mode). Durations keep the unit of their key (``_ms``, ``_s``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from .protocol.compat import CompatibilityDescriptor

#: Metadata of a field that is not a key of the configuration file.
RUNTIME: Mapping[str, Any] = MappingProxyType({"config": False})

#: Whether an instance claims greedy decoding bit-identical on every instance
#: that may resume its sessions (R4 ``sampler.deterministic``). Off by default:
#: that holds only with batch-invariant kernels (a resume recomputes in one
#: batch what was decoded token by token), and with the claim tokens go out
#: before the PC acknowledges a checkpoint, so a migration could splice two
#: different continuations (CK3).
GREEDY_DETERMINISTIC = False


def base_path(uri: str) -> str:
    """The path of a role's base URI, with a trailing slash (H7)."""
    path = urlsplit(uri).path or "/"
    return path if path.endswith("/") else path + "/"


class _Role:
    """What every role's settings have: a base URI and its path."""

    __slots__ = ()
    uri: str

    @property
    def base_path(self) -> str:
        return base_path(self.uri)


def is_key(f: Any) -> bool:
    """Whether a dataclass field is a key of the configuration file."""
    return bool(f.metadata.get("config", True))


@dataclass(frozen=True, slots=True)
class HolderSettings(_Role):
    """``[holder]``: what a holder needs to know about itself."""

    #: Public base URI of this holder (H7), e.g. ``https://h1.example:8443/kvsp/``.
    uri: str = "https://127.0.0.1:8443/kvsp/"
    _: KW_ONLY  # everything but the URI by name
    policy: str = ""
    #: Compatibility Descriptor files: PUTs of their compat_ids are checked (B2).
    descriptors: tuple[str, ...] = ()
    #: With ``descriptors``: a PUT under any other compat_id is refused (409
    #: kvsp-incompatible). False: accepted unchecked, as with no descriptors.
    descriptors_only: bool = True
    #: TTL of the replica records it publishes; bounds Cache-Control max-age (BL5).
    replica_ttl_ms: int = 600_000
    #: Largest block PUT body accepted (413 beyond it).
    max_block_octets: int = 64 << 20
    #: A block's body must arrive within this plus its size at the rate below
    #: (slow-loris uploads are cut off with 408).
    body_timeout_base_s: float = 10.0
    body_min_octets_per_s: int = 1 << 20
    index_uri: str = ""
    client_certfile: str = ""
    client_keyfile: str = ""
    #: Largest JSON body accepted.
    max_json_octets: int = 1 << 20
    #: Most block keys in one lease request (SEC3).
    max_lease_keys: int = 8192
    #: The descriptors of ``descriptors``, by compat_id.
    known_descriptors: Mapping[str, CompatibilityDescriptor] = field(
        default_factory=dict, metadata=RUNTIME
    )
    #: Plain-HTTP development mode: requests without a certificate are "anonymous".
    allow_anonymous: bool = field(default=False, metadata=RUNTIME)
    #: The base URIs of every worker of this holder process, this one among
    #: them (``[server] workers``, docs/workers.md); empty: this holder alone.
    shards: tuple[str, ...] = field(default=(), metadata=RUNTIME)

    def __post_init__(self) -> None:
        if not isinstance(self.descriptors, tuple | list) or not all(
            isinstance(d, str) for d in self.descriptors
        ):
            # The descriptors themselves, by compat_id, are known_descriptors.
            raise TypeError("HolderSettings.descriptors: descriptor file paths")


@dataclass(frozen=True, slots=True)
class IndexSettings(_Role):
    """``[index]``: the Index Service."""

    #: Public base URI of the IS (H7).
    uri: str = "https://127.0.0.1:8443/is/"
    _: KW_ONLY  # everything but the URI by name
    policy: str = ""
    #: ``memory`` (one process), ``redis`` (several IS processes share it in
    #: Redis) or ``replicated`` (each keeps it in memory and follows the
    #: others through a log in Redis: lookups at memory speed).
    state: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvsp-index:"
    #: ``redis_url`` names a node of a Redis Cluster (docs/storage.md).
    redis_cluster: bool = False
    max_records: int = 1_000_000
    #: Records live at most this long, whatever they ask for (P2).
    max_ttl_ms: int = 600_000
    #: Most block keys in one lookup (L4, SEC3).
    max_lookup_keys: int = 8192
    #: Descriptor files: their block_tokens give recompute estimates (PL1).
    descriptors: tuple[str, ...] = ()
    #: Most targets in one lookup.
    max_targets: int = 64
    max_json_octets: int = 1 << 20
    #: block_tokens per compat_id, from ``descriptors``.
    block_tokens: Mapping[str, int] = field(default_factory=dict, metadata=RUNTIME)
    allow_anonymous: bool = field(default=False, metadata=RUNTIME)


@dataclass(frozen=True, slots=True)
class ControllerSettings(_Role):
    """``[controller]``: the Placement Controller."""

    #: Public base URI of the PC (H7).
    uri: str = "https://127.0.0.1:8443/pc/"
    _: KW_ONLY  # everything but the URI by name
    policy: str = ""
    #: S3: an instance idle this long, running and queueing at most these, may sleep.
    sleep_idle_s: float = 60.0
    sleep_max_running: int = 0
    sleep_max_queued: int = 0
    index_uri: str = ""
    client_certfile: str = ""
    client_keyfile: str = ""
    descriptors: tuple[str, ...] = ()
    #: Mean service time of a queued request, for wait_us (PL1).
    mean_service_ms: float = 0.0
    state: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvsp-pc:"
    #: ``redis_url`` names a node of a Redis Cluster (docs/storage.md).
    redis_cluster: bool = False
    max_sessions: int = 100_000
    max_sessions_per_instance: int = 10_000
    #: Send the chosen instance a prefetch directive (PL2, PF1).
    prefetch: bool = False
    prefetch_deadline_ms: int = 50
    prefetch_lease_ms: int = 2000
    #: How often failed instances' sessions are looked for (CK5).
    migrate_interval_s: float = 0.5
    #: A session idle this long is not resumed (finished without an end).
    session_idle_s: float = 600.0
    #: PL3: start an instance (this command, split like a shell's words, run
    #: without one) when none fits: none active, or the cheapest costs more
    #: than ``start_above_ms`` (0: only when none).
    #: (A library caller may give the argument list itself, a tuple.)
    start_command: str | tuple[str, ...] = ""
    start_above_ms: float = 0.0
    start_timeout_s: float = 60.0
    start_cooldown_s: float = 30.0
    max_json_octets: int = 1 << 20
    #: Most block keys in one placement request.
    max_place_keys: int = 8192
    #: Largest checkpoint accepted (it is kept per session).
    max_checkpoint_octets: int = 256 << 10
    #: block_tokens per compat_id, from ``descriptors``.
    block_tokens: Mapping[str, int] = field(default_factory=dict, metadata=RUNTIME)
    allow_anonymous: bool = field(default=False, metadata=RUNTIME)


@dataclass(frozen=True, slots=True)
class InstanceSettings(_Role):
    """``[instance]``: the Inference Instance, its engine and its sessions."""

    #: Public base URI of the instance (H7): what it reports as.
    uri: str = "https://127.0.0.1:8443/ii/"
    _: KW_ONLY  # everything but the URI by name
    policy: str = ""
    controller_uri: str = ""
    index_uri: str = ""
    client_certfile: str = ""
    client_keyfile: str = ""
    #: S1: reports go every third of it.
    status_ttl_ms: int = 3000
    sleep_idle_s: float = 0.0
    max_pending_directives: int = 16
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    engine: str = ""
    engine_dir: str = ""
    engine_seed: int = 0
    engine_device: str = "cpu"
    block_tokens: int = 16
    scope_keys: tuple[str, ...] = ()
    #: Holders every completed block is also written to (CK1: so that the
    #: KV of the session survives the instance); each is a holder set, one of
    #: whose workers takes a block (``GET shards``, docs/workers.md).
    store_blocks_to: tuple[str, ...] = ()
    #: At most 64 (CK1); non-deterministic sessions use ``release_tokens``.
    checkpoint_tokens: int = 32
    release_tokens: int = 4
    max_sessions: int = 64
    max_running: int = 8
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 2048
    #: A resume's whole restore.
    resume_deadline_ms: int = 4000
    #: Least time between two tokens of a session (0: none): for demos and
    #: tests that must catch a session in the middle.
    token_interval_ms: float = 0.0
    #: Claim greedy decoding deterministic (R4 ``sampler.deterministic``):
    #: only where every instance that may resume a session computes
    #: bit-identical logits, batch-invariant kernels included. Off, greedy
    #: tokens wait for acknowledged checkpoints like sampled ones (CK3).
    greedy_deterministic: bool = GREEDY_DETERMINISTIC
    max_json_octets: int = 4 << 20
    max_directive_blocks: int = 8192
    #: Finished sessions kept for followers that reconnect.
    keep_finished: int = 256
    #: Loading a prompt's prefix through the IS.
    load_deadline_ms: int = 2000
    allow_anonymous: bool = field(default=False, metadata=RUNTIME)
