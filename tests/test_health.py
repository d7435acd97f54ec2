"""The probes' port (server.health_port): plain HTTP, /healthz and /readyz
only, a status word and no detail, bounded reads (kvstore/health.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from kvstore.config import Config, ConfigError, ServerConfig, check
from kvstore.health import HEAD_LIMIT, HealthListener, bind_health_port

from .conftest import free_port


@pytest.fixture
async def health() -> AsyncIterator[tuple[HealthListener, int]]:
    port = free_port()
    listener = HealthListener(bind_health_port("127.0.0.1", port))
    await listener.start()
    yield listener, port
    await listener.stop()


async def ask(port: int, request: bytes) -> tuple[int, dict[str, str] | None, bytes]:
    """(status, JSON body or None, the whole answer) of one raw request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    if not answer:
        return 0, None, answer
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body) if body else None, answer


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: pod\r\nUser-Agent: kube-probe/1.31\r\n\r\n".encode()


async def test_live_at_once_ready_only_once_built_and_ready(
    health: tuple[HealthListener, int],
) -> None:
    listener, port = health
    assert (await ask(port, get("/healthz")))[:2] == (200, {"status": "ok"})
    assert (await ask(port, get("/readyz")))[:2] == (503, {"status": "starting"})
    ready = [False]
    listener.ready = lambda: ready[0]
    assert (await ask(port, get("/readyz?verbose=1")))[:2] == (503, {"status": "unavailable"})
    ready[0] = True
    status, body, answer = await ask(port, get("/readyz"))
    assert (status, body) == (200, {"status": "ok"})
    assert b"Cache-Control: no-store" in answer and b"Connection: close" in answer


async def test_nothing_else_is_served(health: tuple[HealthListener, int]) -> None:
    _, port = health
    # No role, no block, no metrics: those stay behind the client certificate.
    for path in ("/kvsp/blocks/x", "/metrics", "/", "/healthz/../metrics"):
        assert (await ask(port, get(path)))[:2] == (404, {"status": "not found"})
    assert (await ask(port, get("/healthz", "POST")))[0] == 405
    status, _, answer = await ask(port, get("/healthz", "HEAD"))
    assert status == 200 and answer.endswith(b"\r\n\r\n")  # no body


async def test_what_is_not_a_probe_gets_no_answer(health: tuple[HealthListener, int]) -> None:
    listener, port = health
    listener.ready = lambda: 1 / 0 > 0  # a failing check is "unavailable", never a crash
    assert (await ask(port, get("/readyz")))[:2] == (503, {"status": "unavailable"})
    assert (await ask(port, b"\x16\x03\x01 a TLS hello\r\n\r\n"))[0] == 0
    assert (await ask(port, b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * HEAD_LIMIT))[0] == 0
    assert (await ask(port, get("/healthz")))[0] == 200  # and it still serves


def test_the_port_is_checked_with_the_others() -> None:
    server = ServerConfig(port=8443, proxy_port=0, health_port=8443)
    problems = check(Config(server=server), ("holder",))
    assert any("server.health_port: overlaps" in p for p in problems), problems
    problems = check(Config(server=ServerConfig(health_port=70000)), ("holder",))
    assert any("server.health_port: 70000" in p for p in problems), problems
    problems = check(Config(server=ServerConfig(health_host="pod")), ("holder",))
    assert any("server.health_host" in p for p in problems), problems


def test_a_taken_port_is_one_line_naming_the_key() -> None:
    port = free_port()
    first = bind_health_port("127.0.0.1", port)
    try:
        with pytest.raises(ConfigError, match=rf"server.health_port: 127.0.0.1 port {port}: "):
            bind_health_port("127.0.0.1", port)
    finally:
        first.close()
