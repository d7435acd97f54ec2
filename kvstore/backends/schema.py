"""Each backend's options as a typed schema: one definition, read by the
configuration loader (``kvstore serve`` and ``kvstore config check``) and by
docs/configuration.md's test (STYLE 16). Importing it imports no backend:
optional dependencies (torch, redis, aiobotocore) stay unimported.

A tier's table in the configuration is ``backend``, ``capacity``, the
options every tier has (``deadline_s``) and its backend's own. An unknown
option is refused with the nearest known one; a value of the wrong type is
refused naming both; sizes may be written as octets or as ``"256MiB"``.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Option:
    #: "str", "int", "float", "bool", "size" (octets, or "256MiB"), "path".
    kind: str
    default: Any = None
    required: bool = False
    doc: str = ""


_RATE = Option("float", None, doc="Mbit/s a read gets (PL1); unset: measured at start")

SCHEMAS: dict[str, dict[str, Option]] = {
    "device": {
        "device": Option("str", "cpu", doc="torch device: cpu, cuda, cuda:1"),
        "read_mbit_per_s": _RATE,
    },
    "host": {
        "arena": Option("bool", True, doc="blocks in one mapping of capacity + 1/8"),
        "prefault": Option("bool", False, doc="touch the arena's memory at start"),
        "workers": Option("int", 1, doc="holder processes of this machine with such a tier"),
        "read_mbit_per_s": _RATE,
    },
    "lmdb": {
        "path": Option("path", required=True, doc="directory of the LMDB environment"),
        "map_size": Option("size", 1 << 30, doc="LMDB's map, above capacity"),
        "sync": Option("bool", True, doc="a PUT is on disk when acknowledged"),
        "read_mbit_per_s": _RATE,
    },
    "redis": {
        "url": Option("str", "redis://127.0.0.1:6379/0"),
        "prefix": Option("str", "kvstore:", doc="key prefix: letters, digits and ':_.-'"),
        "timeout_s": Option("float", 5.0),
        "cluster": Option("bool", False, doc="a Redis Cluster"),
        "replica_reads": Option("bool", False, doc="GETs at replicas first (cluster)"),
        "read_mbit_per_s": _RATE,
    },
    "s3": {
        "bucket": Option("str", required=True),
        "prefix": Option("str", "kvstore/"),
        "endpoint_url": Option("str"),
        "region": Option("str"),
        "access_key_id": Option("str"),
        "secret_access_key": Option("str"),
        "timeout_s": Option("float", 10.0),
        "create_bucket": Option("bool", False, doc="make a missing bucket (development)"),
        "read_mbit_per_s": _RATE,
    },
}

#: Options of every tier, read by the store, not the backend.
COMMON: dict[str, Option] = {
    "deadline_s": Option("float", doc="longest a call may take before the tier counts as down"),
}

#: The module a backend needs beyond kvstore's own, and the extra that brings it.
EXTRAS: dict[str, tuple[str, str]] = {
    "device": ("torch", "torch"),
    "redis": ("redis", "redis"),
    "s3": ("aiobotocore", "s3"),
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


class OptionError(ValueError):
    """An option is unknown, of the wrong type, or missing (the message says which)."""


def parse_size(value: Any, where: str) -> int:
    """Octets of ``value``: an integer, or a string such as ``"256MiB"``, ``"2 GB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        unit = match[2].lower()
        if unit in _UNITS:
            return int(float(match[1]) * _UNITS[unit])
    raise OptionError(
        f'{where}: a size in octets, or a string such as "256MiB" or "2GB"; got {value!r}'
    )


def _typed(option: Option, value: Any, where: str) -> Any:
    kind = option.kind
    if kind == "size":
        size = parse_size(value, where)
        if size <= 0:
            raise OptionError(f"{where}: must be positive, got {value!r}")
        return size
    if kind == "bool":
        if not isinstance(value, bool):
            raise OptionError(f"{where}: true or false, got {value!r}")
        return value
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise OptionError(f"{where}: an integer, got {value!r}")
        return value
    if kind == "float":
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise OptionError(f"{where}: a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):  # str, path
        raise OptionError(f"{where}: a string, got {value!r}")
    return value


def check_options(backend: str, options: dict[str, Any], where: str) -> dict[str, Any]:
    """``options`` of a ``backend`` tier, typed (sizes in octets); raises
    :class:`OptionError` for the first unknown, mistyped or missing one."""
    schema = SCHEMAS.get(backend)
    if schema is None:
        raise OptionError(
            f"{where}.backend: {backend!r} is an unknown backend; known: "
            f"{', '.join(sorted(SCHEMAS))}"
        )
    known = {**schema, **COMMON}
    out: dict[str, Any] = {}
    for name, value in options.items():
        option = known.get(name)
        if option is None:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f'; did you mean "{near[0]}"?' if near else ""
            raise OptionError(
                f"{where}.{name}: unknown option of the {backend} backend{hint} "
                f"(known: {', '.join(sorted(known))})"
            )
        out[name] = _typed(option, value, f"{where}.{name}")
    for name, option in schema.items():
        if option.required and name not in out:
            raise OptionError(f"{where}.{name}: required by the {backend} backend")
    return out


def missing_extra(backend: str) -> str | None:
    """What to install for ``backend`` when its optional dependency is absent."""
    need = EXTRAS.get(backend)
    if need is None or importlib.util.find_spec(need[0]) is not None:
        return None
    return (
        f"the {backend} backend needs {need[0]}, which is not installed "
        f"(pip install 'kvsp-kvstore[{need[1]}]')"
    )
