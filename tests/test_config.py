"""Configuration files: strict keys, typed values, paths relative to the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import ConfigError, load, parse

MINIMAL = {"storage": {"tiers": [{"backend": "host", "capacity": 1024}]}}


def test_minimal_file_takes_defaults(tmp_path: Path) -> None:
    file = tmp_path / "k.toml"
    file.write_text('[holder]\npolicy = "p.json"\n[[storage.tiers]]\nbackend = "lmdb"\n'
                    'capacity = 4096\npath = "data"\nmap_size = 1048576\n')  # fmt: skip
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
