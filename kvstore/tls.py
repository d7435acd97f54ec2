"""TLS in one place: every server and client context, the ASGI ``tls``
scope extension for uvicorn, and the principal of a connection (H1, SEC1).

* :func:`server_context` and :func:`client_context` build every context
  kvstore uses: TLS 1.3 or later (H1), the peer verified against the
  deployment's CA, client certificates required by servers. ``kvstore
  serve`` hands uvicorn its context through ``ssl_context_factory``.
* Roles authorize by the peer's certificate (SEC1), so the app must see it.
  The ASGI spec defines ``scope["extensions"]["tls"]`` for that, but no
  released uvicorn fills it in (tested with uvicorn 0.54). The protocol
  classes here do: on each new connection they read the transport's
  ``ssl_object`` once and wrap the app for that connection so every request
  scope carries::

    {"server_cert": None, "client_cert_chain": [<PEM>], "client_cert_name": <RFC 4514>,
     "client_cert_error": None, "tls_version": 0x0304, "cipher_suite": None,
     "kvstore.principal": <the principal>}

  and every scope, TLS or not, carries ``"kvstore.peer"``: ``"unix"`` or
  the peer's IP address, from the transport itself (:mod:`kvstore.proxy`
  believes a forwarded identity only from the trusted proxy's peer).

  The principal (the first URI subjectAltName, else the common name) is
  fixed per connection, so it is computed there, from the certificate
  OpenSSL already decoded, not per request. ``tests/integration/test_tls.py``
  fails if a uvicorn upgrade breaks this.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import functools
import logging
import socket
import ssl
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

log = logging.getLogger(__name__)

_TLS_VERSIONS = {"TLSv1.3": 0x0304, "TLSv1.2": 0x0303}

#: Our key in the ``tls`` extension: the connection's principal.
PRINCIPAL = "kvstore.principal"


# --- contexts --------------------------------------------------------------


def server_context(
    certfile: str,
    keyfile: str,
    cafile: str,
    *,
    require_client: bool = True,
    alpn: Sequence[str] | None = None,
) -> ssl.SSLContext:
    """A server context: TLS 1.3 only (H1), client certificates from ``cafile``;
    ``alpn``: the protocols offered (h2, http/1.1) when the server speaks several."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(certfile, keyfile)
    context.load_verify_locations(cafile)
    context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_OPTIONAL
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def client_context(
    cafile: str, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext:
    """A client context: TLS 1.3, the server verified against ``cafile``, our certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if certfile is not None:
        context.load_cert_chain(certfile, keyfile)
    return context


#: The client contexts a reload gives new files (kvstore.reload): a role's
#: own certificate for the roles it calls (a holder's for the IS, the PC's
#: for instances), as cert-manager renews it. Context -> (CA, cert, key).
_RELOADABLE: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[str, str, str]] = (
    weakref.WeakKeyDictionary()
)


def reloadable_client_context(cafile: str, certfile: str, keyfile: str) -> ssl.SSLContext:
    """:func:`client_context`, reloaded by a SIGHUP or a change of its files
    (:func:`reload_clients`): new connections present the new certificate
    and trust the new CA as well as the old; open ones finish as they are."""
    context = client_context(cafile, certfile, keyfile)
    _RELOADABLE[context] = (cafile, certfile, keyfile)
    return context


def reloadable_client_files() -> list[str]:
    """Every file of the reloadable client contexts (what a reload watches)."""
    return sorted({path for files in list(_RELOADABLE.values()) for path in files})


def check_clients() -> list[tuple[ssl.SSLContext, tuple[str, str, str]]]:
    """Each reloadable client context with its files, each set loaded
    into a scratch context first: a broken one raises (ssl.SSLError,
    OSError) and nothing is changed."""
    found = list(_RELOADABLE.items())
    for _, (cafile, certfile, keyfile) in found:
        client_context(cafile, certfile, keyfile)
    return found


def reload_clients(checked: list[tuple[ssl.SSLContext, tuple[str, str, str]]]) -> None:
    """Put the files :func:`check_clients` checked in place, in the live
    contexts (OpenSSL takes a new certificate and key for new handshakes;
    a CA is added to those trusted)."""
    for context, (cafile, certfile, keyfile) in checked:
        context.load_cert_chain(certfile, keyfile)
        context.load_verify_locations(cafile)


# --- refused handshakes --------------------------------------------------------


def refusal_reason(exc: BaseException) -> str:
    """Why a TLS handshake failed, as an operator reads it (the client is
    told in kvstore.client what to fix on its side)."""
    verify = getattr(exc, "verify_message", None)
    code = str(getattr(exc, "reason", "") or "")
    if verify:
        if "expired" in verify:
            return "the client certificate has expired"
        if any(x in verify for x in ("local issuer", "self-signed", "self signed", "signature")):
            return f"the client certificate is not issued by this server's CA ({verify})"
        return f"the client certificate failed verification ({verify})"
    reasons = {
        "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no client certificate",
        "HTTP_REQUEST": "plain HTTP sent to the TLS port",
        "WRONG_VERSION_NUMBER": "not TLS (or a TLS version below 1.3)",
        "UNSUPPORTED_PROTOCOL": "a TLS version below 1.3",
        "NO_SHARED_CIPHER": "no cipher in common",
    }
    return reasons.get(code, code.lower().replace("_", " ") or f"{type(exc).__name__}: {exc}")


class RefusedHandshakes:
    """The log of TLS handshakes a server refused: one WARNING per peer and
    reason per ``window_s`` (a scanner must not flood the log), with how
    many were not logged since. At most ``limit`` (peer, reason) pairs are
    remembered; the oldest go first."""

    def __init__(
        self,
        window_s: float = 60.0,
        limit: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self.limit, self.clock = window_s, limit, clock
        #: (peer, reason) -> (when last logged, refusals not logged since)
        self._seen: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self.count = 0

    def __call__(self, peer: str, exc: BaseException) -> None:
        self.count += 1
        reason = refusal_reason(exc)
        key, now = (peer, reason), self.clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.window_s:
            self._seen[key] = (last[0], last[1] + 1)
            return
        quiet = f" ({last[1]} more since, not logged)" if last is not None and last[1] else ""
        log.warning("TLS handshake from %s refused: %s%s", peer, reason, quiet)
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)


class _RefusalLoggingSSL(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS layer, telling :class:`RefusedHandshakes` of each failed
    handshake (asyncio itself logs them only in debug mode: a refused client
    certificate was invisible on the server)."""

    refusals: RefusedHandshakes

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        if isinstance(handshake_exc, ssl.SSLError) and not isinstance(
            handshake_exc, ssl.SSLEOFError
        ):  # (a peer gone mid-handshake, a port probe: nothing refused)
            peer = self._get_extra_info("peername")
            where = str(peer[0]) if isinstance(peer, tuple) and peer else "a peer"
            self.refusals(where, handshake_exc)
            # The alert OpenSSL wrote for the client goes out before the
            # connection is closed (asyncio closes at once, and the client
            # saw only a reset): it tells the client why.
            with contextlib.suppress(Exception):
                self._process_outgoing()  # type: ignore[attr-defined]
        super()._on_handshake_complete(handshake_exc)


class ServerTLS:
    """The listener's TLS context, which a reload replaces (certificates
    rotated without a restart: :mod:`kvstore.reload`). Each new connection
    takes the one current when it is made; an open one keeps its own."""

    def __init__(self, context: ssl.SSLContext, build: Callable[[], ssl.SSLContext]) -> None:
        self.current = context
        #: A new context from the files as they are now (raises if they are bad).
        self.build = build


def logged_tls(
    protocol_class: Callable[..., asyncio.BaseProtocol],
    tls_context: ServerTLS,
    refusals: RefusedHandshakes,
) -> Callable[..., asyncio.BaseProtocol]:
    """A protocol factory for a server given no ``ssl``: each connection's
    ``protocol_class`` under asyncio's TLS layer with the context current
    in ``tls_context``, its refused handshakes logged by ``refusals``. The
    app sees the same transport as with ``create_server(ssl=context)``
    (``sslcontext``, ``ssl_object``, ``peercert`` in its extra info)."""

    def make(*args: Any, **kwargs: Any) -> asyncio.BaseProtocol:
        app = protocol_class(*args, **kwargs)
        loop = kwargs.get("_loop") or asyncio.get_running_loop()
        context = tls_context.current
        tls = _RefusalLoggingSSL(loop, app, context, None, server_side=True)  # type: ignore[arg-type]
        tls.refusals = refusals
        return tls

    make.alpn_protocols = getattr(protocol_class, "alpn_protocols", None)  # type: ignore[attr-defined]
    return make


# --- the principal -----------------------------------------------------------


def principal_of(peercert: Mapping[str, Any] | None) -> str | None:
    """The principal of a peer certificate as ``ssl.SSLObject.getpeercert()``
    decodes it: its first URI subjectAltName, else its common name."""
    if not peercert:
        return None
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI":
            return str(value)
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


# --- the ASGI tls extension -------------------------------------------------


def tls_extension(transport: asyncio.BaseTransport) -> dict[str, Any] | None:
    """The ASGI ``tls`` extension dict of a connection, or None for plain TCP."""
    ssl_object: ssl.SSLObject | None = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    chain = [ssl.DER_cert_to_PEM_cert(der)] if der else []
    decoded = ssl_object.getpeercert() if der else None
    return {
        "server_cert": None,
        "client_cert_chain": chain,
        "client_cert_name": _rfc4514(decoded),
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
        PRINCIPAL: principal_of(decoded),  # once per connection (SEC1)
    }


def _rfc4514(peercert: Any) -> str | None:
    if not peercert:
        return None
    parts = [f"{k}={v}" for rdn in peercert.get("subject", ()) for k, v in rdn]
    return ",".join(reversed(parts)) or None


#: Our extension: the transport's own peer, ``"unix"`` for a unix-socket
#: connection, else its IP address (uvicorn's ``scope["client"]`` may be
#: rewritten from X-Forwarded-For; this is not): :mod:`kvstore.proxy`.
PEER = "kvstore.peer"


#: Our extension: a :class:`PeerUser` for a loopback TCP peer (its user id,
#: looked up once per connection when first asked), else None.
PEER_USER = "kvstore.peer_user"


class PeerUser:
    """The user id owning the other end of a loopback TCP connection, from
    ``/proc/net/tcp`` and ``tcp6`` (Linux): the row whose local address is
    the peer's and whose remote address is ours. None when it is not found
    (another OS, or the peer closed meanwhile)."""

    __slots__ = ("_looked", "_ours", "_peer", "_uid")

    def __init__(self, peer: tuple[Any, ...], ours: tuple[Any, ...]) -> None:
        self._peer, self._ours = peer, ours
        self._uid: int | None = None
        self._looked = False

    @property
    def uid(self) -> int | None:
        if not self._looked:
            self._looked = True
            self._uid = _socket_owner(self._peer, self._ours)
        return self._uid


def _proc_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} spells it: the address in host byte
    order by 32-bit words (little-endian here), the port in hex."""
    import ipaddress

    packed = ipaddress.ip_address(host).packed
    words = [packed[i : i + 4][::-1].hex().upper() for i in range(0, len(packed), 4)]
    return f"{''.join(words)}:{port:04X}"


def _socket_owner(peer: tuple[Any, ...], ours: tuple[Any, ...]) -> int | None:
    try:
        local, remote = _proc_address(peer[0], peer[1]), _proc_address(ours[0], ours[1])
    except (ValueError, IndexError, TypeError):
        return None
    table = "/proc/net/tcp6" if len(local) > 13 else "/proc/net/tcp"
    try:
        with open(table, encoding="ascii") as rows:
            next(rows, None)
            for row in rows:
                fields = row.split()
                if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                    return int(fields[7])
    except OSError:
        return None
    return None


def transport_peer(transport: asyncio.BaseTransport) -> str | None:
    """``"unix"``, the peer's IP address, or None when the transport does not say."""
    sock = transport.get_extra_info("socket")
    if sock is not None and getattr(sock, "family", None) == socket.AF_UNIX:
        return "unix"
    peer = transport.get_extra_info("peername")
    if isinstance(peer, list | tuple) and peer:
        return str(peer[0])
    return None


def _loopback_user(transport: asyncio.BaseTransport, peer: str | None) -> PeerUser | None:
    """For a loopback TCP peer, what finds its user id when asked (a trusted
    proxy's identity is believed only from its user, docs/proxy.md)."""
    if peer is None or peer == "unix" or not (peer.startswith("127.") or peer == "::1"):
        return None
    remote, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not isinstance(remote, tuple) or not isinstance(local, tuple):
        return None
    return PeerUser(remote, local)


class _WithTLS:
    """Per-connection wrapper that adds the ``tls`` extension (None for a
    plain connection) and the transport's peer to each scope."""

    __slots__ = ("app", "extensions")

    def __init__(
        self,
        app: ASGIApp,
        tls: dict[str, Any] | None,
        peer: str | None = None,
        user: PeerUser | None = None,
    ) -> None:
        self.app = app
        self.extensions: dict[str, Any] = {PEER: peer, PEER_USER: user}
        if tls is not None:
            self.extensions["tls"] = tls

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), **self.extensions}}
        await self.app(scope, receive, send)


# The mixins below are typed against the protocol they extend, so that mypy
# checks their calls of the protocol's own methods.
if TYPE_CHECKING:
    _AnyProtocol = asyncio.Protocol
    _HttpTools = HttpToolsProtocol
else:
    _AnyProtocol = _HttpTools = object


class _TLSScope(_AnyProtocol):
    """Mixin for a uvicorn HTTP protocol: wrap the app of each TLS connection."""

    app: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport_peer(transport)
        self.app = _WithTLS(
            self.app, tls_extension(transport), peer, _loopback_user(transport, peer)
        )


class TLSH11Protocol(_TLSScope, H11Protocol):
    pass


class TLSHttpToolsProtocol(_TLSScope, HttpToolsProtocol):
    pass


def _request_timeout() -> bytes:
    from .protocol.problems import RequestTimeout, render_problem

    body = render_problem(RequestTimeout("the request headers did not arrive in time"))
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\n"
        b"cache-control: no-store\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body


class _HeaderDeadline(_HttpTools):
    """Mixin for uvicorn's httptools protocol: a request's line and headers
    must arrive within ``header_timeout_s`` of the connection's open, or of
    the moment the server is ready to read them (a kept-alive connection's
    next request); else the connection is closed, with a 408 problem if a
    request had begun. uvicorn has no such limit: a client trickling its
    headers (or sending nothing at all after the TLS handshake) would keep a
    socket and its buffers for as long as it liked (slow-loris).

    The clock never runs while a response is being sent or a pipelined
    request waits its turn: the server is not reading then, and a 408
    written into a response in flight would corrupt it."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _reading_headers = False  # a request has begun; its headers are not complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvicorn's protocols take the stream transport the server gives them.
        super().connection_made(cast(asyncio.Transport, transport))
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        if self._header_timer is None and self._serving_nothing():
            self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Ready to read again: a request begun meanwhile has its clock now.
        if self._reading_headers and self._header_timer is None and self._serving_nothing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _serving_nothing(self) -> bool:
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and not self.pipeline

    def _arm_header_deadline(self) -> None:
        if self.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._serving_nothing():
            return  # never a 408 into a response in flight
        log.info(
            "closing a connection whose request headers took over %.1f s", self.header_timeout_s
        )
        if self._reading_headers:
            self.transport.write(_request_timeout())
        # Nothing received at all: closed without an answer, so a client's
        # first request crossing it on the wire is not answered 408.
        self.transport.close()


def http1_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools HTTP/1.1 with the ``tls`` extension and a deadline
    on request headers (0: none)."""

    class Protocol(_HeaderDeadline, TLSHttpToolsProtocol):
        pass

    Protocol.header_timeout_s = header_timeout_s
    Protocol.__name__ = Protocol.__qualname__ = "TLSHttpToolsProtocolWithHeaderDeadline"
    return Protocol


@functools.lru_cache(maxsize=4096)
def principal_of_pem(pem: str) -> str | None:
    """First URI subjectAltName of a PEM certificate, else its common name."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem.encode())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        if uris:
            return str(uris[0])
    except x509.ExtensionNotFound:
        pass
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def principal_from_scope(scope: Scope) -> str | None:
    """The authenticated principal of a request, or None without a client certificate.

    Read from the connection's ``tls`` extension, where these protocols put
    it; a scope filled by another server (only the PEM chain) is parsed, with
    a cache."""
    tls = (scope.get("extensions") or {}).get("tls")
    if not tls:
        return None
    if PRINCIPAL in tls:  # ours: this connection's, or a trusted proxy's (kvstore.proxy)
        found: str | None = tls[PRINCIPAL]
        return found
    if not tls.get("client_cert_chain"):
        return None
    return principal_of_pem(tls["client_cert_chain"][0])


def http2_protocol() -> type[asyncio.Protocol]:
    """uvicorn's experimental HTTP/2 (zttp) with the ``tls`` extension: ALPN
    picks h2 or http/1.1 per connection. Needs the ``http2`` extra (zttp)."""
    from uvicorn.protocols.http.auto_zttp_impl import AutoZttpProtocol
    from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol
    from uvicorn.protocols.http.zttp_impl import ZttpProtocol

    class TLSZttpH2Protocol(_TLSScope, ZttpH2Protocol):
        pass

    class TLSZttpProtocol(_TLSScope, ZttpProtocol):
        pass

    class TLSAutoZttpProtocol(AutoZttpProtocol):
        def _switch(self, http2: bool, initial_data: bytes = b"") -> None:
            protocol_class = TLSZttpH2Protocol if http2 else TLSZttpProtocol
            protocol = protocol_class(
                config=self.config,
                server_state=self.server_state,
                app_state=self.app_state,
                _loop=self.loop,
            )
            self.transport.set_protocol(protocol)
            protocol.connection_made(self.transport)
            if initial_data:
                protocol.data_received(initial_data)

    return TLSAutoZttpProtocol
