"""kvstore.native: the C loops against their Python equivalents (issue 20)."""

from __future__ import annotations

import os
import random

import pytest

from kvstore import native
from kvstore.native import py_all_hex32, py_hex_keys, py_walk

needs_native = pytest.mark.skipif(
    not native.NATIVE and os.environ.get("CI") != "true",
    reason="kvstore._native was not built here (no compiler at install)",
)


def test_built_in_ci() -> None:
    # CI installs with a compiler: the C loops must be what runs there.
    if os.environ.get("CI") == "true":
        assert native.NATIVE


@needs_native
def test_hex_keys_match() -> None:
    from kvstore._native import hex_keys

    rng = random.Random(7)
    for count in (0, 1, 2, 100):
        octets = rng.randbytes(32 * count)
        assert (
            hex_keys(octets)
            == py_hex_keys(octets)
            == [octets[i : i + 32].hex() for i in range(0, len(octets), 32)]
        )
        assert hex_keys(memoryview(octets)) == py_hex_keys(memoryview(octets))
    for bad in (b"x", b"y" * 33):
        with pytest.raises(ValueError):
            hex_keys(bad)
        with pytest.raises(ValueError):
            py_hex_keys(bad)


@needs_native
@pytest.mark.parametrize(
    "values",
    [
        ["a" * 64],
        ("0123456789abcdef" * 4,) * 3,
        [],
        (),
        ["A" * 64],  # upper case
        ["a" * 63],
        ["a" * 65],
        ["g" * 64],
        ["a" * 63 + "é"],  # not ASCII
        ["a" * 64, 5],
        ["a" * 64, b"a" * 64],
        "a" * 64,  # a string, not a list of them
        None,
        [" " * 64],
    ],
)
def test_all_hex32_matches(values: object) -> None:
    from kvstore._native import all_hex32

    assert all_hex32(values) == py_all_hex32(values)


def _groups(now: float) -> tuple[dict[str, tuple[str, bytes, bytes, float]], list[str]]:
    keys = [f"{n:064x}" for n in range(20)]
    groups = {k: ("kind", f"[r{n}]".encode(), f"[s{n % 3}]".encode(), now + 10) for n, k in
              enumerate(keys)}  # fmt: skip
    return groups, keys


@needs_native
def test_walk_matches_on_every_kind_of_stop() -> None:
    from kvstore._native import walk

    now = 100.0
    groups, keys = _groups(now)
    del groups[keys[15]]  # a missing key
    groups[keys[10]] = ("other", b"[x]", b"[y]", now + 10)  # another kind
    groups[keys[5]] = ("kind", b"[x]", b"[y]", now)  # expired: expiry == now
    for start in (-1, 0, 3, 5, 6, 11, 16, 19, 20, 25):
        for records_on, shapes_on in ((True, True), (True, False), (False, True), (False, False)):
            got = [], []
            expected = [], []
            a = walk(groups, keys, start, "kind", now, got[0] if records_on else None,
                     got[1] if shapes_on else None)  # fmt: skip
            b = py_walk(groups, tuple(keys), start, "kind", now,
                        expected[0] if records_on else None,
                        expected[1] if shapes_on else None)  # fmt: skip
            assert a == b and got == expected, (start, records_on, shapes_on)
    assert walk(groups, keys, 0, "kind", now, None, None) == 5
    assert walk(groups, keys, 6, "kind", now, None, None) == 10
    assert walk(groups, keys, 11, "kind", now, None, None) == 15
    assert walk(groups, keys, 16, "kind", now, None, None) == 20
    # An equal kind that is another object still matches.
    assert walk(groups, keys, 16, "".join(["ki", "nd"]), now, None, None) == 20


@needs_native
def test_walk_refuses_what_it_cannot_read_safely() -> None:
    from kvstore._native import walk

    groups, keys = _groups(0.0)

    class Key(str):
        pass

    with pytest.raises(TypeError):
        walk(groups, [Key(keys[0])], 0, "kind", 0.0, None, None)
    with pytest.raises(TypeError):
        walk(groups, iter(keys), 0, "kind", 0.0, None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        walk(groups, keys, 0, "kind", 0.0, (), None)  # type: ignore[arg-type]
    # A value that is not a group ends the walk (no crash).
    groups[keys[2]] = ("kind", b"[r]")  # type: ignore[assignment]
    assert walk(groups, keys, 0, "kind", 0.0, None, None) == 2
