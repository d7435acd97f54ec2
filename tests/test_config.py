"""Configuration files: strict keys, typed values, paths relative to the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import ConfigError, load, parse

MINIMAL = {"storage": {"tiers": [{"backend": "host", "capacity": 1024}]}}


def test_minimal_file_takes_defaults(tmp_path: Path) -> None:
    file = tmp_path / "k.toml"
    file.write_text(
        '[holder]\npolicy = "p.json"\n[[storage.tiers]]\nbackend = "lmdb"\n'
        'capacity = 4096\npath = "data"\nmap_size = 1048576\n'
    )
    config = load(file)
    assert config.server.port == 8443
    assert config.holder.policy == str(tmp_path / "p.json")
    [tier] = config.storage.tiers
    assert (tier.backend, tier.capacity) == ("lmdb", 4096)
    assert tier.options == {"path": str(tmp_path / "data"), "map_size": 1048576}


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({**MINIMAL, "servr": {}}, "servr"),
        ({**MINIMAL, "server": {"prot": 1}}, "server.prot"),
        ({**MINIMAL, "server": {"port": "8443"}}, "server.port"),
        ({**MINIMAL, "server": {"insecure_http": 1}}, "server.insecure_http"),
        ({**MINIMAL, "server": {"log_level": "loud"}}, "server.log_level"),
        ({**MINIMAL, "holder": {"replica_ttl_ms": True}}, "holder.replica_ttl_ms"),
        ({**MINIMAL, "holder": {"descriptors": "d.json"}}, "holder.descriptors"),
        ({"storage": {"tiers": []}}, "storage.tiers"),
        ({"storage": {"tiers": [{"capacity": 1}]}}, "storage.tiers[0].backend"),
        ({"storage": {"tiers": [{"backend": "host", "capacity": 0}]}}, "storage.tiers[0].capacity"),
    ],
)
def test_errors_name_the_key(data: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(data)
    assert str(info.value).startswith(where + ":") or str(info.value).startswith(where + " ")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError):
        load(bad)


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    file = tmp_path / "k.toml"
    file.write_text('[server]\nport = 1\n[holder]\nuri = "https://a/kvsp/"\n')
    config = load(
        file,
        {
            "KVSTORE_SERVER__PORT": "9443",
            "KVSTORE_SERVER__INSECURE_HTTP": "1",
            "KVSTORE_HOLDER__INDEX_URI": "https://is.example:8443/is/",
            "KVSTORE_INDEX__REDIS_PREFIX": "2026-01-01",
            "KVSTORE_INDEX__DESCRIPTORS": "a.json, b.json",
            "KVSTORE_INSTANCE__TOKEN_INTERVAL_MS": "5",
            # Not ours: what Kubernetes sets for a Service named kvstore.
            "KVSTORE_PORT": "tcp://10.0.0.1:8443",
            "KVSTORE_SERVICE_HOST": "10.0.0.1",
            "OTHER": "x",
        },
    )
    assert config.server.port == 9443 and config.server.insecure_http is True
    assert config.holder.uri == "https://a/kvsp/"
    assert config.holder.index_uri == "https://is.example:8443/is/"
    assert config.index.redis_prefix == "2026-01-01"  # a string key stays a string
    assert config.index.descriptors == (str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert config.instance.token_interval_ms == 5.0
    for name, value, message in (
        ("KVSTORE_SERVER__PORT", "nine", "KVSTORE_SERVER__PORT: 'nine' is not int"),
        ("KVSTORE_SERVER__SHUTDOWN_GRACE_S", "nan", "not float"),
        ("KVSTORE_SERVER__HTTP2", "maybe", "not bool"),
        ("KVSTORE_HOLDER__BOGUS", "1", "holder.bogus: unknown key"),
        ("KVSTORE_NOPE__X", "1", "'nope' is not a section"),
        ("KVSTORE_STORAGE__TIERS", "[]", "unknown key"),
    ):
        with pytest.raises(ConfigError, match=message):
            load(file, {name: value})


def test_every_key_is_documented_with_its_default() -> None:
    # docs/configuration.md: one row per key of every section, with the
    # default the code has (the role sections are the roles' settings).
    import json
    import re
    from dataclasses import fields

    from kvstore import config as c
    from kvstore.settings import is_key

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    sections = {
        "server": c.ServerConfig,
        "holder": c.HolderConfig,
        "index": c.IndexConfig,
        "controller": c.ControllerConfig,
        "instance": c.InstanceConfig,
        "storage": c.StorageConfig,
    }
    for name, cls in sections.items():
        part = doc.split(f"## [{name}]", 1)[1].split("\n## ", 1)[0]
        rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", part, re.M))
        for field in fields(cls):
            if field.name == "tiers" or not is_key(field):
                continue  # tiers: their own table; runtime fields: not keys
            assert field.name in rows, f"{name}.{field.name} is not documented"
            default = field.default
            expected = (
                ("true" if default else "false")
                if isinstance(default, bool)
                else "[]"
                if isinstance(default, tuple)
                else json.dumps(default)
                if isinstance(default, str)
                else repr(default)
            )
            assert rows[field.name] == expected, f"{name}.{field.name}"
        assert set(rows) <= {f.name for f in fields(cls) if is_key(f)}, (
            f"[{name}] documents unknown keys"
        )


def test_every_backend_option_is_documented() -> None:
    # The schema (backends/schema.py) is the one definition: each backend's
    # row in docs/configuration.md names exactly its options.
    import re

    from kvstore.backends.schema import COMMON, SCHEMAS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    part = doc.split("## [[storage.tiers]]", 1)[1]
    for backend, schema in SCHEMAS.items():
        [row] = re.findall(rf"^\| `{backend}` \| (.*) \|$", part, re.M)
        while re.search(r"\([^()]*\)", row):
            row = re.sub(r"\s*\([^()]*\)", "", row)  # what is said of each option
        named_flat = set(re.findall(r"`(\w+)`", row))
        own = set(schema) - {"read_mbit_per_s"}  # documented for every backend below the table
        assert own <= named_flat, (backend, own - named_flat)
        assert named_flat <= set(schema), (backend, named_flat - set(schema))
    for option in [*COMMON, "read_mbit_per_s"]:
        assert f"`{option}`" in part


def test_greedy_is_not_claimed_deterministic_unless_configured(tmp_path: Path) -> None:
    # CK3: claimed deterministic, greedy tokens go out before the PC has a
    # checkpoint covering them, which is safe only with batch-invariant
    # kernels. The file's default, the library's and an explicit claim.
    from kvstore.settings import InstanceSettings

    file = tmp_path / "k.toml"
    file.write_text("[instance]\n")
    assert load(file).instance.greedy_deterministic is False
    assert InstanceSettings("https://ii.example/kvsp/").greedy_deterministic is False
    file.write_text("[instance]\ngreedy_deterministic = true\n")
    assert load(file).instance.greedy_deterministic is True


def test_write_through_needs_a_persistent_tier_below_the_first(tmp_path: Path) -> None:
    from kvstore.build import build_store
    from kvstore.config import check

    file = tmp_path / "k.toml"
    file.write_text(
        '[storage]\nwrite_through = true\n[[storage.tiers]]\nbackend = "host"\ncapacity = 4096\n'
    )
    [problem] = [p for p in check(load(file), ("holder",)) if p.startswith("storage.")]
    assert problem.startswith("storage.write_through:")
    with file.open("a") as out:
        out.write(
            f'[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 1048576\n'
            f'path = "{tmp_path / "lmdb"}"\nmap_size = 2097152\n'
        )
    assert not [p for p in check(load(file), ("holder",)) if p.startswith("storage.")]
    assert build_store(load(file)).write_through
