"""The engines' plug-in options (issue 33), without an engine: an unknown
``kvstore.*`` option is refused naming the nearest known one (it was
ignored: ``kvstore.timout_s=0.5`` left the timeout at 5 s), booleans are
parsed as booleans (``bool("false")`` is true), numbers are checked, and
every error names the option as the user wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import ConfigError
from kvstore.integrations.options import (
    CHUNK_OPTIONS,
    ChunkSettings,
    Geometry,
    check_known,
    flag,
    number,
    options_with_prefix,
)

GEOMETRY = Geometry(layers=4, kv_heads=2, head_dim=8, kv_dtype="bf16", block_tokens=16)


def options(tmp_path: Path, **more: object) -> dict[str, object]:
    (tmp_path / "scope.hex").write_text("ab" * 32)
    return {
        "holders": "http://127.0.0.1:1/kvsp/",
        "scope_key_file": str(tmp_path / "scope.hex"),
        "model": "m",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
        **more,
    }


def test_a_misspelt_option_is_refused_with_the_nearest_known_one(tmp_path: Path) -> None:
    extra = {"kvstore.timout_s": "0.5", "other.plugin": "x"}  # as an engine's extra_config
    with pytest.raises(
        ConfigError, match=r'kvstore\.timout_s: unknown option; did you mean "timeout_s"'
    ):
        ChunkSettings.from_options(
            {**options(tmp_path), **options_with_prefix(extra)}, namespace="t", geometry=GEOMETRY
        )
    settings = ChunkSettings.from_options(
        options(tmp_path, timeout_s="0.5"), namespace="t", geometry=GEOMETRY
    )
    assert settings.timeout_s == 0.5
    # A plug-in's own options are known when it says so.
    ChunkSettings.from_options(
        options(tmp_path, max_lock_s=3), namespace="t", geometry=GEOMETRY, extra=["max_lock_s"]
    )
    with pytest.raises(ConfigError, match="known: adapters, cafile"):
        check_known({"zzz": 1}, CHUNK_OPTIONS)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        ("true", True),
        ("false", False),
        ("FALSE", False),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("no", False),
        (0, False),
        (1, True),
    ],
)
def test_booleans_are_parsed_as_booleans(value: object, expected: bool) -> None:
    assert flag({"salt_scopes_only": value}, "salt_scopes_only", False) is expected


@pytest.mark.parametrize("value", ["maybe", 2, 0.5, None])
def test_a_boolean_that_is_not_one_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"kvstore\.salt_scopes_only: .* is not true or false"):
        flag({"salt_scopes_only": value}, "salt_scopes_only", False)


def test_numbers_are_checked() -> None:
    assert number({"timeout_s": "2.5"}, "timeout_s", 5.0) == 2.5
    assert number({}, "timeout_s", 5.0) == 5.0
    assert number({"max_capacity_gb": 0}, "max_capacity_gb", 0, zero=True) == 0
    for bad, message in (
        ("soon", "'soon' is not a number"),
        (True, "True is not a number"),
        (-1, "-1: must be positive"),
        (0, "0: must be positive"),
        ("nan", "must be positive"),
        ("inf", "must be positive"),
    ):
        with pytest.raises(ConfigError, match=message):
            number({"timeout_s": bad}, "timeout_s", 5.0)
