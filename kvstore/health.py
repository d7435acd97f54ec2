"""Liveness and readiness on a plain-HTTP port of their own (``server.health_port``).

A kubelet's ``httpGet`` probe has no client certificate, so it cannot reach
``/healthz`` and ``/readyz`` on the mutual-TLS listener; an ``exec`` probe
of ``kvstore health`` costs a Python start each time. This listener answers
those two paths and nothing else: no block, no role, no detail of the tiers
(those stay behind the client certificate, on the TLS listener's
``/readyz``). Off by default: it is for a cluster's probes, on the pod's
network.

* ``GET /healthz``: 200 while the process answers (its event loop turns);
* ``GET /readyz``: 200 when the process serves (every tier reachable, the
  Index Service reachable for a holder that publishes), else 503; 503 while
  it starts.

Every answer is ``{"status": ...}`` with ``Connection: close``; a request is
read with bounds (8 KiB of head, 5 s), its body never.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable

from .listener import bind_tcp

log = logging.getLogger("kvstore.serve")

#: The most a probe's request head may take, and how long it may take to come.
HEAD_LIMIT = 8192
HEAD_TIMEOUT_S = 5.0

METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HealthListener:
    """Answers probes on ``sock`` (bound by the caller, before anything else
    starts: a taken port fails the start cleanly). ``ready`` is set once the
    process is built; until then ``/readyz`` says ``starting``."""

    def __init__(self, sock: socket.socket, setting: str = "server.health_port") -> None:
        self.sock, self.setting = sock, setting
        self.ready: Callable[[], bool] | None = None
        #: Also ``GET /metrics`` (Prometheus text) where set: a process whose
        #: figures name no block nor scope (``kvstore events``).
        self.metrics: Callable[[], bytes] | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, sock=self.sock, limit=HEAD_LIMIT)
        host, port = self.sock.getsockname()[:2]
        what = "metrics, liveness and readiness" if self.metrics else "liveness and readiness"
        log.info("serving %s on http://%s:%s (%s)", what, host, port, self.setting)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        self.sock.close()

    def status(self, path: str) -> tuple[int, str]:
        """The answer to a GET of ``path``: (status code, status word)."""
        if path == "/healthz":
            return 200, "ok"
        if path != "/readyz":
            return 404, "not found"
        if self.ready is None:
            return 503, "starting"
        try:
            ok = self.ready()
        except Exception:  # a probe never breaks the process
            log.exception("readiness check failed")
            ok = False
        return (200, "ok") if ok else (503, "unavailable")

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(head)
            code, word = (405, "method not allowed")
            media = "application/json"
            if method in ("GET", "HEAD") and path == "/metrics" and self.metrics is not None:
                code, body, media = 200, self.metrics(), METRICS_MEDIA_TYPE
            else:
                if method in ("GET", "HEAD"):
                    code, word = self.status(path)
                body = json.dumps({"status": word}).encode()
            headers = (
                f"HTTP/1.1 {code} {_REASONS[code]}\r\n"
                f"Content-Type: {media}\r\n"
                "Cache-Control: no-store\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
            writer.write(headers if method == "HEAD" else headers + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # not a probe, or too slow, or too long: the connection just goes
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path without its query) of a request head; ValueError if it
    is not an HTTP/1.x request line."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not a request line: {line[:80]!r}")
    return parts[0], parts[1].split("?", 1)[0]


def bind_health_port(host: str, port: int) -> socket.socket:
    """The listening socket of ``server.health_port`` on ``host`` (an empty
    host: every address, as a pod's probes need)."""
    return bind_tcp("server.health_port", host or "0.0.0.0", port, backlog=64)
