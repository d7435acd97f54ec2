"""A real holder's log (server.log_format, server.access_log): every line of
the process, uvicorn's included, in one format; one access line per request
with its principal and peer; none with the access log off."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import HolderClient
from kvstore.protocol.problems import NotFound

from ..storage.helpers import COMPAT, SCOPE, block, ref
from .test_holder_crash import LMDB, holder_over


def garbage_over_tls(port: int, context: ssl.SSLContext) -> None:
    """A request uvicorn itself refuses (it logs a WARNING of its own)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        tls.recv(4096)


async def run_holder(tmp_path: Path, extra: str) -> tuple[list[str], str]:
    holder, port, uri, context, config = holder_over(tmp_path, LMDB)
    (tmp_path / "holder.toml").write_text(config.replace("[holder]", f"{extra}\n[holder]", 1))
    holder.start(port)
    try:
        async with HolderClient(context, timeout_s=10) as client:
            await client.put_block(uri, COMPAT, SCOPE, ref(1).block_key, block())
            with pytest.raises(NotFound):
                await client.get_block(uri, COMPAT, SCOPE, ref(2).block_key)
        garbage_over_tls(port, context)
    finally:
        holder.stop()
    return (tmp_path / "holder.log").read_text().splitlines(), uri


async def test_json_lines_with_an_access_log(tmp_path: Path) -> None:
    lines, _ = await run_holder(tmp_path, 'log_format = "json"')
    parsed: list[dict[str, Any]] = [json.loads(line) for line in lines]  # every line
    access = [x for x in parsed if x["logger"] == "kvstore.access"]
    put = next(x for x in access if x["method"] == "PUT")
    assert put["status"] == 201 and put["octets_in"] == len(block()) > 0
    assert put["principal"] == "urn:kvstore:alice" and put["peer"] == "127.0.0.1"
    assert put["path"].endswith(ref(1).block_key) and put["duration_ms"] >= 0
    miss = next(x for x in access if x["method"] == "GET")
    assert miss["status"] == 404 and miss["level"] == "INFO"
    # uvicorn's own line, in the same format.
    assert any(x["logger"].startswith("uvicorn") and x["level"] == "WARNING" for x in parsed), lines
    # kvstore's own lines too (start-up), and no line is a Python repr.
    assert any(x["logger"] == "kvstore.serve" for x in parsed)
    assert not any("Error(" in x["message"] for x in parsed)


async def test_the_access_log_can_be_turned_off(tmp_path: Path) -> None:
    lines, _ = await run_holder(tmp_path, "access_log = false")
    assert not [x for x in lines if " kvstore.access " in x]
    assert any(" kvstore.serve " in x for x in lines)  # the rest is written
    # uvicorn's line in kvstore's text format, not uvicorn's "WARNING:  ...".
    warned = [x for x in lines if " WARNING uvicorn" in x]
    assert warned and not any(x.startswith("WARNING:") for x in lines)
