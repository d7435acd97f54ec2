"""What an engine's configuration says of its kvstore holders (issue 10).

The engines' plug-ins are configured by strings in the engine's own
configuration (LMCache's ``extra_config`` or L2 ``adapter_params``, SGLang's
``--hicache-storage-backend-extra-config``). :meth:`ChunkSettings.from_options`
reads them, one definition for every plug-in, and refuses what cannot work
with a :class:`~kvstore.config.ConfigError` naming the option.
"""

from __future__ import annotations

import difflib
import json
import logging
import ssl
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..protocol.compat import CompatibilityDescriptor, parse_descriptor
from ..protocol.keys import scope_id
from ..protocol.problems import KvspError

log = logging.getLogger("kvstore.integrations")


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the engine's own metadata says of its KV (a descriptor's geometry)."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    block_tokens: int

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Geometry:
        """For an engine that does not tell its plug-in its KV (LMCache's MP
        mode): ``layers``, ``kv_heads`` (of one rank's slice), ``head_dim``,
        ``kv_dtype`` and ``chunk_size`` (tokens), or those of ``descriptor_file``."""
        names = ("layers", "kv_heads", "head_dim", "chunk_size")
        if "kv_dtype" in options or any(n in options for n in names):
            sizes = []
            for name in names:
                value = options.get(name)
                if isinstance(value, bool) or not str(value).isdigit() or int(str(value)) < 1:
                    raise ConfigError(f"kvstore.{name}: required (a positive integer)")
                sizes.append(int(str(value)))
            layers, kv_heads, head_dim, tokens = sizes
            return cls(layers, kv_heads, head_dim, _text(options, "kv_dtype"), tokens)
        if not options.get("descriptor_file"):
            raise ConfigError(
                "kvstore: the KV geometry (layers, kv_heads, head_dim, kv_dtype, "
                "chunk_size) or a descriptor_file is required"
            )
        return cls.of(read_descriptor_file(str(options["descriptor_file"])))

    @classmethod
    def of(cls, descriptor: CompatibilityDescriptor) -> Geometry:
        """A descriptor's geometry."""
        d = descriptor
        return cls(d.layers, d.kv_heads, d.head_dim, d.kv_dtype, d.block_tokens)


@dataclass(frozen=True, slots=True)
class ChunkSettings:
    holders: tuple[str, ...]
    scope_key: bytes
    descriptor: CompatibilityDescriptor
    #: Keeps one engine's keys apart from another's ("lmcache", "sglang").
    namespace: str
    ssl_context: ssl.SSLContext | None = None
    timeout_s: float = 5.0
    #: How long a lease protects the chunks of one batched get (LE1).
    lease_ms: int = 10_000
    down_backoff_s: float = 5.0
    #: Most requests in flight at once from one batch.
    concurrency: int = 16
    #: Threads that receive and verify blocks (kvstore.fetch); None: the
    #: cores the process may use, at most 32.
    fetch_threads: int | None = None

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, Any],
        *,
        namespace: str,
        geometry: Geometry,
        extra: Collection[str] = (),
    ) -> ChunkSettings:
        """Settings from an engine's configuration strings (LMCache's
        ``extra_config``, SGLang's ``--hicache-storage-backend-extra-config``),
        keys without their ``kvstore.`` prefix:

        * ``holders``: base URIs, a list or comma-separated (required);
        * ``scope_key_file``: a scope key in hex, at least 32 octets (required);
        * ``cafile``, ``certfile``, ``keyfile``: TLS and the client
          certificate (required for ``https`` holders);
        * the descriptor, either ``descriptor_file`` (a JSON Compatibility
          Descriptor, whose geometry must match the engine's) or ``model``,
          ``model_digest``, ``tokenizer_digest``, optional ``positional``
          (default ``rope``) and ``adapters``, with the geometry taken from
          the engine;
        * ``timeout_s`` (5), ``lease_ms`` (10000), ``down_backoff_s`` (5),
          ``fetch_threads`` (the threads that receive and verify blocks;
          default the cores the process may use, at most 32).

        ``extra``: the options the plug-in reads itself (refused otherwise:
        an unknown option is an error naming the nearest known one, never
        silently ignored: ``timout_s`` would leave the timeout at 5 s).
        """
        check_known(options, CHUNK_OPTIONS | frozenset(extra))
        holders = _holders(options.get("holders"))
        scope_key = read_scope_key(_text(options, "scope_key_file"))
        context = None
        if any(h.startswith("http://") for h in holders):
            log.warning(
                "kvstore.holders: plain http: no TLS, no client identity (the holder "
                "must allow anonymous access; development only)"
            )
        if any(h.startswith("https://") for h in holders):
            from ..tls import client_context

            try:
                context = client_context(
                    _text(options, "cafile"), _text(options, "certfile"), _text(options, "keyfile")
                )
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"kvstore TLS files: {exc}") from exc
        return cls(
            holders=holders,
            scope_key=scope_key,
            descriptor=_descriptor(options, geometry),
            namespace=namespace,
            ssl_context=context,
            timeout_s=number(options, "timeout_s", 5.0),
            lease_ms=int(number(options, "lease_ms", 10_000)),
            down_backoff_s=number(options, "down_backoff_s", 5.0),
            fetch_threads=_threads(options),
        )


def _threads(options: Mapping[str, Any]) -> int | None:
    if options.get("fetch_threads") in (None, ""):
        return None
    threads = number(options, "fetch_threads", 0)
    if threads != int(threads) or not 1 <= threads <= 1024:
        raise ConfigError(
            f"kvstore.fetch_threads: {options['fetch_threads']!r} is not a "
            "number of threads (1 to 1024)"
        )
    return int(threads)


#: Every option ChunkSettings.from_options reads.
CHUNK_OPTIONS = frozenset(
    {
        "holders",
        "scope_key_file",
        "cafile",
        "certfile",
        "keyfile",
        "descriptor_file",
        "model",
        "model_digest",
        "tokenizer_digest",
        "positional",
        "adapters",
        "timeout_s",
        "lease_ms",
        "down_backoff_s",
        "fetch_threads",
    }
)
#: The KV geometry of Geometry.from_options (an engine that does not say it).
GEOMETRY_OPTIONS = frozenset({"layers", "kv_heads", "head_dim", "kv_dtype", "chunk_size"})


def check_known(options: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse the first option not in ``known``, with the nearest known one."""
    for name in sorted(set(options) - set(known)):
        near = difflib.get_close_matches(name, known, n=1)
        hint = f'; did you mean "{near[0]}"?' if near else ""
        raise ConfigError(
            f"kvstore.{name}: unknown option{hint} (known: {', '.join(sorted(known))})"
        )


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0", "")


def flag(options: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean option: true/false, or the strings engines' configurations
    carry ("true", "false", "1", "0", "yes", "no"); anything else is refused
    (``bool("false")`` is True)."""
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"kvstore.{name}: {value!r} is not true or false")


def number(options: Mapping[str, Any], name: str, default: float, *, zero: bool = False) -> float:
    """A positive number option (``zero``: or 0), as a number or a string."""
    value = options.get(name, default)
    try:
        if isinstance(value, bool):
            raise TypeError
        result = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kvstore.{name}: {value!r} is not a number") from None
    if not (result > 0 or (zero and result == 0)) or result != result or result == float("inf"):
        raise ConfigError(
            f"kvstore.{name}: {value!r}: must be {'zero or positive' if zero else 'positive'}"
        )
    return result


def read_scope_key(file: str, option: str = "scope_key_file", prefix: str = "kvstore.") -> bytes:
    """A scope key from a file of hex (K1: at least 32 octets); an error
    names ``<prefix><option>`` (an engine's option, a section's key)."""
    try:
        key = bytes.fromhex(Path(file).read_text().strip())
        scope_id(key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{prefix}{option}: {file}: {exc}") from exc
    return key


def _text(options: Mapping[str, Any], name: str) -> str:
    value = options.get(name)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kvstore.{name}: required (a non-empty string)")
    return value


def _holders(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    holders = tuple(str(h).strip() for h in items if str(h).strip()) if items else ()
    if not isinstance(items, list | tuple) or not holders:
        raise ConfigError("kvstore.holders: required (holder base URIs)")
    for holder in holders:
        if not holder.startswith(("https://", "http://")):
            raise ConfigError(f"kvstore.holders: {holder!r} is not an http(s) URI")
    return tuple(h if h.endswith("/") else h + "/" for h in holders)


def _descriptor(options: Mapping[str, Any], geometry: Geometry) -> CompatibilityDescriptor:
    shape = {
        "layers": geometry.layers,
        "kv_heads": geometry.kv_heads,
        "head_dim": geometry.head_dim,
        "kv_dtype": geometry.kv_dtype,
        "block_tokens": geometry.block_tokens,
    }
    file = options.get("descriptor_file")
    if file:
        descriptor = read_descriptor_file(str(file))
        found = {name: getattr(descriptor, name) for name in shape}
        if found != shape:
            raise ConfigError(
                f"kvstore.descriptor_file: geometry {found} is not the engine's {shape}"
            )
        return descriptor
    obj: dict[str, Any] = {
        "model": _text(options, "model"),
        "model_digest": _text(options, "model_digest"),
        "tokenizer_digest": _text(options, "tokenizer_digest"),
        "positional": options.get("positional", "rope"),
        "layout": "kvsp-layout-1",
        **shape,
    }
    if options.get("adapters"):
        adapters = options["adapters"]
        obj["adapters"] = adapters.split(",") if isinstance(adapters, str) else list(adapters)
    try:
        return parse_descriptor(obj)
    except KvspError as exc:
        raise ConfigError(f"kvstore descriptor: {exc.detail}") from exc


def read_descriptor_file(file: str, prefix: str = "kvstore.") -> CompatibilityDescriptor:
    """A Compatibility Descriptor from a JSON file; an error names
    ``<prefix>descriptor_file``."""
    try:
        return parse_descriptor(json.loads(Path(file).read_text()))
    except (OSError, ValueError, KvspError) as exc:
        raise ConfigError(f"{prefix}descriptor_file: {file}: {exc}") from exc


def options_with_prefix(
    options: Mapping[str, Any] | None, prefix: str = "kvstore."
) -> dict[str, Any]:
    """The ``kvstore.*`` entries of an engine's extra configuration, unprefixed."""
    return {k[len(prefix) :]: v for k, v in (options or {}).items() if k.startswith(prefix)}
