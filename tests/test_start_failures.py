"""Every failure to start is one line and exit 2 (issue 33), found by
``kvstore config check`` first where it can be: each row of the issue's
table, on a real ``kvstore serve`` process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.security import create_dev_certificates

from .conftest import free_port, wait_for_port

HEAD = """[server]
host = "127.0.0.1"
port = {port}
certfile = "certs/server.pem"
keyfile = "certs/server.key"
cafile = "certs/ca.pem"
[holder]
policy = "p.json"
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    create_dev_certificates(directory, ["alice"])
    return directory


def kvstore(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def write(tmp_path: Path, certs: Path, tiers: str, port: int = 0) -> Path:
    (tmp_path / "certs").symlink_to(certs)
    (tmp_path / "p.json").write_text('{"principals": {}}')
    file = tmp_path / "holder.toml"
    file.write_text(HEAD.format(port=port or free_port()) + tiers)
    return file


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvstore: error: "), line
    return line


LMDB = '[[storage.tiers]]\nbackend = "lmdb"\ncapacity = "64MiB"\n'


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (
            LMDB + 'path = "lmdb"\nmapsize = 1073741824\n',
            "storage.tiers[0].mapsize: unknown option of the lmdb backend; "
            'did you mean "map_size"?',
        ),
        (LMDB + "path = 3\n", "storage.tiers[0].path: a string, got 3"),
        (
            LMDB + 'path = "lmdb"\nmap_size = "32MiB"\n',
            "storage.tiers[0].map_size: 33554432 octets, not above its capacity of 67108864",
        ),
        (LMDB + 'path = "lmdb"\nsync = "yes"\n', "storage.tiers[0].sync: true or false"),
        (LMDB, "storage.tiers[0].path: required by the lmdb backend"),
        (
            '[[storage.tiers]]\nbackend = "host"\ncapacity = "lots"\n',
            "storage.tiers[0].capacity: a size in octets",
        ),
        (LMDB + 'path = "a-file/lmdb"\n', "storage.tiers[0].path: "),
    ],
)
def test_a_bad_tier_is_one_line_from_serve_and_from_config_check(
    tmp_path: Path, certs: Path, tiers: str, message: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    file = write(tmp_path, certs, tiers)
    for command in (["config", "check", str(file)], ["serve", "--config", str(file)]):
        line = one_line(kvstore(*command, cwd=tmp_path))
        assert message in line, (command, line)
    assert not (tmp_path / "a-file" / "lmdb").exists()


def test_sizes_may_be_written_with_units(tmp_path: Path, certs: Path) -> None:
    from kvstore.config import load

    file = write(
        tmp_path,
        certs,
        LMDB + 'path = "lmdb"\nmap_size = "1 GiB"\n'
        '[[storage.tiers]]\nbackend = "host"\ncapacity = "2GB"\n'
        '[storage]\nlease_max_octets_per_client = "8GiB"\n',
    )
    config = load(file)
    assert [t.capacity for t in config.storage.tiers] == [64 << 20, 2 * 10**9]
    assert config.storage.tiers[0].options["map_size"] == 1 << 30
    assert config.storage.lease_max_octets_per_client == 8 << 30


def test_a_missing_certificate_file_is_one_line(tmp_path: Path, certs: Path) -> None:
    file = write(tmp_path, certs, LMDB + 'path = "lmdb"\n')
    file.write_text(file.read_text().replace("certs/server.pem", "certs/gone.pem"))
    line = one_line(kvstore("serve", "--config", str(file), cwd=tmp_path))
    assert "server.certfile" in line and "gone.pem" in line and "No such file" in line
    assert not (tmp_path / "lmdb").exists()  # no tier was opened
    line = one_line(kvstore("config", "check", str(file), cwd=tmp_path))
    assert "gone.pem" in line


def test_a_port_in_use_is_one_line_before_anything_says_serving(
    tmp_path: Path, certs: Path
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        file = write(tmp_path, certs, LMDB + 'path = "lmdb"\n', port=taken.getsockname()[1])
        done = kvstore("serve", "--config", str(file), cwd=tmp_path)
    finally:
        taken.close()
    line = one_line(done)
    assert "cannot listen on 127.0.0.1:" in line and "in use" in line
    assert not (tmp_path / "lmdb").exists()


def test_port_and_host_flags_win_over_the_file(tmp_path: Path, certs: Path) -> None:
    file = write(
        tmp_path,
        certs,
        '[[storage.tiers]]\nbackend = "host"\ncapacity = "1MiB"\n[index]\npolicy = "p.json"\n',
    )
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(file), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        wait_for_port(port, timeout=30)  # the flag's port, not the file's
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=20)
    # The file has an [index] the holder alone does not serve: said once.
    assert "has [index], not served with --roles holder (--roles holder,index" in stderr


def test_config_check_checks_the_roles_whose_sections_the_file_has(
    tmp_path: Path, certs: Path
) -> None:
    file = write(
        tmp_path,
        certs,
        '[[storage.tiers]]\nbackend = "host"\ncapacity = 1024\n[index]\nmax_ttl_ms = 1000\n',
    )
    line = one_line(kvstore("config", "check", str(file), cwd=tmp_path))
    assert "index.policy" in line  # the [index] section's role was checked


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvstore.backends.schema import missing_extra

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a)
    )
    assert missing_extra("redis") == (
        "the redis backend needs redis, which is not installed (pip install 'kvsp-kvstore[redis]')"
    )
    assert missing_extra("lmdb") is None


def test_the_reference_engine_without_torch_is_one_line(tmp_path: Path) -> None:
    # As on an install without the engine extra: torch cannot be imported.
    code = (
        "import sys; sys.modules['torch'] = None; from kvstore.cli import main; "
        "sys.exit(main(['descriptor', '--engine', 'reference']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    line = one_line(done)
    assert "the reference engine needs torch" in line and "kvsp-kvstore[engine]" in line


async def test_the_listener_bound_early_gets_tcp_nodelay(tmp_path: Path) -> None:
    # The socket bound before the tiers open is handed to uvicorn: asyncio
    # sets TCP_NODELAY on its connections only when it says IPPROTO_TCP (a
    # proto of 0 made every small answer wait for a delayed ACK: C=1 loads
    # ran at a quarter of their rate).
    import asyncio

    from kvstore.config import load
    from kvstore.listener import bind_listener

    (tmp_path / "k.toml").write_text(f"[server]\nport = {free_port()}\n")
    sock = bind_listener(load(tmp_path / "k.toml"))
    accepted: list[asyncio.BaseTransport] = []

    class Keep(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.append(transport)

    server = await asyncio.get_running_loop().create_server(Keep, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        conn = accepted[0].get_extra_info("socket")
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
