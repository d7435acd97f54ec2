"""The index's per-key loops: in C (``kvstore/_native.c``) where it was
built, else these Python equivalents (issue 20).

An 8k-key placement otherwise spends most of its time walking its keys:
turning packed keys into hex strings, checking JSON keys, and looking each
up in the index's cache of joined groups. ``NATIVE`` tells which runs; the
tests run both and compare them.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

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


def py_walk(
    groups: dict[str, tuple[str, bytes, bytes, float]],
    keys: Sequence[str],
    start: int,
    kind: str,
    now: float,
    records: list[Any] | None,
    shapes: list[Any] | None,
) -> int:
    """From ``keys[start]``, while ``groups[key]`` is a cached group (kind,
    records, shapes, expiry) of ``kind`` expiring after ``now``, append its
    records and shapes to those lists (either may be None); answer the index
    of the first key that is not (``len(keys)`` when all were)."""
    rest = keys[max(start, 0) :]
    head: list[Any] = list(map(groups.get, rest))
    if None in head:
        del head[head.index(None) :]
    # Kinds and expiries in C builtins; key by key only past a mismatch.
    if head and not (all(map(kind.__eq__, map(_KIND, head))) and min(map(_EXPIRY, head)) > now):
        for i, group in enumerate(head):
            if group[3] <= now or group[0] != kind:
                del head[i:]
                break
    if records is not None:
        records.extend(map(_RECORDS, head))
    if shapes is not None:
        shapes.extend(map(_SHAPES, head))
    return max(start, 0) + len(head)


__all__ = ["NATIVE", "all_hex32", "hex_keys", "walk"]

try:
    from ._native import all_hex32, hex_keys, walk

    NATIVE = True
except ImportError:  # not built (no compiler where it was installed)
    hex_keys, all_hex32, walk = py_hex_keys, py_all_hex32, py_walk
    NATIVE = False
