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
        "keys",
        "--descriptor",
        str(descriptor_file),
        "--scope-key",
        SCOPE_KEY.hex(),
        "--tokens",
        "-",
        stdin=json.dumps(TOKENS),
    )
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


def test_keys_takes_the_scope_key_from_a_file(descriptor_file: Path, tmp_path: Path) -> None:
    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
    out = kvstore(
        "keys",
        "--descriptor",
        str(descriptor_file),
        "--scope-key-file",
        str(tmp_path / "scope.key"),
        "--tokens",
        ",".join(map(str, TOKENS)),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["block_keys"] == [K0, K1]
    missing = kvstore(
        "keys",
        "--descriptor",
        str(descriptor_file),
        "--scope-key-file",
        str(tmp_path / "none"),
        "--tokens",
        "1",
    )
    assert missing.returncode == 2 and "--scope-key-file" in missing.stderr


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
        "bench",
        "store",
        "--quick",
        "--json",
        "--redis-url",
        redis_server.url,
        "--s3-endpoint",
        s3_endpoint,
    )
    assert out.returncode == 0, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    for tier in ("host", "LMDB", "Redis", "S3", "restart recovery"):
        assert any(tier in name for name in names), tier
    for r in json.loads(out.stdout):
        if r["baseline"] is not None:  # else a plain figure (blocks/s)
            assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])


def test_certs_init_makes_a_working_ca(tmp_path: Path) -> None:
    out = kvstore("certs", "init", str(tmp_path / "c"), "--principal", "alice")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["principals"] == {"alice": "urn:kvstore:alice"}
    policy = json.loads((tmp_path / "c" / "policy.json").read_text())
    assert "urn:kvstore:alice" in policy["principals"]
    import ssl

    from kvstore.tls import client_context, server_context

    server_context(*info["server"], info["ca"])
    client_context(info["ca"], *info["clients"]["alice"])
    assert oct((tmp_path / "c" / "client-alice.key").stat().st_mode)[-3:] == "600"
    assert ssl.PEM_cert_to_DER_cert((tmp_path / "c" / "ca.pem").read_text())


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server\n", "kvstore: error:"),
        (
            '[server]\nhost="0.0.0.0"\ninsecure_http=true\n[holder]\npolicy="p.json"\n'
            '[[storage.tiers]]\nbackend="host"\ncapacity=1024\n',
            "non-loopback",
        ),
        ('[[storage.tiers]]\nbackend="host"\ncapacity=1024\n', "holder.policy"),
        (
            '[holder]\npolicy="p.json"\n[[storage.tiers]]\nbackend="floppy"\ncapacity=1\n',
            "unknown backend",
        ),
    ],
)
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
    assert any("2 workers" in n for n in names)
    assert all(r["value"] > 0 and (r["baseline"] is None or r["baseline"] > 0) for r in results)


def test_bench_fetch_quick_measures_verified_against_unverified() -> None:
    """kvstore bench fetch: every K against its unverified twin, the client's
    CPU per GB, the break-even prefill; nginx (with mTLS) where installed,
    which CI installs."""
    import shutil

    out = kvstore("bench", "fetch", "--quick", "--json", "--threads", "2")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    names = [r["name"] for r in results]
    for k in (1, 2):
        assert f"fetch verified (BL6), holder, 1 worker, K={k}" in names
        assert f"client CPU per verified GB, holder, 2 workers, K={k}" in names
    assert any(n.startswith("break-even prefill") for n in names)
    assert any(n.startswith("PUT through the pool") for n in names)
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists() or os.environ.get("CI"):
        assert "fetch verified, nginx, K=2" in names
    assert all(r["value"] > 0 and (r["baseline"] is None or r["baseline"] > 0) for r in results)


def test_bench_index_quick(redis_server: Any) -> None:
    out = kvstore("bench", "index", "--quick", "--json", "--redis-url", redis_server.url)
    assert out.returncode == 0, out.stderr
    names = [r["name"] for r in json.loads(out.stdout)]
    assert "lookup 8k keys x3, memory, p99" in names
    assert "lookup 8k keys x3, redis, p50" in names
    # The replicated state over a 3-master cluster started by the bench.
    assert "lookup 1k keys x3, replicated, 3-master cluster, another IS, p99" in names
    assert "publish at one IS to visible at the other, 3-master cluster, p99" in names


def test_bench_controller_quick() -> None:
    out = kvstore("bench", "controller", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    names = [r["name"] for r in json.loads(out.stdout)]
    assert "status updates" in names
    assert "placements, 512-key prompts, 64 instances, 4 at once" in names
    placed = {r["name"]: r for r in json.loads(out.stdout)}
    assert placed["placements, 512-key prompts, 64 instances, 1 at once"]["value"] > 0


def test_bench_events_quick() -> None:
    # vLLM's KV events: a bridge's rate, the lag to a real IS process, and
    # placements with residency records, each beside its same-run baseline.
    out = kvstore("bench", "events", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    applied = [r for r in rows if r["name"].startswith("bridge: BlockStored applied")]
    assert applied and all(r["value"] > 0 for r in applied)
    lag = [r for r in rows if r["name"].startswith("publish-to-visible lag")]
    assert len(lag) == 3 and all(0 < r["value"] < 10_000 for r in lag)
    assert any(r["name"].startswith("placements, 8192-key prompts") for r in rows)


def test_bench_load_quick_drives_real_holders(redis_server: Any) -> None:
    # Mixed PUT/GET traffic against holder processes over mTLS: every chain
    # but S3 (moto is the slow part), 1 and 16 clients, no errors.
    out = kvstore(
        "bench",
        "load",
        "--quick",
        "--json",
        "--seconds",
        "1",
        "--no-s3",
        "--redis-url",
        redis_server.url,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert not [n for n in rows if n.endswith("errors")], rows
    assert rows["host, C=16: ops/s"]["value"] > 0
    compared = rows["host+lmdb+redis, C=16: ops/s"]
    assert compared["baseline_name"] == "host only, same C" and compared["ratio"] > 0


def test_instance_config_is_checked(tmp_path: Path) -> None:
    # Bad [instance] values are refused at start, with the key named.
    from kvstore.config import check, parse

    (tmp_path / "policy.json").write_text('{"principals": {}}')
    for key, value in (("status_ttl_ms", 10), ("max_pending_directives", 0)):
        config = parse(
            {"instance": {"policy": "policy.json", key: value}, "server": {"insecure_http": True}},
            tmp_path,
        )
        problems = check(config, ("instance",))
        assert (
            [p for p in problems if p.startswith("instance.")]
            == [p for p in problems if p.startswith(f"instance.{key}:")]
            != []
        ), problems


def test_config_check_names_the_key(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[server]\ninsecure_http = true\n[holder]\npolicy = "p.json"\n'
        '[[storage.tiers]]\nbackend = "host"\ncapacity = 1024\n'
    )
    (tmp_path / "p.json").write_text('{"principals": {}}')
    done = kvstore("config", "check", str(good))
    assert done.returncode == 0 and "ok for roles holder" in done.stdout, done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[holder]\nbogus = 1\n")
    failed = kvstore("config", "check", str(bad))
    assert failed.returncode == 2 and "holder.bogus: unknown key" in failed.stderr
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(
        '[server]\nhost = "0.0.0.0"\ninsecure_http = true\n'
        '[holder]\npolicy = "p.json"\n[index]\npolicy = "p.json"\nstate = "reddis"\n'
        '[[storage.tiers]]\nbackend = "lmbd"\ncapacity = 1024\n'
    )
    refused = kvstore("config", "check", str(wrong), "--roles", "holder,index")
    assert refused.returncode == 2
    for message in (
        "storage.tiers[0].backend: 'lmbd'",
        "index.state: 'reddis'",
        "server.insecure_http: refused on a non-loopback address",
    ):
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
    names = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"\bkvstore_\w+", e)
    }
    documented = (root / "docs" / "operations.md").read_text()
    for name in names:
        stem = name.removesuffix("_total")
        suffix = stem.rsplit("_", 1)[-1]
        assert name in documented or stem in documented or f"_{suffix}" in documented, name
    assert len(dashboard["panels"]) >= 10
    # Any of several jobs and instances, chosen at the top of the dashboard.
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    for expr in exprs:
        for selector in re.findall(r"\bkvstore_\w+(\{[^}]*\})?", expr):
            assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, expr


GOOD_TOML = (
    '[server]\ninsecure_http = true\n[holder]\npolicy = "p.json"\n'
    '[index]\npolicy = "p.json"\n'
    '[[storage.tiers]]\nbackend = "host"\ncapacity = 1024\n'
)


@pytest.mark.parametrize(
    ("policy", "paths"),
    [
        (
            {"principals": {"urn:x": {"read_scopes": ["*", "A1"]}}},
            ['principals["urn:x"].read_scopes[1]: must be a hex16 scope id'],
        ),
        (
            {
                "principals": {
                    "urn:h": {"roles": ["holder", "hodler"], "holder": "h1/kvsp/"},
                    "urn:c": {"write_scopes": "*", "read_scope": ["*"]},
                }
            },
            [
                "principals[\"urn:h\"].roles[1]: unknown role 'hodler'",
                'principals["urn:h"].holder: must be an absolute https (or http) base URI',
                'principals["urn:c"].read_scope: unknown member',
                'principals["urn:c"].write_scopes: must be an array',
            ],
        ),
        (
            {"principals": {"urn:i": {"roles": "instance", "instance": 8443}}},
            [
                'principals["urn:i"].roles: must be an array of role names',
                'principals["urn:i"].instance: must be an absolute',
            ],
        ),
        ({"principal": {}}, ["principal: unknown member", "principals: required member"]),
    ],
)
def test_config_check_names_each_invalid_policy_member(
    tmp_path: Path, policy: Any, paths: list[str]
) -> None:
    (tmp_path / "k.toml").write_text(GOOD_TOML)
    (tmp_path / "p.json").write_text(json.dumps(policy))
    # The holder's (its [index] shares the file: checked too without --roles).
    done = kvstore("config", "check", str(tmp_path / "k.toml"), "--roles", "holder")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    # One line per invalid member: the configuration key, the file, the JSON path.
    assert len(lines) == len(paths), done.stderr
    for line, path in zip(lines, paths, strict=True):
        assert line.startswith(f"kvstore: error: holder.policy: {tmp_path / 'p.json'}: {path}"), (
            line
        )
    both = kvstore("config", "check", str(tmp_path / "k.toml"), "--roles", "holder,index")
    assert f"index.policy: {tmp_path / 'p.json'}: {paths[0]}" in both.stderr


def test_config_check_reports_an_unreadable_or_non_json_policy(tmp_path: Path) -> None:
    (tmp_path / "k.toml").write_text(GOOD_TOML)
    missing = kvstore("config", "check", str(tmp_path / "k.toml"))
    assert missing.returncode == 2
    assert f"holder.policy: No such file or directory: {tmp_path / 'p.json'}" in missing.stderr
    (tmp_path / "p.json").write_text('{"principals": {')
    broken = kvstore("config", "check", str(tmp_path / "k.toml"))
    assert broken.returncode == 2
    assert f"holder.policy: {tmp_path / 'p.json'}: not JSON: " in broken.stderr


class _TLSProbe:
    """A real mutual-TLS HTTPS server in a thread, answering /healthz and
    remembering each client's principal."""

    def __init__(self, certs: Path) -> None:
        import http.server
        import threading

        from kvstore.tls import principal_of, server_context

        seen: list[str | None] = []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(principal_of(self.connection.getpeercert()))
                body = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        context = server_context(
            str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem")
        )
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}/healthz"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def test_health_picks_the_client_certificate(tmp_path: Path) -> None:
    import shutil

    from kvstore.security import create_dev_certificates

    certs = tmp_path / "certs"
    create_dev_certificates(certs, ["client", "ops"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("ca.pem", "client-ops.pem", "client-ops.key"):
        shutil.copy(certs / name, elsewhere / name)
    probe = _TLSProbe(certs)
    try:
        # --certs alone: client-client.pem/.key, as before.
        done = kvstore("health", probe.url, "--certs", str(certs))
        assert done.returncode == 0 and '"ok"' in done.stdout, done.stderr
        # --principal NAME: client-NAME.pem/.key of --certs.
        done = kvstore("health", probe.url, "--certs", str(certs), "--principal", "ops")
        assert done.returncode == 0, done.stderr
        # --cert/--key/--cafile: any files, no directory.
        done = kvstore(
            "health",
            probe.url,
            "--certs",
            str(tmp_path / "none"),
            "--cert",
            str(elsewhere / "client-ops.pem"),
            "--key",
            str(elsewhere / "client-ops.key"),
            "--cafile",
            str(elsewhere / "ca.pem"),
        )
        assert done.returncode == 0, done.stderr
        assert probe.seen == ["urn:kvstore:client", "urn:kvstore:ops", "urn:kvstore:ops"]
        # Missing files: one line naming the file, unhealthy (exit 1).
        for args, named in (
            (["--principal", "nobody"], f"client certificate {certs / 'client-nobody.pem'}"),
            (["--cafile", str(tmp_path / "ca.pem")], f"CA certificate {tmp_path / 'ca.pem'}"),
            (
                ["--cert", str(elsewhere / "client-ops.pem"), "--key", str(elsewhere / "x.key")],
                f"client key {elsewhere / 'x.key'}",
            ),
        ):
            done = kvstore("health", probe.url, "--certs", str(certs), *args)
            assert done.returncode == 1, done.stderr
            assert done.stderr.strip().splitlines() == [
                f"kvstore: unhealthy: {probe.url}: {named} does not exist"
            ]
        half = kvstore("health", probe.url, "--cert", str(elsewhere / "client-ops.pem"))
        assert half.returncode == 2 and "--cert and --key go together" in half.stderr
        both = kvstore("health", probe.url, "--principal", "ops", "--cert", "c.pem")
        assert both.returncode == 2 and "not allowed with" in both.stderr
        assert len(probe.seen) == 3
    finally:
        probe.close()


def test_descriptor_of_a_file(descriptor_file: Path, tmp_path: Path) -> None:
    import rfc8785

    done = kvstore("descriptor", "--descriptor", str(descriptor_file))
    assert done.returncode == 0, done.stderr
    first, rest = done.stdout.split("\n", 1)
    assert first == f"compat_id {COMPAT_ID}"
    assert json.loads(rest) == DESCRIPTOR
    canonical = kvstore("descriptor", "--descriptor", str(descriptor_file), "--canonical")
    as_read = json.loads(descriptor_file.read_text())
    assert canonical.stdout.splitlines()[1] == rfc8785.dumps(as_read).decode()
    as_json = kvstore("descriptor", "--descriptor", str(descriptor_file), "--json")
    assert json.loads(as_json.stdout) == {"compat_id": COMPAT_ID, "descriptor": DESCRIPTOR}
    one_line = kvstore("descriptor", "--descriptor", str(descriptor_file), "--json", "--canonical")
    assert one_line.stdout.count("\n") == 1
    assert json.loads(one_line.stdout)["compat_id"] == COMPAT_ID
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(DESCRIPTOR, layers=0)))
    refused = kvstore("descriptor", "--descriptor", str(bad))
    assert refused.returncode == 2 and f"{bad}: descriptor.layers" in refused.stderr
    nothing = kvstore("descriptor")
    assert nothing.returncode == 2 and "--descriptor FILE, --config FILE" in nothing.stderr


def test_descriptor_of_an_instance_configuration(tmp_path: Path) -> None:
    # What `kvstore serve --roles instance` would build: the reference engine
    # of [instance], its weights from engine_seed unless engine_dir has some.
    from kvstore.instance.reference import ReferenceEngine

    (tmp_path / "k.toml").write_text(
        '[instance]\nengine = "reference"\nengine_dir = "engine"\n'
        "engine_seed = 3\nblock_tokens = 8\n"
    )
    expected = ReferenceEngine(tmp_path / "seed3", block_tokens=8, seed=3).descriptor
    done = kvstore("descriptor", "--config", str(tmp_path / "k.toml"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "compat_id": expected.compat_id_hex,
        "descriptor": expected.to_json(),
    }
    assert not (tmp_path / "engine").exists()  # nothing made where serve keeps its weights
    (tmp_path / "seed3.json").write_text(json.dumps(expected.to_json()))
    same = kvstore(
        "descriptor",
        "--engine",
        "reference",
        "--seed",
        "3",
        "--block-tokens",
        "8",
        "--descriptor",
        str(tmp_path / "seed3.json"),
    )
    assert same.returncode == 0, same.stderr
    assert same.stdout.splitlines()[0] == f"compat_id {expected.compat_id_hex}"
    # Weights already in engine_dir are what serve would load.
    ReferenceEngine(tmp_path / "engine", block_tokens=8, seed=4)
    other = kvstore(
        "descriptor",
        "--config",
        str(tmp_path / "k.toml"),
        "--descriptor",
        str(tmp_path / "seed3.json"),
    )
    assert other.returncode == 2
    assert "is not the engine's" in other.stderr and "(model_digest differ)" in other.stderr
    (tmp_path / "none.toml").write_text("[instance]\n")
    none = kvstore("descriptor", "--config", str(tmp_path / "none.toml"))
    assert none.returncode == 2 and "instance.engine: ''" in none.stderr
