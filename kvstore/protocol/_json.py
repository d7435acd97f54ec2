"""Validation of received JSON members, with the member's path in every error.

R1: unknown members are ignored (never read), names are case-sensitive (plain
dict lookups). Every error is an :class:`InvalidRecord` whose message starts
with the path of the offending member, e.g. ``replica.residency[1].layers``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn
from urllib.parse import urlsplit

from ..native import all_hex32
from .problems import InvalidRecord

UINT32_MAX = 2**32 - 1
INT53_MAX = 2**53 - 1  # the largest integer every JSON peer represents exactly

_HEX32 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(r"sha-256:[0-9a-f]{64}")
_NAME = re.compile(r"[a-z][a-z0-9-]*")
URI_SCHEMES = frozenset({"https", "http", "moqt"})

_MISSING: Any = object()


def fail(path: str, reason: str) -> NoReturn:
    raise InvalidRecord(f"{path}: {reason}", member=path)


class Obj:
    """A JSON object being read, with its path for error messages."""

    __slots__ = ("path", "value")

    def __init__(self, value: Any, path: str) -> None:
        if not isinstance(value, Mapping):
            fail(path, "must be a JSON object")
        self.value: Mapping[str, Any] = value
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self.value and self.value[name] is not None

    def _get(self, name: str, default: Any) -> Any:
        value = self.value.get(name, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                fail(f"{self.path}.{name}", "required member is missing")
            return default
        return value

    def text(self, name: str, default: Any = _MISSING, max_len: int = 4096) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if not isinstance(value, str):
            fail(f"{self.path}.{name}", "must be a string")
        if len(value) > max_len:
            fail(f"{self.path}.{name}", f"longer than {max_len} characters")
        return value

    def integer(self, name: str, default: Any = _MISSING, lo: int = 0, hi: int = INT53_MAX) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        return check_int(value, f"{self.path}.{name}", lo, hi)

    def number(self, name: str, default: Any = _MISSING, lo: float = 0.0, hi: float = 1e18) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(f"{self.path}.{name}", "must be a number")
        if not lo <= value <= hi:  # also rejects NaN
            fail(f"{self.path}.{name}", f"must be between {lo} and {hi}")
        return float(value)

    def flag(self, name: str, default: Any = _MISSING) -> Any:
        value = self._get(name, default)
        if value is not default and not isinstance(value, bool):
            fail(f"{self.path}.{name}", "must be true or false")
        return value

    def hex32(self, name: str) -> str:
        return check_hex(self.text(name), f"{self.path}.{name}", _HEX32, "64")

    def hex16(self, name: str) -> str:
        return check_hex(self.text(name), f"{self.path}.{name}", _HEX16, "32")

    def digest(self, name: str) -> str:
        value: str = self.text(name)
        if not _DIGEST.fullmatch(value):
            fail(f"{self.path}.{name}", 'must be "sha-256:" followed by 64 lowercase hex digits')
        return value

    def name(
        self, name: str, allowed: frozenset[str] | None = None, default: Any = _MISSING
    ) -> Any:
        """A registry name: lowercase ASCII, optionally from a fixed set."""
        value = self.text(name, default, max_len=64)
        if value is default:
            return value
        if allowed is not None and value not in allowed:
            fail(f"{self.path}.{name}", f"{value!r} is not one of {sorted(allowed)}")
        if not _NAME.fullmatch(value):
            fail(f"{self.path}.{name}", "must be lowercase ASCII letters, digits and '-'")
        return value

    def uri(self, name: str, default: Any = _MISSING) -> Any:
        value = self.text(name, default)
        if value is default:
            return value
        return check_uri(value, f"{self.path}.{name}")

    def uuid(self, name: str) -> str:
        value: str = self.text(name, max_len=64)
        try:
            parsed = uuid.UUID(value)
        except ValueError:
            fail(f"{self.path}.{name}", "must be a UUID")
        if str(parsed) != value.lower() or len(value) != 36:
            fail(f"{self.path}.{name}", "must be a UUID in its 8-4-4-4-12 hex form")
        return value.lower()

    def array(self, name: str, default: Any = _MISSING, max_items: int = 1 << 20) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if not isinstance(value, list):
            fail(f"{self.path}.{name}", "must be an array")
        if len(value) > max_items:
            fail(f"{self.path}.{name}", f"has more than {max_items} items")
        return value

    def items(
        self, name: str, default: Any = _MISSING, max_items: int = 1 << 20
    ) -> Iterator[tuple[Any, str]]:
        """Each item of an array member with its path."""
        values = self.array(name, default, max_items)
        if values is None or values is default:
            return iter(())
        return ((item, f"{self.path}.{name}[{i}]") for i, item in enumerate(values))

    def obj(self, name: str) -> Obj:
        return Obj(self._get(name, _MISSING), f"{self.path}.{name}")


def check_int(value: Any, path: str, lo: int = 0, hi: int = INT53_MAX) -> int:
    # bool is an int in Python but true is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        fail(path, "must be an integer")
    if not lo <= value <= hi:
        fail(path, f"must be between {lo} and {hi}")
    return value


def check_hex(value: str, path: str, pattern: re.Pattern[str], digits: str) -> str:
    if not pattern.fullmatch(value):
        fail(path, f"must be {digits} lowercase hex digits")
    return value


def check_uri(value: str, path: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in URI_SCHEMES or not parts.netloc:
        fail(path, f"must be an absolute {'/'.join(sorted(URI_SCHEMES))} URI")
    return value


def check_range(value: Any, path: str, *, half_open: bool) -> tuple[int, int]:
    """A two-integer array ``[a, b]``: inclusive (a <= b) or half-open (a < b)."""
    if not isinstance(value, list) or len(value) != 2:
        fail(path, "must be an array of two integers")
    a = check_int(value[0], path + "[0]", 0, INT53_MAX)
    b = check_int(value[1], path + "[1]", 0, INT53_MAX)
    if a > b or (half_open and a == b):
        fail(path, f"[{a}, {b}] is not a valid {'half-open' if half_open else 'inclusive'} range")
    return a, b


def hex32_list(obj: Obj, name: str, max_items: int = 1 << 20) -> tuple[str, ...]:
    values = obj.array(name, max_items=max_items)
    if all_hex32(values):
        return tuple(values)
    # The slow path names the first offender.
    return tuple(
        check_hex(item if isinstance(item, str) else "", path, _HEX32, "64")
        for item, path in obj.items(name, max_items=max_items)
    )


def token_list(
    obj: Obj, name: str, default: Any = _MISSING, max_items: int = 1 << 20
) -> tuple[int, ...]:
    return tuple(
        check_int(item, path, 0, UINT32_MAX)
        for item, path in obj.items(name, default=default, max_items=max_items)
    )


def drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    """Serialize optional members by leaving them out rather than writing null."""
    return {k: v for k, v in obj.items() if v is not None}
