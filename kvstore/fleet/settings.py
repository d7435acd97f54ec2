"""``kvstore events``'s configuration: a TOML file with one ``[events]`` table
(docs/events.md lists every key). Strict: an unknown key or a wrong type is
an error naming the key."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import ConfigError


@dataclass(frozen=True, slots=True)
class EventsSettings:
    #: The instance URI the bridge speaks for: its policy grant's ``instance``
    #: (the certificate below is that instance's).
    instance: str = ""
    #: The Index Service told the residency.
    index_uri: str = ""
    #: vLLM's ZmqEventPublisher: its PUB endpoint, its replay (ROUTER)
    #: endpoint (empty: a gap voids the residency instead), its topic.
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str = ""
    topic: str = ""
    #: The Compatibility Descriptor the engine's blocks are named under (its
    #: block_tokens must be vLLM's block size).
    descriptor_file: str = ""
    #: The default scope's key (requests without a cache_salt); empty: those
    #: are not told.
    scope_key_file: str = ""
    #: cache_salt -> its scope's key file; any other salt is not told.
    salt_scopes: dict[str, str] = field(default_factory=dict)
    #: Mutual TLS to the IS: the CA, the instance's certificate and key.
    cafile: str = ""
    certfile: str = ""
    keyfile: str = ""
    #: How long the IS keeps this instance's records without news (a dead
    #: pod's expire); refreshed every third of it.
    ttl_ms: int = 30_000
    #: vLLM hashes remembered (the parents of later blocks).
    max_blocks: int = 1 << 18
    #: Changes gathered this long before an update is sent.
    flush_ms: int = 20
    #: Block keys in one update at most.
    max_update_keys: int = 8192
    #: How long a replay may take before the gap counts as lost.
    replay_timeout_s: float = 2.0
    #: The Placement Controller told the engine's status (empty: none), read
    #: from the engine's own /metrics (vLLM's: http://127.0.0.1:8000/metrics),
    #: with the rates and batch size said here (vLLM reports none of them).
    controller_uri: str = ""
    engine_metrics_url: str = ""
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 1_000.0
    batch_size: int = 256
    #: /metrics, /healthz and /readyz in plain HTTP (no block or scope in
    #: them); 0: none.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
    log_format: str = "text"

    @classmethod
    def load(cls, path: str | Path) -> EventsSettings:
        file = Path(path)
        try:
            data = tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{file}: {exc}") from exc
        unknown = set(data) - {"events"}
        if unknown or not isinstance(data.get("events"), dict):
            raise ConfigError(f"{file}: one [events] table, nothing else")
        return cls.parse(data["events"], file.parent)

    @classmethod
    def parse(cls, table: dict[str, Any], root: Path = Path(".")) -> EventsSettings:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in known:
                raise ConfigError(f"events.{key}: unknown key; known: {sorted(known)}")
            default = cls.__dataclass_fields__[key].default
            if key == "salt_scopes":
                if not isinstance(value, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
                ):
                    raise ConfigError("events.salt_scopes: a table of cache_salt = key file")
                value = {k: str(root / v) for k, v in value.items()}
            elif (
                isinstance(default, float)
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                value = float(value)
            elif not isinstance(value, type(default)) or isinstance(value, bool) != isinstance(
                default, bool
            ):
                raise ConfigError(f"events.{key}: must be {type(default).__name__}, got {value!r}")
            if key.endswith("file") and value:
                value = str(root / value)
            values[key] = value
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        for key in ("instance", "index_uri", "descriptor_file"):
            if not getattr(self, key):
                raise ConfigError(f"events.{key}: required")
        if not self.scope_key_file and not self.salt_scopes:
            raise ConfigError("events.scope_key_file or events.salt_scopes: one scope at least")
        if self.index_uri.startswith("https:") and not (
            self.cafile and self.certfile and self.keyfile
        ):
            raise ConfigError("events.cafile, certfile, keyfile: required for an https index")
        if self.controller_uri and not self.engine_metrics_url:
            raise ConfigError("events.engine_metrics_url: required with controller_uri")
        for key in ("ttl_ms", "max_blocks", "flush_ms", "max_update_keys", "batch_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"events.{key}: must be positive")
        if self.log_format not in ("text", "json"):
            raise ConfigError("events.log_format: text or json")
