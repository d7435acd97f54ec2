"""First use (kvstore.firstuse) without a server: the port and host in use
are the ones printed and written, a reused directory follows a new port
only while its files are as they were made, the banner in a container gives
commands for the host, and an unwritable directory is one clear line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvstore.firstuse import FirstUseError, prepare


def urls(text: str) -> set[str]:
    return set(re.findall(r"https://[^/\s]+", text))


def test_what_is_printed_and_written_follows_the_port(tmp_path: Path) -> None:
    first = prepare(tmp_path / "d", port=18443)
    assert urls(first.banner()) == {"https://127.0.0.1:18443"}
    saved = tomllib.loads(first.config.read_text())
    assert saved["server"]["port"] == 18443
    assert {saved[r]["uri"] for r in ("holder", "index", "controller")} == {
        "https://127.0.0.1:18443/kvsp/",
        "https://127.0.0.1:18443/is/",
        "https://127.0.0.1:18443/pc/",
    }
    policy = json.loads((tmp_path / "d" / "policy.json").read_text())
    assert policy["principals"]["urn:kvstore:holder"]["holder"] == "https://127.0.0.1:18443/kvsp/"
    again = prepare(tmp_path / "d")  # no port asked: what it was made with
    assert not again.created and again.base == "https://127.0.0.1:18443" and not again.note


def test_a_reused_directory_moves_to_a_new_port_while_unedited(tmp_path: Path) -> None:
    prepare(tmp_path / "d")
    moved = prepare(tmp_path / "d", port=19443)
    assert moved.base == "https://127.0.0.1:19443" and "moved" in moved.note
    assert urls(moved.banner()) == {"https://127.0.0.1:19443"}
    assert tomllib.loads(moved.config.read_text())["server"]["port"] == 19443
    assert "19443/kvsp/" in (tmp_path / "d" / "policy.json").read_text()
    # Edited by its user: not rewritten, and not served under wrong URIs.
    with moved.config.open("a") as out:
        out.write("# mine\n")
    with pytest.raises(FirstUseError, match="edited"):
        prepare(tmp_path / "d", port=20443)
    assert "19443" in moved.config.read_text()
    # A host its certificate is not for: a new directory is the way.
    prepare(tmp_path / "e")
    with pytest.raises(FirstUseError, match=r"not for 10\.1\.2\.3"):
        prepare(tmp_path / "e", host="10.1.2.3")


def test_the_banner_in_a_container_gives_commands_for_the_host(tmp_path: Path) -> None:
    first = prepare(tmp_path / "data", host="0.0.0.0")
    text = first.banner(container="3f2a9c1b7d4e")
    data = str(tmp_path / "data")
    assert f"docker cp 3f2a9c1b7d4e:{data}/certs ./kvstore-certs" in text
    assert f"docker cp 3f2a9c1b7d4e:{data}/example ./kvstore-example" in text
    commands = [line for line in text.splitlines() if line.lstrip().startswith("curl")]
    assert len(commands) == 2
    for line in text.splitlines():
        if "curl" in line or "--data-binary" in line or "cmp " in line:
            assert data not in line, line  # paths on the host, not in the container
    assert "--cacert kvstore-certs/ca.pem" in text and "@kvstore-example/block.kvb" in text
    assert urls(text) == {"https://127.0.0.1:8443"}


def test_an_unwritable_directory_is_one_line_naming_the_uid(tmp_path: Path) -> None:
    # A bind-mounted host directory owned by someone else (the image runs as
    # uid 10001). As root: without CAP_DAC_OVERRIDE, a directory of uid 12345;
    # as another user: a directory it may not write.
    import os

    data = tmp_path / "data"
    data.mkdir()
    command = [sys.executable, "-m", "kvstore", "serve", "--directory", str(data)]
    if os.geteuid() == 0:
        os.chown(data, 12345, 12345)
        command = [
            "setpriv",
            "--inh-caps=-all",
            "--bounding-set=-dac_override,-dac_read_search",
            "--",
            *command,
        ]
    else:
        data.chmod(0o555)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvstore: error: ") and "Traceback" not in done.stderr
    assert f"writable by uid {os.getuid()}" in line and str(data) in line
