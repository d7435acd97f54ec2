"""``kvstore events``'s configuration: strict, each error naming its key, as
the command line reports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import ConfigError
from kvstore.fleet.run import build_bridge
from kvstore.fleet.settings import EventsSettings

DESCRIPTOR = (
    '{"model":"toy","model_digest":"sha-256:'
    + "1" * 64
    + '","tokenizer_digest":"sha-256:'
    + "2" * 64
    + '","layers":2,"kv_heads":2,"head_dim":64,"kv_dtype":"bf16",'
    '"positional":"rope","block_tokens":16,"layout":"kvsp-layout-1"}'
)
BASE = (
    '[events]\ninstance = "https://vllm-0.test:8000/"\nindex_uri = "http://127.0.0.1:9/is/"\n'
    'descriptor_file = "d.json"\nscope_key_file = "k"\n'
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "d.json").write_text(DESCRIPTOR)
    (tmp_path / "k").write_text("ab" * 32)
    (tmp_path / "t").write_text("cd" * 32)
    return tmp_path


def test_a_good_file_builds_a_bridge(folder: Path) -> None:
    (folder / "e.toml").write_text(BASE + 'salt_scopes = { "tenant-a" = "t" }\nttl_ms = 5000\n')
    settings = EventsSettings.load(folder / "e.toml")
    assert settings.ttl_ms == 5000 and settings.salt_scopes == {"tenant-a": str(folder / "t")}
    bridge = build_bridge(settings)
    assert set(bridge.scopes) == {"", "tenant-a"} and bridge.block_tokens == 16


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("colour = 1\n", "events.colour: unknown key"),
        ('ttl_ms = "soon"\n', "events.ttl_ms: must be int"),
        ("ttl_ms = 0\n", "events.ttl_ms: must be positive"),
        ('salt_scopes = { "a" = 1 }\n', "events.salt_scopes"),
        ('controller_uri = "https://pc.test/pc/"\n', "events.engine_metrics_url: required"),
        ('log_format = "xml"\n', "events.log_format"),
    ],
)
def test_errors_name_the_key(folder: Path, extra: str, says: str) -> None:
    (folder / "e.toml").write_text(BASE + extra)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        EventsSettings.load(folder / "e.toml")


def test_https_needs_the_certificate_and_a_short_key_is_refused(folder: Path) -> None:
    (folder / "e.toml").write_text(BASE.replace("http://", "https://"))
    with pytest.raises(ConfigError, match=r"events\.cafile, certfile, keyfile"):
        EventsSettings.load(folder / "e.toml")
    (folder / "k").write_text("ab" * 8)  # 8 octets: K1 wants 32
    (folder / "e.toml").write_text(BASE)
    with pytest.raises(ConfigError, match=r"events\.scope_key_file"):
        build_bridge(EventsSettings.load(folder / "e.toml"))


def test_the_command_says_what_to_fix(folder: Path) -> None:
    (folder / "e.toml").write_text(BASE + "colour = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "events", "--config", str(folder / "e.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("kvstore: error: events.colour: unknown key")
