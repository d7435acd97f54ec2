"""TLS failures are visible on both ends (issue 33), and certificates can be
managed, on a real holder process: no client certificate, one from another
CA, an expired one, plain http:// to the TLS port. The server logs each
refused handshake once per peer and reason (a flood logs one line); the
client raises TlsRefused saying what to fix; ``kvstore health`` tells its
own certificate's problem (exit 3) from an unhealthy server (exit 1); a
certificate issued later from the same CA (``kvstore certs issue``) is
accepted after a restart, and its default roles let ``kvstore status``
read /metrics."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.client import HolderClient
from kvstore.protocol.problems import HolderUnavailable, TlsRefused, Unreachable
from kvstore.security import create_dev_certificates, issue_certificate
from kvstore.tls import client_context

from ..conftest import free_port
from ..storage.helpers import COMPAT, SCOPE, block, ref
from .test_holder_crash import LMDB, holder_over


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60
    )


async def test_tls_refusals_are_logged_and_explained(tmp_path: Path) -> None:
    holder, port, uri, alice, _ = holder_over(tmp_path, LMDB)
    certs = tmp_path / "certs"
    create_dev_certificates(tmp_path / "other", ["mallory"])
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    issue_certificate(certs, "old", days=1, not_before=past)
    ca = str(certs / "ca.pem")
    contexts = {
        "no client certificate": client_context(ca),
        "another CA": client_context(
            ca,
            str(tmp_path / "other" / "client-mallory.pem"),
            str(tmp_path / "other" / "client-mallory.key"),
        ),
        "expired": client_context(ca, str(certs / "client-old.pem"), str(certs / "client-old.key")),
    }
    key = ref(1).block_key
    try:
        holder.start(port)
        async with HolderClient(alice, timeout_s=10) as client:
            body = block()
            # Bytes keys, as BlockKeyChain.extend and compat_id give them.
            await client.put_block(
                uri, bytes.fromhex(COMPAT), bytes.fromhex(SCOPE), bytes.fromhex(key), body
            )
            assert (
                await client.get_block(uri, bytes.fromhex(COMPAT), SCOPE, bytes.fromhex(key))
                == body
            )
            with pytest.raises(ValueError, match="block_key: 32 octets"):
                await client.get_block(uri, COMPAT, SCOPE, b"short")
            with pytest.raises(TypeError):
                await client.get_block(uri, COMPAT, SCOPE, 7)  # type: ignore[arg-type]

        for what, context in contexts.items():
            for _ in range(4 if what == "no client certificate" else 1):  # a small flood
                async with HolderClient(context, timeout_s=10) as client:
                    with pytest.raises(TlsRefused) as refused:
                        await client.get_block(uri, COMPAT, SCOPE, key)
            assert "certificate" in refused.value.reason, (what, refused.value.reason)
        async with HolderClient(alice, timeout_s=10) as client:
            with pytest.raises(Unreachable) as plain:
                await client.get_block(uri.replace("https:", "http:"), COMPAT, SCOPE, key)
            assert isinstance(plain.value, TlsRefused | HolderUnavailable)
        async with HolderClient(timeout_s=10) as client:  # no context: verification stays on
            with pytest.raises(TlsRefused, match="server's certificate failed verification"):
                await client.get_block(uri, COMPAT, SCOPE, key)
        async with HolderClient(alice, timeout_s=10) as client:
            down = f"https://127.0.0.1:{free_port()}/kvsp/"
            with pytest.raises(HolderUnavailable, match="cannot connect") as gone:
                await client.get_block(down, COMPAT, SCOPE, key)
            assert gone.value.uri.startswith(down)

        health = f"https://127.0.0.1:{port}/healthz"
        expired = kvstore("health", health, "--certs", str(certs), "--principal", "old")
        assert expired.returncode == 3 and "expired" in expired.stderr, expired.stderr
        assert (
            kvstore("health", health, "--certs", str(certs), "--principal", "alice").returncode == 0
        )
    finally:
        holder.stop()
    log = (tmp_path / "holder.log").read_text()
    refusals = [line for line in log.splitlines() if "TLS handshake from 127.0.0.1 refused" in line]
    reasons = [line.split("refused: ", 1)[1] for line in refusals]
    assert reasons.count("no client certificate") == 1, refusals  # rate-limited
    assert any("not issued by this server's CA" in r for r in reasons), refusals
    assert any("expired" in r for r in reasons), refusals
    assert any("plain HTTP" in r for r in reasons), refusals
    down = kvstore("health", health, "--certs", str(certs), "--principal", "alice")
    assert down.returncode == 1, down.stderr  # the server is what is down


async def test_a_certificate_issued_later_is_accepted_after_a_restart(tmp_path: Path) -> None:
    holder, port, uri, _, _ = holder_over(tmp_path, LMDB)
    certs = tmp_path / "certs"
    policy = tmp_path / "policy.json"
    again = kvstore("certs", "init", str(certs))
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
    issued = kvstore(
        "certs", "issue", "--ca", str(certs), "--principal", "bob", "--policy", str(policy)
    )
    assert issued.returncode == 0, issued.stderr
    assert json.loads(issued.stdout)["roles"] == ["client", "metrics"]
    assert json.loads(policy.read_text())["principals"]["urn:kvstore:bob"]["roles"] == [
        "client",
        "metrics",
    ]
    bob = client_context(
        str(certs / "ca.pem"), str(certs / "client-bob.pem"), str(certs / "client-bob.key")
    )
    try:
        holder.start(port)  # (a restart of a running holder: the policy is read at start)
        async with HolderClient(bob, timeout_s=10) as client:
            body = block()
            await client.put_block(uri, COMPAT, SCOPE, ref(2).block_key, body)
            assert await client.get_block(uri, COMPAT, SCOPE, ref(2).block_key) == body
        cert, key = str(certs / "client-bob.pem"), str(certs / "client-bob.key")
        status = kvstore("status", uri, "--certs", str(certs), "--cert", cert, "--key", key)
        assert status.returncode == 0, status.stderr  # the metrics role: not a 403
    finally:
        holder.stop()


async def test_sighup_rotates_the_ca_certificate_and_policy_without_a_restart(
    tmp_path: Path,
) -> None:
    import asyncio
    import shutil
    import signal
    import time

    holder, port, uri, alice, config = holder_over(tmp_path, LMDB)
    # SIGHUP alone here (the files' own watch is tests/test_reload.py's).
    (tmp_path / "holder.toml").write_text(
        config.replace("[holder]", "reload_check_s = 0\n[holder]")
    )
    certs, new = tmp_path / "certs", tmp_path / "new"
    create_dev_certificates(new, ["bob"])
    bob = client_context(
        str(new / "ca.pem"), str(new / "client-bob.pem"), str(new / "client-bob.key")
    )
    log = tmp_path / "holder.log"

    async def hang_up_and_wait(line: str) -> None:
        assert holder.process is not None
        seen = log.read_text().count(line)
        holder.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while log.read_text().count(line) == seen:
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.02)

    key = ref(1).block_key
    holder.start(port)
    try:
        assert holder.process is not None
        pid = holder.process.pid
        async with HolderClient(alice, timeout_s=10) as client:
            await client.put_block(uri, COMPAT, SCOPE, key, block())
        async with HolderClient(bob, timeout_s=10) as client:
            with pytest.raises((TlsRefused, Unreachable)):  # another CA, for now
                await client.get_block(uri, COMPAT, SCOPE, key)
        # cert-manager rotates the CA and the server's certificate; the
        # operator adds bob to the policy.
        for name in ("ca.pem", "server.pem", "server.key"):
            shutil.copy(new / name, certs / name)
        policy = json.loads((tmp_path / "policy.json").read_text())
        policy["principals"]["urn:kvstore:bob"] = {"read_scopes": ["*"]}
        (tmp_path / "policy.json").write_text(json.dumps(policy))
        await hang_up_and_wait("reloaded the server certificate and CA and the policy (SIGHUP)")
        async with HolderClient(bob, timeout_s=10) as client:
            assert await client.get_block(uri, COMPAT, SCOPE, key)  # new connections: the new CA
        async with HolderClient(alice, timeout_s=10) as client:
            with pytest.raises((TlsRefused, Unreachable)):  # the old CA's: refused now
                await client.get_block(uri, COMPAT, SCOPE, key)
        # A broken file: everything in use stays, one line says why.
        (certs / "server.key").write_text("not a key\n")
        await hang_up_and_wait("reload (SIGHUP) refused, the certificates and policies in use stay")
        async with HolderClient(bob, timeout_s=10) as client:
            assert await client.get_block(uri, COMPAT, SCOPE, key)
        assert holder.process.poll() is None and holder.process.pid == pid  # never restarted
    finally:
        holder.stop()
