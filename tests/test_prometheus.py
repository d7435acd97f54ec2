"""Prometheus's configuration and kvstore's alert rules (deploy/prometheus):
checked and unit-tested by promtool (Debian's prometheus package, which
.ci/run installs), and naming only metrics kvstore documents."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvstore.security import create_dev_certificates

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (.ci/run installs Debian's prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return subprocess.run(
        [found, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", "kvstore-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "kvstore-rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_a_broken_expectation_fails_the_rules_tests(tmp_path: Path) -> None:
    # The unit tests can fail: an alert expected with another label does.
    shutil.copy(DEPLOY / "kvstore-rules.yml", tmp_path)
    text = (DEPLOY / "kvstore-rules.test.yml").read_text()
    (tmp_path / "kvstore-rules.test.yml").write_text(
        text.replace("tier: remote-storage", "tier: local-storage", 1)
    )
    tested = promtool("test", "rules", "kvstore-rules.test.yml", cwd=tmp_path)
    assert tested.returncode != 0


def test_the_scrape_configuration_is_valid(tmp_path: Path) -> None:
    # Its TLS files where the configuration names them (promtool reads them).
    certs = tmp_path / "certs"
    create_dev_certificates(certs, ["prometheus"])
    text = (DEPLOY / "prometheus.yml").read_text()
    for name, made in (
        ("ca.crt", "ca.pem"),
        ("tls.crt", "client-prometheus.pem"),
        ("tls.key", "client-prometheus.key"),
    ):
        text = text.replace(f"/etc/prometheus/kvstore/{name}", str(certs / made))
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(DEPLOY / "kvstore-rules.yml", tmp_path)
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load(text)
    for job in config["scrape_configs"]:
        # Every listener asks for a client certificate.
        assert job["scheme"] == "https" and job["tls_config"]["cert_file"], job["job_name"]


def test_the_rules_name_documented_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "kvstore-rules.yml").read_text())
    documented = (ROOT / "docs" / "operations.md").read_text()
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {a["alert"] for a in alerts} >= {
        "KvstoreTierDegraded",
        "KvstoreTierNearlyFull",
        "KvstoreDigestFailures",
        "KvstoreLeaseRejections",
        "KvstorePublishBacklog",
        "KvstoreRestarting",
    }
    for alert in alerts:
        for name in re.findall(r"\bkvstore_\w+", alert["expr"]):
            stem = name.removesuffix("_total")
            # The table shortens a family's second name: `..._used_bytes`, `_capacity_bytes`.
            short = "_" + stem.split("_", 2)[2]
            assert name in documented or stem in documented or short in documented, name
        assert alert["annotations"]["summary"] and alert["labels"]["severity"]
