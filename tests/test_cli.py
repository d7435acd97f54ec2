"""The command line, driven as a user would: a subprocess, its stdout, its exit status."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.protocol import container as kc

from .protocol.vectors import COMPAT_ID, DESCRIPTOR, HEADER, K0, K1, SCOPE_ID, SCOPE_KEY, TOKENS


def kvstore(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def descriptor_file(tmp_path: Path) -> Path:
    path = tmp_path / "descriptor.json"
    path.write_text(json.dumps(DESCRIPTOR))
    return path


def test_keys_reproduces_the_appendix(descriptor_file: Path) -> None:
    # K1, K2, C2 through the CLI.
    out = kvstore(
        "keys",
        "--descriptor",
        str(descriptor_file),
        "--scope-key",
        SCOPE_KEY.hex(),
        "--tokens",
        ",".join(map(str, [*TOKENS, 5, 6])),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "compat_id": COMPAT_ID,
        "scope_id": SCOPE_ID,
        "block_keys": [K0, K1],
    }


def test_keys_reads_tokens_from_stdin(descriptor_file: Path) -> None:
    out = kvstore(
        "keys", "--descriptor", str(descriptor_file), "--scope-key", SCOPE_KEY.hex(),
        "--tokens", "-", stdin=json.dumps(TOKENS),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["block_keys"] == [K0, K1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scope-key", "00" * 16, "--tokens", "1"], "at least 32 octets"),
        (["--scope-key", "zz", "--tokens", "1"], "hexadecimal"),
        (["--scope-key", SCOPE_KEY.hex(), "--tokens", "1,x"], "integers"),
        (["--scope-key", SCOPE_KEY.hex(), "--tokens", "-5"], "[0, 2^32)"),
    ],
)
def test_keys_bad_input(descriptor_file: Path, args: list[str], message: str) -> None:
    out = kvstore("keys", "--descriptor", str(descriptor_file), *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_keys_invalid_descriptor(tmp_path: Path) -> None:
    bad = dict(DESCRIPTOR, kv_dtype="int3")
    path = tmp_path / "d.json"
    path.write_text(json.dumps(bad))
    out = kvstore(
        "keys", "--descriptor", str(path), "--scope-key", SCOPE_KEY.hex(), "--tokens", "1"
    )
    assert out.returncode == 2
    assert "descriptor.kv_dtype" in out.stderr


def test_container_inspect(tmp_path: Path, descriptor_file: Path) -> None:
    secs = [(os.urandom(8192), os.urandom(8192)) for _ in range(2)]
    blob = bytes(kc.encode(secs, first_layer=0, token_count=4))
    assert blob[:52] == HEADER
    path = tmp_path / "block.kvb"
    path.write_bytes(blob)
    out = kvstore("container", "inspect", str(path), "--descriptor", str(descriptor_file))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["codec_name"] == "raw"
    assert (info["first_layer"], info["layer_count"], info["token_count"]) == (0, 2, 4)
    assert [layer["k_length"] for layer in info["layers"]] == [8192, 8192]
    digests = [hashlib.sha256(k + v).digest() for k, v in secs]
    assert [layer["digest"] for layer in info["layers"]] == [d.hex() for d in digests]
    assert info["layers_digest"] == "sha-256:" + hashlib.sha256(b"".join(digests)).hexdigest()
    assert info["total_octets"] == len(blob)


@pytest.mark.parametrize("mangle", [lambda b: b[:30], lambda b: b"XXXX" + b[4:], lambda b: b""])
def test_container_inspect_malformed(tmp_path: Path, mangle: object) -> None:
    blob = bytes(kc.encode([(b"ab", b"cd")], token_count=1))
    path = tmp_path / "bad.kvb"
    path.write_bytes(mangle(blob))  # type: ignore[operator]
    out = kvstore("container", "inspect", str(path))
    assert out.returncode == 2
    assert out.stderr.startswith("kvstore: error: ")
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""


def test_container_inspect_missing_file(tmp_path: Path) -> None:
    out = kvstore("container", "inspect", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "cannot read" in out.stderr


def test_digest_model_and_tokenizer(tmp_path: Path) -> None:
    # C5: weight files concatenated in ascending byte order of their names.
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text('{"vocab": {}}')
    out = kvstore("digest", "model", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sha-256:" + hashlib.sha256(b"firstsecond").hexdigest()
    out = kvstore("digest", "tokenizer", str(tmp_path / "tokenizer.json"))
    expected = hashlib.sha256(b'{"vocab": {}}').hexdigest()
    assert out.stdout.strip() == "sha-256:" + expected
    out = kvstore("digest", "model", str(tmp_path / "config.json"))
    assert out.returncode == 2


def test_bench_protocol_quick_runs_and_reports_ratios() -> None:
    out = kvstore("bench", "protocol", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert {r["unit"] for r in results} == {"M tokens/s", "GB/s"}
    for r in results:
        assert r["value"] > 0
        assert r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])


def test_help_lists_the_commands() -> None:
    out = kvstore("--help")
    assert out.returncode == 0
    for command in ("keys", "container", "digest", "bench"):
        assert command in out.stdout


def test_bench_store_quick_covers_every_tier(redis_server: Any, s3_endpoint: str) -> None:
    out = kvstore(
        "bench", "store", "--quick", "--json",
        "--redis-url", redis_server.url, "--s3-endpoint", s3_endpoint,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    for tier in ("host", "LMDB", "Redis", "S3"):
        assert any(tier in name for name in names), tier
    for r in json.loads(out.stdout):
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])


def test_certs_init_makes_a_working_ca(tmp_path: Path) -> None:
    out = kvstore("certs", "init", str(tmp_path / "c"), "--principal", "alice")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["principals"] == {"alice": "urn:kvstore:alice"}
    policy = json.loads((tmp_path / "c" / "policy.json").read_text())
    assert "urn:kvstore:alice" in policy["principals"]
    import ssl

    from kvstore.security import client_context, server_context

    server_context(*info["server"], info["ca"])
    client_context(info["ca"], *info["clients"]["alice"])
    assert oct((tmp_path / "c" / "client-alice.key").stat().st_mode)[-3:] == "600"
    assert ssl.PEM_cert_to_DER_cert((tmp_path / "c" / "ca.pem").read_text())


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server\n", "kvstore: error:"),
        ('[server]\nhost="0.0.0.0"\ninsecure_http=true\n[holder]\npolicy="p.json"\n'
         '[[storage.tiers]]\nbackend="host"\ncapacity=1024\n', "non-loopback"),
        ('[[storage.tiers]]\nbackend="host"\ncapacity=1024\n', "holder.policy"),
        ('[holder]\npolicy="p.json"\n[[storage.tiers]]\nbackend="floppy"\ncapacity=1\n',
         "unknown backend"),
    ],
)  # fmt: skip
def test_serve_refuses_bad_configuration(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "p.json").write_text('{"principals": {}}')
    (tmp_path / "k.toml").write_text(toml)
    out = kvstore("serve", "--config", str(tmp_path / "k.toml"))
    assert out.returncode == 2
    assert message in out.stderr


def test_bench_holder_quick_runs_against_real_servers() -> None:
    out = kvstore("bench", "holder", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    names = [r["name"] for r in results]
    assert any(n.startswith("GET whole, host, mTLS") for n in names)
    assert any(n.startswith("PUT") for n in names)
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in results)


def test_bench_index_quick(redis_server: Any) -> None:
    out = kvstore("bench", "index", "--quick", "--json", "--redis-url", redis_server.url)
    assert out.returncode == 0, out.stderr
    names = [r["name"] for r in json.loads(out.stdout)]
    assert "lookup 8k keys x3, memory, p99" in names
    assert "lookup 8k keys x3, redis, p50" in names


def test_bench_controller_quick() -> None:
    out = kvstore("bench", "controller", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    names = [r["name"] for r in json.loads(out.stdout)]
    assert "status updates" in names
    assert "placements, 512-key prompts, 64 instances, 4 at once" in names
    placed = {r["name"]: r for r in json.loads(out.stdout)}
    assert placed["placements, 512-key prompts, 64 instances, 1 at once"]["value"] > 0


def test_instance_config_is_checked(tmp_path: Path) -> None:
    # Bad [instance] values are refused at start, with the key named.
    from backends.host import HostTier
    from kvstore.config import ConfigError, parse
    from kvstore.serve import build_instance
    from kvstore.storage import TieredStore

    (tmp_path / "policy.json").write_text('{"principals": {}}')
    store = TieredStore([(HostTier(), 1 << 20)])
    for key, value in (("status_ttl_ms", 10), ("max_pending_directives", 0)):
        config = parse({"instance": {"policy": "policy.json", key: value}}, tmp_path)
        with pytest.raises(ConfigError) as info:
            build_instance(config, store, None)
        assert f"instance.{key}" in str(info.value)


def test_config_check_names_the_key(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[server]\ninsecure_http = true\n[holder]\npolicy = "p.json"\n'
                    '[[storage.tiers]]\nbackend = "host"\ncapacity = 1024\n')  # fmt: skip
    (tmp_path / "p.json").write_text('{"principals": {}}')
    done = kvstore("config", "check", str(good))
    assert done.returncode == 0 and "ok for roles holder" in done.stdout, done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[holder]\nbogus = 1\n")
    failed = kvstore("config", "check", str(bad))
    assert failed.returncode == 2 and "holder.bogus: unknown key" in failed.stderr
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[server]\nhost = "0.0.0.0"\ninsecure_http = true\n'
                     '[holder]\npolicy = "p.json"\n[index]\npolicy = "p.json"\nstate = "reddis"\n'
                     '[[storage.tiers]]\nbackend = "lmbd"\ncapacity = 1024\n')  # fmt: skip
    refused = kvstore("config", "check", str(wrong), "--roles", "holder,index")
    assert refused.returncode == 2
    for message in ("storage.tiers[0].backend: 'lmbd'", "index.state: 'reddis'",
                    "server.insecure_http: refused on a non-loopback address"):  # fmt: skip
        assert message in refused.stderr, refused.stderr
    missing = kvstore("config", "check", str(good), "--roles", "holder,pc")
    assert missing.returncode == 2 and "controller.policy: a policy file is required" in (
        missing.stderr
    )


def test_health_fails_when_nothing_answers(tmp_path: Path) -> None:
    from kvstore.security import create_dev_certificates

    from .conftest import free_port

    create_dev_certificates(tmp_path, ["client"])
    done = kvstore("health", f"https://127.0.0.1:{free_port()}/healthz", "--certs", str(tmp_path))
    assert done.returncode == 1 and "healthz" in done.stderr
    no_certs = kvstore("health", "https://127.0.0.1:1/healthz", "--certs", str(tmp_path / "x"))
    assert no_certs.returncode == 1 and "Traceback" not in no_certs.stderr


def test_the_grafana_dashboard_uses_documented_metrics() -> None:
    import re

    root = Path(__file__).resolve().parent.parent
    dashboard = json.loads((root / "docker" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs
             for n in re.findall(r"\bkvstore_\w+", e)}  # fmt: skip
    documented = (root / "docs" / "operations.md").read_text()
    for name in names:
        stem = name.removesuffix("_total")
        suffix = stem.rsplit("_", 1)[-1]
        assert name in documented or stem in documented or f"_{suffix}" in documented, name
    assert len(dashboard["panels"]) >= 10
