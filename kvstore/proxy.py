"""Client identity from a TLS-terminating proxy (docs/proxy.md).

The standard deployment of a service behind nginx, Envoy or an Istio
sidecar: the proxy does the mutual TLS, and passes the client's verified
certificate on in a request header. kvstore believes that header only from
the peer ``[server] trusted_proxy`` names:

* ``"unix"``: connections to ``[server] unix_socket`` (plain HTTP on a
  socket file of mode 0660; the proxy on the same host connects there);
* a loopback address (``"127.0.0.1"``; an Istio sidecar's ``"127.0.0.6"``):
  TCP connections from it, to the TLS listener or to the plain one on
  ``[server] proxy_port`` (loopback only).

The header read is the one ``[server] trusted_proxy_header`` names:

* ``x-client-cert`` (nginx): ``X-Client-Cert: $ssl_client_escaped_cert``
  (the URL-escaped PEM of the client certificate nginx verified);
* ``x-forwarded-client-cert`` (Envoy, Istio): XFCC, its last element (the
  one the nearest proxy added; ``forward_client_cert_details:
  SANITIZE_SET`` leaves only that one): the ``Cert`` field, else ``URI``,
  else the CN of ``Subject``.

The other header is refused (400) even from the trusted proxy: a proxy
sets its own header but passes a client's value of the other one on, and
believing either would let a client name itself. The forwarded certificate
is not checked against a CA here: the proxy verified it, and only the
proxy's peer is believed.

The principal is the certificate's first URI subjectAltName, else its
common name, as for a direct TLS client (SEC1). A request that carries
either header from any other peer is refused (403): a direct client
cannot claim another's identity. Without a ``trusted_proxy`` the headers
are ignored. The trusted peer's requests without a header have only that
connection's own identity: none on the unix socket or the proxy port (401).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

from .protocol.problems import BadRequest, Forbidden, KvspError
from .tls import PEER, PEER_USER, PRINCIPAL, principal_of_pem

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

NGINX_HEADER = b"x-client-cert"
XFCC_HEADER = b"x-forwarded-client-cert"
#: Longest identity header read (a certificate chain is a few KiB escaped).
MAX_HEADER_OCTETS = 32 << 10

_CN = re.compile(r"(?:^|,)\s*CN=((?:[^,\\]|\\.)*)")


def _split(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside double quotes (XFCC's grammar)."""
    parts, current, quoted, escaped = [], [], False, False
    for char in text:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\" and quoted:
            current.append(char)
            escaped = True
        elif char == '"':
            quoted = not quoted
            current.append(char)
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if quoted:
        raise ValueError("an unclosed quote")
    parts.append("".join(current))
    return parts


def _unquote_value(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def principal_of_xfcc(header: str) -> str | None:
    """The principal of the last element of an ``X-Forwarded-Client-Cert`` value."""
    element = _split(header, ",")[-1]
    fields: dict[str, str] = {}
    for pair in _split(element, ";"):
        key, sep, value = pair.partition("=")
        if sep:
            fields.setdefault(key.strip().lower(), _unquote_value(value))
    if fields.get("cert"):
        return principal_of_pem(unquote(fields["cert"]))
    if fields.get("uri"):
        return fields["uri"]
    found = _CN.search(fields.get("subject", ""))
    return re.sub(r"\\(.)", r"\1", found.group(1)) if found else None


def principal_of_escaped_pem(header: str) -> str | None:
    """The principal of nginx's ``$ssl_client_escaped_cert``."""
    return principal_of_pem(unquote(header))


HEADERS = {"x-client-cert": NGINX_HEADER, "x-forwarded-client-cert": XFCC_HEADER}


def identity_headers(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The identity headers a request carries, by (lower-case) name."""
    return {name: value for name, value in headers if name in (NGINX_HEADER, XFCC_HEADER)}


def forwarded_principal(carried: dict[bytes, bytes], header: bytes = NGINX_HEADER) -> str:
    """The principal ``header`` of the trusted proxy names; :class:`BadRequest`
    when it is malformed, names nobody, or the other identity header comes
    too (the proxy was to set one and remove the other: a client's own
    value of the other one passed on would be a forgery)."""
    if set(carried) != {header}:
        raise BadRequest(
            f"only the {header.decode()} identity header is believed here; "
            "the proxy must remove the other"
        )
    raw = carried[header]
    if len(raw) > MAX_HEADER_OCTETS:
        raise BadRequest("the forwarded client certificate is too long")
    try:
        text = raw.decode("latin-1")
        found = (
            principal_of_escaped_pem(text) if header == NGINX_HEADER else (principal_of_xfcc(text))
        )
    except Exception as exc:  # cryptography raises more than ValueError on odd certificates
        raise BadRequest(f"the forwarded client certificate is malformed: {exc}") from None
    if not found:
        raise BadRequest("the forwarded client certificate names no principal")
    return found


class ForwardedIdentity:
    """ASGI middleware: the principal of requests from ``trusted``, read from
    ``header`` (see the module); with ``trusted_uid``, from a loopback TCP
    peer only when that user owns its socket."""

    def __init__(
        self,
        app: ASGIApp,
        trusted: str,
        header: str = "x-client-cert",
        trusted_uid: int | None = None,
    ) -> None:
        if trusted != "unix":
            import ipaddress

            trusted = str(ipaddress.ip_address(trusted))  # as transports spell a peer
        self.app, self.trusted, self.header = app, trusted, HEADERS[header]
        self.trusted_uid = trusted_uid

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extensions = scope.get("extensions") or {}
        carried = identity_headers(scope.get("headers") or [])
        if not carried:
            await self.app(scope, receive, send)
            return
        try:
            # The peer first: nothing another peer sends is parsed.
            if extensions.get(PEER) != self.trusted or not self._trusted_user(extensions):
                raise Forbidden(
                    "a forwarded client identity is believed only from the trusted proxy"
                )
            principal = forwarded_principal(carried, self.header)
        except KvspError as exc:
            await _problem(send, exc)
            return
        tls: dict[str, Any] = {
            "client_cert_chain": [],
            "client_cert_name": None,
            "tls_version": None,
            "cipher_suite": None,
            "server_cert": None,
            "client_cert_error": None,
            PRINCIPAL: principal,
            "kvstore.forwarded": True,
        }
        await self.app({**scope, "extensions": {**extensions, "tls": tls}}, receive, send)

    def _trusted_user(self, extensions: dict[str, Any]) -> bool:
        """Any process may connect from any loopback address: over TCP the
        proxy is also known by the user owning its socket, when configured."""
        if self.trusted_uid is None or self.trusted == "unix":
            return True
        user = extensions.get(PEER_USER)
        return user is not None and user.uid == self.trusted_uid


async def _problem(send: Any, error: KvspError) -> None:
    body = json.dumps(error.to_problem()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"cache-control", b"no-store"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
