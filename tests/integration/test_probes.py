"""A kubelet's probes reach a real holder process without a client
certificate (server.health_port), and learn nothing else there; the TLS
listener still asks for one."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ..conftest import free_port
from .test_holder_crash import LMDB, holder_over


def probe(port: int, path: str) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_probes_without_a_certificate(tmp_path: Path) -> None:
    holder, port, _, _, config = holder_over(tmp_path, LMDB)
    health = free_port()
    (tmp_path / "holder.toml").write_text(
        config.replace("[holder]", f"health_port = {health}\n[holder]", 1)
    )
    holder.start(port)
    try:
        assert probe(health, "/healthz") == (200, {"status": "ok"})
        assert probe(health, "/readyz") == (200, {"status": "ok"})
        assert probe(health, "/kvsp/shards")[0] == 404  # no role here
        assert probe(health, "/metrics")[0] == 404
        # The TLS listener still asks for a client certificate.
        context = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.pem"))
        with (
            pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)),
            urllib.request.urlopen(
                f"https://127.0.0.1:{port}/healthz", context=context, timeout=5
            ) as answer,
        ):
            answer.read()
    finally:
        holder.stop()
    assert (
        "serving liveness and readiness on http://0.0.0.0:" in (tmp_path / "holder.log").read_text()
    )
