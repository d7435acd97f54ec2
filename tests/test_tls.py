"""kvstore.tls without a network: contexts, the principal, and the request
header deadline on an injected clock (the loop's timers are recorded and
fired by the test, so no assertion depends on wall time)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.security import create_dev_certificates
from kvstore.tls import (
    PRINCIPAL,
    _HeaderDeadline,
    client_context,
    principal_from_scope,
    principal_of,
    server_context,
)


def test_contexts_are_tls_1_3_with_client_certificates(tmp_path: Path) -> None:
    create_dev_certificates(tmp_path, ["alice"])
    server = server_context(
        str(tmp_path / "server.pem"),
        str(tmp_path / "server.key"),
        str(tmp_path / "ca.pem"),
        alpn=["h2", "http/1.1"],
    )
    assert server.minimum_version == ssl.TLSVersion.TLSv1_3  # H1
    assert server.verify_mode == ssl.CERT_REQUIRED
    client = client_context(
        str(tmp_path / "ca.pem"),
        str(tmp_path / "client-alice.pem"),
        str(tmp_path / "client-alice.key"),
    )
    assert client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname


def test_the_principal_is_the_first_uri_san_else_the_common_name() -> None:
    sans = (("DNS", "h.example"), ("URI", "urn:a"), ("URI", "urn:b"))
    cert = {"subject": ((("commonName", "cn-name"),),), "subjectAltName": sans}
    assert principal_of(cert) == "urn:a"
    assert principal_of({"subject": ((("commonName", "cn-name"),),)}) == "cn-name"
    assert principal_of(None) is None and principal_of({}) is None


def test_the_connection_s_principal_is_read_not_parsed_again() -> None:
    # SEC1: taken once per connection; a request's scope only reads it.
    tls = {"client_cert_chain": ["not a certificate at all"], PRINCIPAL: "urn:kvstore:carol"}
    assert principal_from_scope({"extensions": {"tls": tls}}) == "urn:kvstore:carol"
    assert principal_from_scope({"extensions": {"tls": {"client_cert_chain": []}}}) is None
    assert principal_from_scope({}) is None


class Timer:
    def __init__(self, delay: float, fire: Callable[[], None]) -> None:
        self.delay, self.fire, self.cancelled = delay, fire, False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """The protocol's clock: timers are kept, and the test fires them."""

    def __init__(self) -> None:
        self.timers: list[Timer] = []

    def call_later(self, delay: float, fire: Callable[[], None]) -> Timer:
        self.timers.append(Timer(delay, fire))
        return self.timers[-1]

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]


class Transport:
    def __init__(self) -> None:
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Cycle:
    response_complete = False


class Server:
    """What the mixin needs of uvicorn's httptools protocol."""

    def __init__(self, loop: Loop) -> None:
        self.loop, self.cycle, self.pipeline = loop, None, []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def on_message_begin(self) -> None:
        pass

    def on_headers_complete(self) -> None:
        pass

    def on_response_complete(self) -> None:
        self.cycle.response_complete = True  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class Protocol(_HeaderDeadline, Server):  # type: ignore[misc]
    header_timeout_s = 0.5


@pytest.fixture
def connection() -> tuple[Protocol, Loop, Transport]:
    loop, transport = Loop(), Transport()
    protocol = Protocol(loop)
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, loop, transport


def test_a_silent_connection_is_closed_without_an_answer(connection: Any) -> None:
    _, loop, transport = connection
    [timer] = loop.armed()
    assert timer.delay == 0.5  # header_timeout_s from the connection's open
    timer.fire()
    assert transport.closed and transport.written == b""


def test_headers_that_do_not_complete_in_time_get_a_408(connection: Any) -> None:
    protocol, loop, transport = connection
    protocol.on_message_begin()
    [timer] = loop.armed()  # the clock of the open still runs: not re-armed
    timer.fire()
    assert transport.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"application/problem+json" in transport.written and transport.closed


def test_headers_in_time_stop_the_clock(connection: Any) -> None:
    protocol, loop, transport = connection
    protocol.on_message_begin()
    protocol.on_headers_complete()
    assert loop.armed() == [] and not transport.closed


def test_the_clock_never_runs_into_a_response_and_restarts_after_it(connection: Any) -> None:
    protocol, loop, transport = connection
    protocol.on_message_begin()
    protocol.on_headers_complete()
    protocol.cycle = Cycle()  # a response is being sent
    protocol.on_message_begin()  # a pipelined request begins meanwhile: no clock yet
    assert loop.armed() == []
    protocol.on_response_complete()  # ready to read it: its clock starts now
    [timer] = loop.armed()
    timer.fire()
    assert transport.written.startswith(b"HTTP/1.1 408") and transport.closed


def test_a_timer_that_fires_during_a_response_writes_nothing(connection: Any) -> None:
    protocol, loop, transport = connection
    [timer] = loop.armed()
    protocol.cycle = Cycle()
    timer.fire()
    assert transport.written == b"" and not transport.closed


def test_the_clock_stops_with_the_connection(connection: Any) -> None:
    protocol, loop, _ = connection
    protocol.connection_lost(None)
    assert loop.armed() == []
