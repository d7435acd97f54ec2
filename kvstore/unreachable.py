"""What a failure to reach a role means, for the one who has to fix it: a
TLS handshake refused (which side, and why, from the alert the server sent)
or a peer down (its URI, why); and what an error answer means (its problem
as our exception). Used by :mod:`kvstore.client` and by ``kvstore health``."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from .logs import describe
from .protocol.problems import HolderUnavailable, KvspError, TlsRefused, error_from_problem
from .protocol.wire import JSON_MEDIA_TYPE

#: What an OpenSSL alert from the server means for the client, and what to fix.
TLS_ALERTS = {
    "certificate required": "the server requires a client certificate and got none "
    "(give the client context a certfile and keyfile)",
    "unknown ca": "the server does not trust the CA that issued your client certificate "
    "(use a certificate issued by the server's CA: kvstore certs issue)",
    "certificate expired": "the server says your client certificate has expired "
    "(issue a new one: kvstore certs issue)",
    "decrypt error": "the server could not verify your client certificate's signature: it is "
    "not issued by the server's CA (use one from kvstore certs issue with the server's CA)",
    "bad certificate": "the server refused your client certificate",
    "certificate unknown": "the server refused your client certificate",
    "wrong version number": "the server does not speak TLS on this port (http:// vs https://?)",
    "record layer failure": "the server does not speak TLS on this port (http:// vs https://?)",
}


def unreachable(method: str, url: str, exc: BaseException, timeout_s: float) -> KvspError:
    """A failure to reach a role as the error that says what happened and
    what to fix: :class:`TlsRefused` for a handshake (which side, why), else
    :class:`HolderUnavailable` (the caller narrows it) with the reason."""
    text = str(exc).lower()
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        reason = (
            f"the server's certificate failed verification "
            f"({exc.certificate_error}): check the CA the client trusts"
        )
        return TlsRefused(f"{method} {url}: {reason}", uri=url, reason=reason)
    for alert, reason in TLS_ALERTS.items():
        if alert in text:
            return TlsRefused(f"{method} {url}: {reason}", uri=url, reason=reason)
    if isinstance(exc, aiohttp.ServerDisconnectedError) and url.startswith("https:"):
        reason = (
            "the server closed the connection at once; with TLS 1.3 that is how a "
            "refused client certificate looks (expired, from another CA, or none): "
            "check the client's certfile and keyfile, and the server's log"
        )
        return TlsRefused(f"{method} {url}: {reason}", uri=url, reason=reason)
    if isinstance(exc, TimeoutError):
        reason = f"no answer within {timeout_s:g} s"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        reason = f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    else:
        reason = describe(exc)[:200]
    return HolderUnavailable(f"{method} {url}: {reason}", uri=url, reason=reason)


def error_of(status: int, headers: dict[str, str], body: bytes) -> KvspError:
    """An error answer (problem+json, H3) as the exception of its type."""
    problem: Any = None
    if headers.get("content-type", "").split(";")[0] in (
        "application/problem+json",
        JSON_MEDIA_TYPE,
        "application/json",
    ):
        try:
            problem = json.loads(body)
        except ValueError:
            problem = None
    return error_from_problem(status, problem)
