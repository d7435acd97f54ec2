"""First use (``kvstore serve`` without a config, what ``make run`` starts):
a holder, an IS and a PC on one TLS listener with host and LMDB tiers under
one directory; the printed ``curl`` works; ``/healthz`` and ``/readyz``;
SIGTERM ends it cleanly and a second start serves the stored block again."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import free_port, wait_for_port


def start(directory: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--directory",
                str(directory),
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_for_port(port, timeout=30)
    return process


def curl(command: str) -> tuple[int, str]:
    """Run one of the banner's curl commands, adding -s and the status code."""
    args = shlex.split(command.replace("\\\n", " "))
    done = subprocess.run(
        [args[0], "-s", "-w", "%{http_code}", *args[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return int(done.stdout[-3:]), done.stdout[:-3]


def test_first_start_prints_a_working_curl_and_the_second_reuses_the_data(
    tmp_path: Path,
) -> None:
    directory, port, log = tmp_path / ".kvstore", free_port(), tmp_path / "serve.log"
    process = start(directory, port, log)
    try:
        banner = log.read_text()
        assert f"https://127.0.0.1:{port}/kvsp/" in banner and "made" in banner
        commands = re.findall(r"^    (curl .*?)(?=^    curl|\n\n)", banner, re.M | re.S)
        assert len(commands) == 2, banner
        put, get = commands[0], commands[1].split(" && ")[0]
        assert curl(put)[0] == 201
        assert curl(get)[0] == 200
        fetched = Path("/tmp/fetched.kvb").read_bytes()
        assert fetched == (directory / "example" / "block.kvb").read_bytes()
        tls = put.split(" -X ")[0]
        code, body = curl(f"{tls} https://127.0.0.1:{port}/readyz")
        assert code == 200 and '"index": "ok"' in body and "local-storage" in body
        assert '"recovery": {"phase": ' in body  # how far a restart's scan is
        # One scrape of the listener is every role, each labelled, and the
        # process's own figures once.
        code, body = curl(f"{tls} https://127.0.0.1:{port}/metrics")
        assert code == 200, body
        for role in ("holder", "index", "pc"):
            assert f'role="{role}"' in body, role
        assert 'kvstore_tier_used_bytes{position="0",role="holder",tier="host"}' in body
        assert 'kvstore_http_received_bytes_total{role="holder",route="put_block"} ' in body
        assert "process_resident_memory_bytes " in body and "python_gc_objects_collected" in body
        assert body.count("# TYPE kvstore_http_requests_total counter") == 1  # merged
        assert curl(f"{tls} https://127.0.0.1:{port}/healthz")[0] == 200
        # kvstore status / top read every role's {base}metrics (OPS1).
        bases = [f"https://127.0.0.1:{port}/{b}/" for b in ("kvsp", "is", "pc")]
        certs = ["--certs", str(directory / "certs")]
        # Without URLs or --certs: the development server of ./.kvstore.
        done = subprocess.run(
            [sys.executable, "-m", "kvstore", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        holder, index, pc = json.loads(done.stdout)
        assert holder["roles"] == ["holder"] and holder["hit_ratio"] == 1.0
        assert [t["tier"] for t in holder["tiers"]] == ["host#0", "local-storage#1"]
        assert holder["tiers"][0]["used"] > 0 and holder["ready"]["status"] == "ok"
        assert index["roles"] == ["index"] and pc["roles"] == ["pc"] and pc["instances"] == []
        live = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore",
                "top",
                bases[0],
                *certs,
                "--rounds",
                "2",
                "--interval",
                "0.1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert live.returncode == 0 and "host#0" in live.stdout, live.stderr
        assert "req/s" in live.stdout and "MiB/s out" in live.stdout  # rates of 2 scrapes
        # Elsewhere: KVSTORE_URL and KVSTORE_CERTS say where it is.
        env = {**os.environ, "KVSTORE_URL": bases[0], "KVSTORE_CERTS": str(directory / "certs")}
        probe = subprocess.run(
            [sys.executable, "-m", "kvstore", "health"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
            env=env,
        )
        assert probe.returncode == 0 and '"status": "ok"' in probe.stdout, probe.stderr
        # SIGTERM: a clean stop within the grace period.
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        process = start(directory, port, log)
        assert "reused" in log.read_text().split("kvstore: development server")[-1]
        # The block survived in LMDB: served again; a second PUT keeps it (412).
        deadline = time.monotonic() + 10
        while curl(get)[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert curl(put)[0] == 412
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def test_http2_is_offered_when_configured(tmp_path: Path) -> None:
    # H1 SHOULD: server.http2 (here by the environment override) offers h2 by
    # ALPN on the same TLS 1.3 listener with client certificates.
    import httpx

    from kvstore.tls import client_context

    directory, port, log = tmp_path / ".kvstore", free_port(), tmp_path / "serve.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--directory",
                str(directory),
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVSTORE_SERVER__HTTP2": "true"},
        )
    try:
        wait_for_port(port, timeout=30)
        certs = directory / "certs"
        context = client_context(
            str(certs / "ca.pem"),
            str(certs / "client-client.pem"),
            str(certs / "client-client.key"),
        )
        with httpx.Client(verify=context, http2=True) as client:
            response = client.get(f"https://127.0.0.1:{port}/readyz")
        assert response.http_version == "HTTP/2" and response.json()["status"] == "ok"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_the_port_of_the_environment_is_served_printed_and_logged_at_info(
    tmp_path: Path,
) -> None:
    # KVSTORE_SERVER__PORT listened there but printed 8443 everywhere, and
    # normal start-up lines came at WARNING.
    directory, port, log = tmp_path / ".kvstore", free_port(), tmp_path / "serve.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--directory", str(directory)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVSTORE_SERVER__PORT": str(port)},
        )
    try:
        wait_for_port(port, timeout=30)
        deadline = time.monotonic() + 30
        while "serving" not in log.read_text():
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        assert set(re.findall(r"https://[^/\s]+", text)) == {f"https://127.0.0.1:{port}"}, text
        commands = re.findall(r"^    (curl .*?)(?=^    curl|\n\n)", text, re.M | re.S)
        assert curl(commands[0])[0] == 201  # the holder's URIs are the listener's
        tls = commands[0].split(" -X ")[0]
        code, body = curl(f"{tls} https://127.0.0.1:{port}/readyz")
        assert code == 200 and '"index": "ok"' in body, body
        lines = [line for line in log.read_text().splitlines() if " kvstore." in line]
        assert any(" INFO kvstore.serve serving holder,index,pc on " in line for line in lines)
        # The holder serves while its store recovers, and says so; the scan
        # tells when it is done.
        assert any(
            " INFO kvstore.serve holder " in line and "recovering" in line for line in lines
        ), lines
        assert any(" INFO kvstore.storage recovery: " in line for line in lines), lines
        assert not [line for line in lines if " WARNING " in line or " ERROR " in line], lines
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_a_second_interrupt_does_not_skip_the_stop(tmp_path: Path) -> None:
    # Ctrl-C twice: uvicorn stops waiting for in-flight requests, but
    # kvstore's own stop still runs: the block only the host tier held is
    # spilled into LMDB, and a restart serves it.
    directory, port, log = tmp_path / ".kvstore", free_port(), tmp_path / "serve.log"
    process = start(directory, port, log)
    try:
        banner = log.read_text()
        commands = re.findall(r"^    (curl .*?)(?=^    curl|\n\n)", banner, re.M | re.S)
        put, get = commands[0], commands[1].split(" && ")[0]
        assert curl(put)[0] == 201
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)  # two at once would be one signal
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()
        # The stop ran as the lifespan's, in order: not cut by the loop's
        # teardown (which would cancel it midway and log the traceback).
        assert "Traceback" not in log.read_text(), log.read_text()
        process = start(directory, port, log)
        deadline = time.monotonic() + 10
        while curl(get)[0] != 200:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
