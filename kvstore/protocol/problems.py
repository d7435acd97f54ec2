"""The one exception hierarchy of kvstore, and its rendering as RFC 9457 problem+json.

Every error a KVSP role can report to a peer is a :class:`KvspError`. Each class
carries the problem type suffix and HTTP status of the draft's table (H3), so
one handler renders every error and one ``isinstance`` check catches them all::

    KvspError                       (about:blank, 500)
    ├── BadRequest                  (about:blank, 400)
    │   ├── InvalidDescriptor       C1: a Compatibility Descriptor member is wrong
    │   ├── InvalidRecord           R1-R5: a JSON record failed validation
    │   ├── MalformedContainer      B1: a KV Block Container cannot be decoded
    │   └── PayloadTooLarge         (413) a body over the configured limit
    ├── NotFound                    kvsp-not-found           404
    │   ├── LayersUnavailable       kvsp-layers-unavailable  404
    │   └── UnknownResource         (about:blank, 404)       a map, context or instance
    ├── ScopeDenied                 kvsp-scope-denied        403
    ├── Incompatible                kvsp-incompatible        409
    ├── LeaseQuota                  kvsp-lease-quota         429
    ├── StaleEpoch                  kvsp-stale-epoch         409
    ├── InvalidState                kvsp-invalid-state       409
    ├── DigestMismatch              kvsp-digest-mismatch     422
    │   └── CorruptData             stored segment fails decryption or its digest (*)
    ├── PlanConflict                kvsp-plan-conflict       409
    ├── Conflict                    (about:blank, 409)       e.g. an epoch never assigned
    ├── PreconditionFailed          (about:blank, 412)       BL7: replica exists
    ├── PreconditionRequired        (about:blank, 428)       BL7: If-None-Match missing
    ├── Forbidden / Unauthenticated (about:blank, 403/401)   SEC1: policy, no certificate
    ├── TierUnavailable (*)         (about:blank, 503)       a storage tier is down
    ├── BadGateway                  (about:blank, 502)       a peer role refused or failed
    ├── Unreachable                 (client side, 503)       a role could not be reached
    │   ├── HolderUnavailable       a holder: refused, reset, timed out (its URI, why)
    │   └── TlsRefused              the TLS handshake failed: what to fix, which side
    └── InsufficientStorage         (about:blank, 507)       no tier can take a write
        └── TierFull (*)            one tier's backend is out of space

(*) The storage's own errors live with it, in :mod:`kvstore.storage.errors`.

Errors that are not KVSP problem types use ``about:blank`` with their status, as
RFC 9457 section 4.2.1 prescribes.
"""

from __future__ import annotations

import json
from typing import Any

KVSP_TYPE_BASE = "https://iana.org/assignments/kvsp#"
PROBLEM_MEDIA_TYPE = "application/problem+json"


class KvspError(Exception):
    """Base of every kvstore error; maps to one problem type and status."""

    # Class attributes, overridable on an instance (e.g. a routing error's status).
    suffix: str | None = None
    status: int = 500
    title: str = "Internal error"

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        # RFC 9457 extension members, e.g. the layers a holder does have.
        self.extensions = extensions

    @property
    def type_uri(self) -> str:
        return KVSP_TYPE_BASE + self.suffix if self.suffix else "about:blank"

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The problem details object (RFC 9457) for this error."""
        problem: dict[str, Any] = dict(self.extensions)
        problem.update(type=self.type_uri, title=self.title, status=self.status, detail=self.detail)
        if instance is not None:
            problem["instance"] = instance
        return problem


class BadRequest(KvspError):
    status = 400
    title = "Bad request"


class InvalidDescriptor(BadRequest):
    title = "Invalid Compatibility Descriptor"


class InvalidRecord(BadRequest):
    title = "Invalid record"


class MalformedContainer(BadRequest):
    title = "Malformed KV Block Container"


class NotFound(KvspError):
    suffix: str | None = "kvsp-not-found"
    status = 404
    title = "Block, lease, session, or directive unknown"


class LayersUnavailable(NotFound):
    suffix = "kvsp-layers-unavailable"
    title = "Requested layers not held"


class UnknownResource(NotFound):
    """None of what ``kvsp-not-found`` covers (a block, lease, session or
    directive, H3) but a resource of our own: a shard map, a context, an
    instance. A NotFound to code that catches one; ``about:blank`` on the wire."""

    suffix = None
    title = "Not Found"


class ScopeDenied(KvspError):
    suffix = "kvsp-scope-denied"
    status = 403
    title = "Client not authorized for the scope"


class Incompatible(KvspError):
    suffix = "kvsp-incompatible"
    status = 409
    title = "Compatibility ID mismatch"


class LeaseQuota(KvspError):
    suffix = "kvsp-lease-quota"
    status = 429
    title = "Lease quota exceeded"


class StaleEpoch(KvspError):
    suffix = "kvsp-stale-epoch"
    status = 409
    title = "Epoch older than current"


class InvalidState(KvspError):
    suffix = "kvsp-invalid-state"
    status = 409
    title = "Operation not allowed in the instance state"


class DigestMismatch(KvspError):
    suffix = "kvsp-digest-mismatch"
    status = 422
    title = "Stored data does not match its digest"


class PlanConflict(KvspError):
    suffix = "kvsp-plan-conflict"
    status = 409
    title = "Reshard plan does not match the current map version"


class Conflict(KvspError):
    """A request at odds with the resource's state that no KVSP type names,
    such as a checkpoint at an epoch the PC never assigned (the epoch is not
    older than current: ``kvsp-stale-epoch`` would say the wrong thing)."""

    status = 409
    title = "Conflict"


class PreconditionFailed(KvspError):
    status = 412
    title = "Precondition failed"


class PreconditionRequired(KvspError):
    """BL7: a block PUT must carry ``If-None-Match: *``."""

    status = 428
    title = "Precondition required"


class PayloadTooLarge(BadRequest):
    status = 413
    title = "Request body too large"


class RequestTimeout(BadRequest):
    """The body did not arrive in time (a slow or stalled upload)."""

    status = 408
    title = "Request body too slow"


class Forbidden(KvspError):
    """The authenticated principal may not use this resource at all."""

    status = 403
    title = "Forbidden"


class Unauthenticated(KvspError):
    """No client certificate was presented (mutual TLS is required)."""

    status = 401
    title = "Client certificate required"


class BadGateway(KvspError):
    """A role this one had to call (an instance, for the PC) refused or failed."""

    status = 502
    title = "Peer failed"


class Unreachable(KvspError):
    """Client side: the role at ``uri`` could not be reached (connection
    refused or reset, no answer in time). Never sent as a problem."""

    status = 503
    title = "Peer unreachable"

    def __init__(self, detail: str, uri: str = "", reason: str = "", **extensions: Any) -> None:
        super().__init__(detail, **extensions)
        self.uri, self.reason = uri, reason


class HolderUnavailable(Unreachable):
    """A holder could not be reached: its URI and why (a client falls back
    to another replica, or recomputes)."""

    title = "Holder unavailable"


class TlsRefused(Unreachable):
    """The TLS handshake failed; the message says which side refused and
    what to fix (a client certificate missing, expired or from another CA;
    the server's certificate not trusted; plain http to a TLS listener)."""

    title = "TLS handshake refused"


class InsufficientStorage(KvspError):
    status = 507
    title = "Insufficient storage"


# Every KVSP problem type of the draft's table, by suffix (H3). Clients use it
# to turn a received problem back into the matching exception.
PROBLEM_TYPES: dict[str, type[KvspError]] = {
    cls.suffix: cls
    for cls in (
        NotFound,
        ScopeDenied,
        Incompatible,
        LeaseQuota,
        StaleEpoch,
        InvalidState,
        DigestMismatch,
        PlanConflict,
        LayersUnavailable,
    )
    if cls.suffix is not None
}


def render_problem(error: KvspError, instance: str | None = None) -> bytes:
    """Serialize ``error`` as an ``application/problem+json`` body."""
    return json.dumps(error.to_problem(instance), separators=(",", ":")).encode()


def error_from_problem(status: int, problem: Any) -> KvspError:
    """Rebuild the exception a peer's problem+json stands for.

    Unknown types and malformed bodies fall back to the class of the status
    code (H4), so a client never needs to understand every type it receives.
    """
    detail = f"HTTP {status}"
    if isinstance(problem, dict):
        if isinstance(problem.get("detail"), str):
            detail = problem["detail"]
        elif isinstance(problem.get("title"), str):
            detail = problem["title"]
        type_uri = problem.get("type")
        if isinstance(type_uri, str) and type_uri.startswith(KVSP_TYPE_BASE):
            cls = PROBLEM_TYPES.get(type_uri[len(KVSP_TYPE_BASE) :])
            if cls is not None:
                return cls(detail)
    if status == 404:
        return NotFound(detail)
    if status == 403:
        return ScopeDenied(detail)
    if status == 412:
        return PreconditionFailed(detail)
    if status == 507:
        return InsufficientStorage(detail)
    error: KvspError = BadRequest(detail) if 400 <= status < 500 else KvspError(detail)
    if 400 <= status < 600:
        error.status = status  # the peer's status stays readable (a 503 vs a 500)
    return error
