"""The index's per-key loops: in C (``kvstore/_native.c``) where it was
built, else these Python equivalents (issue 20).

An 8k-key placement otherwise spends most of its time walking its keys:
turning packed keys into hex strings, checking JSON keys, and looking each
up in the index's cache of joined groups. That cache is a :class:`KeyTable`
keyed by the keys' 32 octets, so a lookup whose keys came packed makes no
string per key, and one whose keys are hex parses them rather than hashing
64-character strings. ``NATIVE`` tells which runs; the tests run both and
compare them.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

_HEX_DIGITS = b"0123456789abcdef"
_KEY_HEX = re.compile(".{64}", re.S)
_KIND, _RECORDS, _SHAPES, _EXPIRY = (operator.itemgetter(i) for i in range(4))


def py_hex_keys(octets: bytes | bytearray | memoryview) -> list[str]:
    """The lowercase hex of each 32 octets of ``octets``."""
    if len(octets) % 32:
        raise ValueError("hex_keys: not a whole number of 32-octet keys")
    return _KEY_HEX.findall(bytes(octets).hex())


def py_all_hex32(values: Any) -> bool:
    """True when ``values`` is a non-empty list or tuple of str, each 64
    lowercase hex digits (a few passes in C builtins: ~1 ms for 8k keys)."""
    if not isinstance(values, (list, tuple)) or not values:
        return False
    if set(map(type, values)) != {str} or set(map(len, values)) != {64}:
        return False
    joined = "".join(values)
    # 64 characters each and all ASCII: the lengths are octet counts.
    return joined.isascii() and not joined.encode("ascii").translate(None, _HEX_DIGITS)


#: What a :class:`KeyTable` holds per key (the index's joined group).
Group: TypeAlias = tuple[str, bytes, bytes, float]
_LOWER_HEX = re.compile("[0-9a-f]{64}")


def _table_key(key: object) -> str | None:
    if type(key) is bytes and len(key) == 32:
        return key.hex()
    if type(key) is str and _LOWER_HEX.fullmatch(key):
        return key
    return None


class PyKeyTable:
    """Block Key -> group, the keys given as 64 lowercase hex digits or as
    their 32 octets (the C type keeps the octets; this one, the hex)."""

    def __init__(self) -> None:
        self._groups: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, key: object) -> bool:
        return _table_key(key) in self._groups

    def __getitem__(self, key: str | bytes) -> Group:
        found = self._groups.get(_table_key(key))  # type: ignore[arg-type]
        if found is None:
            raise KeyError(key)
        return found  # type: ignore[no-any-return]

    def __setitem__(self, key: str | bytes, value: Group) -> None:
        name = _table_key(key)
        if name is None:
            raise ValueError("KeyTable: a key is 64 lowercase hex digits or 32 octets")
        if type(value) is not tuple or not all(type(v) in (str, bytes, int, float) for v in value):
            raise TypeError("KeyTable: a value is a tuple of str, bytes, int and float")
        self._groups[name] = value

    def __delitem__(self, key: str | bytes) -> None:
        if self._groups.pop(_table_key(key), None) is None:  # type: ignore[arg-type]
            raise KeyError(key)

    def get(self, key: str | bytes, default: Any = None) -> Any:
        return self._groups.get(_table_key(key), default)  # type: ignore[arg-type]

    def pop(self, key: str | bytes, *default: Any) -> Any:
        name = _table_key(key)
        if name in self._groups:
            return self._groups.pop(name)
        if default:
            return default[0]
        raise KeyError(key)

    def clear(self) -> None:
        self._groups.clear()

    def keys(self) -> list[str]:
        return list(self._groups)


def py_walk(
    groups: Any,
    keys: Sequence[str] | bytes | bytearray | memoryview,
    start: int,
    kind: str,
    now: float,
    records: list[Any] | None,
    shapes: list[Any] | None,
) -> int:
    """From ``keys[start]``, while ``groups[key]`` is a cached group (kind,
    records, shapes, expiry) of ``kind`` expiring after ``now``, append its
    records and shapes to those lists (either may be None); answer the index
    of the first key that is not (``len(keys)`` when all were). ``keys``:
    hex strings, or the keys' 32 octets each (packed)."""
    if not isinstance(keys, (list, tuple)):
        if isinstance(keys, str):
            raise TypeError("walk: keys are a list or tuple of str, or packed octets")
        octets = memoryview(cast("bytes | bytearray | memoryview", keys)).cast("B")
        keys = py_hex_keys(octets)
    elif not isinstance(kind, str):
        raise TypeError("walk: kind must be a str")
    rest = keys[max(start, 0) :]
    head: list[Any] = list(map(groups.get, rest))
    if None in head:
        del head[head.index(None) :]
    # Kinds, expiries and shapes in C builtins; key by key only past a mismatch.
    if head and not (
        set(map(type, head)) == {tuple}
        and set(map(len, head)) == {4}
        and set(map(type, map(_EXPIRY, head))) == {float}
        and all(map(kind.__eq__, map(_KIND, head)))
        and min(map(_EXPIRY, head)) > now
    ):
        for i, group in enumerate(head):
            if (
                type(group) is not tuple
                or len(group) != 4
                or type(group[3]) is not float
                or group[3] <= now
                or group[0] != kind
            ):
                del head[i:]
                break
    if set(map(type, rest[: len(head) + 1])) - {str}:
        raise TypeError("walk: block keys must be str")  # where the C walk reads one
    if records is not None:
        records.extend(map(_RECORDS, head))
    if shapes is not None:
        shapes.extend(map(_SHAPES, head))
    return max(start, 0) + len(head)


__all__ = ["NATIVE", "Group", "KeyTable", "all_hex32", "hex_keys", "walk"]

if TYPE_CHECKING:  # the types of _native.pyi, which PyKeyTable and the rest share
    from ._native import KeyTable, all_hex32, hex_keys, walk

    NATIVE: bool
else:
    try:
        from ._native import KeyTable, all_hex32, hex_keys, walk

        NATIVE = True
    except ImportError:  # not built (no compiler where it was installed)
        hex_keys, all_hex32, walk = py_hex_keys, py_all_hex32, py_walk
        KeyTable = PyKeyTable
        NATIVE = False
