"""kvstore.native: the C loops against their Python equivalents (issue 20)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvstore import native
from kvstore.native import PyKeyTable, py_all_hex32, py_hex_keys, py_walk

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


Group = tuple[str, bytes, bytes, float]


def _groups(now: float, table: Any) -> tuple[Any, list[str]]:
    keys = [random.Random(n).randbytes(32).hex() for n in range(20)]
    groups = table()
    for n, k in enumerate(keys):
        groups[k] = ("kind", f"[r{n}]".encode(), f"[s{n % 3}]".encode(), now + 10)
    return groups, keys


def _both(now: float) -> tuple[Any, Any, list[str]]:
    from kvstore._native import KeyTable

    c, keys = _groups(now, KeyTable)
    p, _ = _groups(now, PyKeyTable)
    return c, p, keys


@needs_native
def test_walk_matches_on_every_kind_of_stop() -> None:
    from kvstore._native import walk

    now = 100.0
    c_groups, py_groups, keys = _both(now)
    for groups in (c_groups, py_groups):
        del groups[keys[15]]  # a missing key
        groups[keys[10]] = ("other", b"[x]", b"[y]", now + 10)  # another kind
        groups[keys[5]] = ("kind", b"[x]", b"[y]", now)  # expired: expiry == now
    packed = b"".join(bytes.fromhex(k) for k in keys)
    for start in (-1, 0, 3, 5, 6, 11, 16, 19, 20, 25):
        for records_on, shapes_on in ((True, True), (True, False), (False, True), (False, False)):
            outcomes = []
            for form in (keys, tuple(keys), packed, memoryview(packed)):
                for fn, groups in ((walk, c_groups), (py_walk, py_groups)):
                    got: tuple[list[Any], list[Any]] = [], []
                    at = fn(
                        groups,
                        form,
                        start,
                        "kind",
                        now,
                        got[0] if records_on else None,
                        got[1] if shapes_on else None,
                    )
                    outcomes.append((at, got))
            assert all(o == outcomes[0] for o in outcomes), (start, records_on, shapes_on)
    for form in (keys, packed):
        assert walk(c_groups, form, 0, "kind", now, None, None) == 5
        assert walk(c_groups, form, 6, "kind", now, None, None) == 10
        assert walk(c_groups, form, 11, "kind", now, None, None) == 15
        assert walk(c_groups, form, 16, "kind", now, None, None) == 20
    # An equal kind that is another object still matches.
    assert walk(c_groups, keys, 16, "".join(["ki", "nd"]), now, None, None) == 20
    # A key that is not lowercase hex is a miss, not an error.
    for bad in (keys[0].upper(), keys[0][:63], keys[0][:63] + "g", keys[0][:63] + "\xe9"):
        assert walk(c_groups, [bad], 0, "kind", now, None, None) == 0
        assert py_walk(py_groups, [bad], 0, "kind", now, None, None) == 0


@needs_native
def test_walk_refuses_what_it_cannot_read_safely() -> None:
    from kvstore._native import KeyTable, walk

    groups, keys = _groups(0.0, KeyTable)

    class Key(str):
        pass

    with pytest.raises(TypeError):
        walk(groups, [Key(keys[0])], 0, "kind", 0.0, None, None)
    with pytest.raises(TypeError):
        walk(groups, iter(keys), 0, "kind", 0.0, None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        walk(groups, keys[0], 0, "kind", 0.0, None, None)  # a str is not packed keys
    with pytest.raises(TypeError):
        walk(groups, keys, 0, "kind", 0.0, (), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        walk({}, keys, 0, "kind", 0.0, None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        walk(groups, b"x" * 33, 0, "kind", 0.0, None, None)
    # A value that is not a group ends the walk (no crash).
    groups[keys[2]] = ("kind", b"[r]")  # type: ignore[assignment]
    assert walk(groups, keys, 0, "kind", 0.0, None, None) == 2


@needs_native
def test_key_table_is_a_mapping_like_its_python_twin() -> None:
    from kvstore._native import KeyTable

    rng = random.Random(3)
    c, p = KeyTable(), PyKeyTable()
    live: dict[str, Any] = {}
    keys = [rng.randbytes(32) for _ in range(300)]
    for step in range(5000):
        key = rng.choice(keys)
        name: str | bytes = key if rng.random() < 0.5 else key.hex()
        action = rng.random()
        if action < 0.5:
            value = ("k", b"r", b"s", float(step))
            c[name] = p[name] = live[key.hex()] = value
        elif action < 0.7:
            assert c.pop(name, None) == p.pop(name, None) == live.pop(key.hex(), None)
        elif action < 0.8 and key.hex() in live:
            del c[name], p[name], live[key.hex()]
        else:
            assert c.get(name) == p.get(name) == live.get(key.hex())
            assert (name in c) == (name in p) == (key.hex() in live)
        assert len(c) == len(p) == len(live)
    assert sorted(c.keys()) == sorted(p.keys()) == sorted(live)
    for table in (c, p):
        for bad_key in ("A" * 64, "a" * 63, b"x" * 31, 5):
            assert table.get(bad_key) is None and bad_key not in table
            assert table.pop(bad_key, "gone") == "gone"
            with pytest.raises(KeyError):
                table[bad_key]
            with pytest.raises(ValueError):
                table[bad_key] = ("k",)
        with pytest.raises(KeyError):
            table.pop("b" * 64)
        with pytest.raises(KeyError):
            del table["b" * 64]
        for bad_value in (["k"], ("k", ["list"]), ("k", object()), "k"):
            with pytest.raises(TypeError):
                table["c" * 64] = bad_value
        table.clear()
        assert len(table) == 0 and table.get(keys[0]) is None


@needs_native
def test_key_table_draws_a_new_seed_when_keys_collide() -> None:
    from kvstore._native import KeyTable, walk

    # Under an all-zero seed, NH of a key whose words but the second are
    # zero is 0: every such key lands in one slot, a probe run that random
    # keys do not make. The table draws a new seed and spreads them again.
    table = KeyTable()
    table._set_seed(bytes(32))
    keys = [bytes(4) + n.to_bytes(4, "little") + bytes(24) for n in range(1, 2001)]
    for n, key in enumerate(keys):
        table[key] = ("kind", b"[r]", b"[s]", 1e9 + n)
    assert table.reseeds >= 1
    assert len(table) == len(keys)
    assert all(table[key][3] == 1e9 + n for n, key in enumerate(keys))
    assert walk(table, b"".join(keys), 0, "kind", 0.0, None, None) == len(keys)
    # Random keys make no long probes: no new seed.
    spread = KeyTable()
    for n in range(20000):
        spread[random.Random(n).randbytes(32)] = ("kind",)
    assert spread.reseeds == 0


@needs_native
def test_walk_c_and_python_agree_on_odd_input() -> None:
    from array import array

    from kvstore._native import walk

    c_groups, py_groups, keys = _both(0.0)
    for groups in (c_groups, py_groups):
        groups[keys[1]] = ("kind", b"[r]")  # not a group: a miss
        groups[keys[3]] = ("kind", b"[r]", b"[s]", 5)  # an int expiry: a miss
        groups[keys[5]] = ("kind", b"[r]", b"[s]", 5.0, "x")  # five members: a miss
    for start in (0, 2, 4, 6):
        assert walk(c_groups, keys, start, "kind", 0.0, None, None) == py_walk(
            py_groups, keys, start, "kind", 0.0, None, None
        )
    # A key that is not a str where the walk reads it: TypeError in both.
    for fn, groups in ((walk, c_groups), (py_walk, py_groups)):
        with pytest.raises(TypeError):
            fn(groups, [bytes.fromhex(keys[0])], 0, "kind", 0.0, None, None)
        assert fn(groups, [keys[1], 5], 0, "kind", 0.0, None, None) == 0  # stops before it
    # Packed keys in a typed buffer are counted in octets by both.
    packed = array("I", b"".join(bytes.fromhex(k) for k in keys[6:9]))
    assert walk(c_groups, packed, 0, "kind", 0.0, None, None) == 3
    assert py_walk(py_groups, packed, 0, "kind", 0.0, None, None) == 3
    # The lists it appends to may be the keys' own list (no stale items).
    alias = list(keys[6:])
    assert walk(c_groups, alias, 0, "kind", 0.0, alias, None) == len(keys) - 6


@needs_native
def test_a_cleared_table_and_a_new_seed_keep_every_key() -> None:
    from kvstore._native import KeyTable

    table = KeyTable()
    names = [random.Random(n).randbytes(32) for n in range(500)]
    for n, name in enumerate(names):
        table[name] = ("k", float(n))
    table._set_seed(bytes(range(32)))
    assert all(table[name] == ("k", float(n)) for n, name in enumerate(names))
    table.clear()
    assert len(table) == 0 and table.get(names[0]) is None
    table[names[0]] = ("k",)
    assert table[names[0].hex()] == ("k",)
