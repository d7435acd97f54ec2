"""ASGI pieces every role shares: problem+json, KVSP JSON, bounded bodies, identity.

* every error leaves through :func:`problem_response`, one mapping from the
  exception hierarchy to RFC 9457 bodies (H3, STYLE 7);
* every non-block response carries ``Cache-Control: no-store`` (H5);
* JSON bodies are ``application/kvsp+json`` (H2) and are read with a size
  limit before they are parsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Lifespan

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import RECEIVED, Metrics, MetricsMiddleware, Received
from .protocol._bytes import BytesLike
from .protocol.problems import (
    PROBLEM_MEDIA_TYPE,
    BadRequest,
    KvspError,
    PayloadTooLarge,
    RequestTimeout,
    render_problem,
)
from .protocol.wire import JSON_MEDIA_TYPE, NO_STORE
from .tls import principal_from_scope

if TYPE_CHECKING:
    from .security import Policy

log = logging.getLogger("kvstore.http")

#: The principal of requests without a client certificate, in the explicit
#: plain-HTTP development mode only.
ANONYMOUS = "anonymous"


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A KVSP JSON response (H2, H5)."""
    # allow_nan=False: Infinity/NaN are not JSON; producing one is a bug here.
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    merged = {"Cache-Control": NO_STORE, **(headers or {})}
    return Response(payload, status, headers=merged, media_type=JSON_MEDIA_TYPE)


def empty_response(status: int = 204, headers: Mapping[str, str] | None = None) -> Response:
    return Response(b"", status, headers={"Cache-Control": NO_STORE, **(headers or {})})


def problem_response(error: KvspError, instance: str | None = None) -> Response:
    """The problem+json response of any kvstore error (H3, H5)."""
    headers = {"Cache-Control": NO_STORE}
    if error.status == 503:
        headers["Retry-After"] = "1"
    if error.status in (408, 413):
        # The rest of that body is not read: the connection goes (a
        # slow-loris client keeps no socket).
        headers["Connection"] = "close"
    return Response(
        render_problem(error, instance),
        error.status,
        headers=headers,
        media_type=PROBLEM_MEDIA_TYPE,
    )


class _HttpStatus(KvspError):
    """A routing-level error (unknown path, wrong method) as a problem."""


async def handle_kvsp_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KvspError)
    return problem_response(exc, request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = _HttpStatus(exc.detail if isinstance(exc.detail, str) else "error")
    error.status = exc.status_code
    error.title = "Not found" if exc.status_code == 404 else "HTTP error"
    response = problem_response(error, request.url.path)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # Log the cause here; tell the peer nothing about internals.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(KvspError("internal error"), request.url.path)


EXCEPTION_HANDLERS = {
    KvspError: handle_kvsp_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
#: For an app that only mounts role apps: a role app already answers (and
#: logs) what it raised; what is left is an unknown path.
OUTER_HANDLERS = {KvspError: handle_kvsp_error, HTTPException: handle_http_exception}


#: A body must arrive within BODY_BASE_S plus its size at BODY_MIN_RATE
#: octets/s (a slow-loris upload is cut off, 408, and holds nothing after).
BODY_BASE_S = 10.0
BODY_MIN_RATE = 1 << 20


async def read_body(
    request: Request,
    limit: int,
    on_chunk: Callable[[bytes], object] | None = None,
    *,
    base_s: float = BODY_BASE_S,
    min_rate: float = BODY_MIN_RATE,
    into: Callable[[int], memoryview | None] | None = None,
) -> BytesLike:
    """The request body, refusing more than ``limit`` octets as they arrive (413)
    and bodies slower than ``base_s`` + size / ``min_rate`` (408).

    ``into``: for a body whose Content-Length is given, a writable buffer of
    that many octets to receive it (for example an extent of the host tier's
    arena, which then keeps it without a further copy); None from it, or no
    Content-Length, and the body is joined into new memory instead.

    A body that ends early (the client went away) raises
    :class:`starlette.requests.ClientDisconnect`; callers store nothing then.
    """
    declared = request.headers.get("content-length")
    expected = limit
    if declared is not None and declared.isdigit():
        expected = min(limit, int(declared))
    try:
        async with asyncio.timeout(base_s + expected / min_rate):
            return await _read_body(request, limit, on_chunk, into)
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {base_s + expected / min_rate:.1f} s"
        ) from None


async def _read_body(
    request: Request,
    limit: int,
    on_chunk: Callable[[bytes], object] | None,
    into: Callable[[int], memoryview | None] | None,
) -> BytesLike:
    declared = request.headers.get("content-length")
    buffer: memoryview | None = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest("Content-Length is not a number") from None
        if size > limit:
            raise PayloadTooLarge(f"body of {size} octets exceeds the limit of {limit}")
        if into is not None and size > 0:
            buffer = into(size)
            if buffer is not None and (len(buffer) != size or buffer.readonly):
                buffer = None  # not what was asked for: never send stale octets on
    # Without a buffer, chunks are kept as they arrive and joined once (a
    # single chunk is not copied at all): 2 MiB bodies arrive in dozens of
    # pieces. With one, each chunk is copied to its place in it: the join's
    # cost was faulting in new memory, not the copy (docs/holder.md).
    chunks: list[bytes] = []
    size = end = 0
    receive = request.receive  # straight from the server: no generator per message
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            end = size + len(chunk)
            if end > limit:
                raise PayloadTooLarge(f"body exceeds the limit of {limit} octets")
            if chunk:
                if buffer is None:
                    chunks.append(chunk)
                elif end <= len(buffer):
                    buffer[size:end] = chunk
                else:  # more than declared: the server cuts such a body off first
                    raise BadRequest("the body is longer than its Content-Length")
                if on_chunk is not None:
                    on_chunk(chunk)  # e.g. digest while the rest is still arriving
            size = end
            if not message.get("more_body", False):
                break
    finally:
        # The octets that arrived (a refused last chunk too), for the
        # metrics: not the declared length.
        counted: Received | None = request.scope.get(RECEIVED)
        if counted is not None:
            counted.octets += end
    if declared is not None and size != int(declared):
        raise ClientDisconnect()
    if buffer is not None:
        return buffer.toreadonly()  # what is kept is not written through the body
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_json(request: Request, limit: int = 1 << 20) -> Any:
    body = await read_body(request, limit)  # no ``into``: bytes
    try:
        return json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        # ValueError covers malformed JSON, bad UTF-8 and integers beyond
        # Python's digit limit; RecursionError, absurd nesting.
        raise BadRequest(f"body is not usable JSON: {str(exc)[:200]}") from None


def principal(request: Request, allow_anonymous: bool = False) -> str | None:
    """The authenticated principal (SEC1), or :data:`ANONYMOUS` in plain-HTTP dev mode."""
    found = principal_from_scope(request.scope)
    if found is None and allow_anonymous:
        return ANONYMOUS
    return found


@dataclass(slots=True)
class Role:
    """A role's app as ``kvstore serve`` composes it, typed (Starlette's
    ``app.state`` is not): the app of its routes relative to its base, the
    base it is mounted at, its metrics, and its role-specific counters."""

    mountable: Starlette
    base: str
    metrics: Metrics
    #: Who may scrape its metrics (the ``metrics`` or ``admin`` role).
    policy: Policy
    #: The role's name (holder, index, pc, instance): its samples' ``role``
    #: label where one scrape serves several roles.
    name: str = ""
    allow_anonymous: bool = False
    counters: Any = None

    def require_scraper(self, request: Request) -> None:
        """Store- and role-wide figures are a cross-tenant side channel:
        only the ``metrics`` or ``admin`` role of the policy may read them."""
        self.policy.require_any_role(principal(request, self.allow_anonymous), ("metrics", "admin"))


def role_of(app: Starlette) -> Role:
    """The :class:`Role` of an app made by :func:`role_app`."""
    role = getattr(app.state, "role", None)
    if not isinstance(role, Role):
        raise TypeError(f"{app!r} is not a role's app (kvstore.http.role_app)")
    return role


def role_app(
    base: str,
    routes: list[Route],
    metrics: Metrics,
    policy: Policy,
    allow_anonymous: bool = False,
    lifespan: Lifespan[Starlette] | None = None,
    name: str = "",
) -> Starlette:
    """A role's app: its ``routes`` under ``base``, ``/metrics`` beside them
    and ``{base}metrics`` among them,
    problem+json for every error, and request metrics. Store- and role-wide
    figures would be a cross-tenant side channel: only principals with the
    ``metrics`` (or ``admin``) role of ``policy`` may scrape them.

    Trailing-slash redirects are off: a 307 would skip authentication and
    carry no Cache-Control (H5); an unknown path is a 404 problem instead.
    """

    async def get_metrics(request: Request) -> Response:
        role.require_scraper(request)
        return Response(
            metrics.render(), headers={"Cache-Control": NO_STORE}, media_type=METRICS_CONTENT_TYPE
        )

    prefix = base.rstrip("/")
    # The role's own app: its routes and ``metrics`` relative to its base.
    # ``kvstore serve`` mounts it at the base beside the other roles
    # (``role_of(app).mountable``); alone, the app below mounts it itself.
    mountable = Starlette(
        routes=[*routes, Route("/metrics", get_metrics, methods=["GET"])],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
        lifespan=lifespan,
    )
    mountable.router.redirect_slashes = False
    role = Role(mountable, prefix, metrics, policy, name, allow_anonymous)
    app = mountable
    if prefix:
        # Also at ``/metrics``: a scraper of one role needs no base path.
        app = Starlette(
            routes=[Route("/metrics", get_metrics, methods=["GET"]), Mount(prefix, app=mountable)],
            exception_handlers=OUTER_HANDLERS,
            lifespan=lifespan,
        )
        app.router.redirect_slashes = False
    app.state.role = role
    return app
