"""Problem Details (RFC 9457) for every KVSP error (H3, H4)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.problems import (
    KVSP_TYPE_BASE,
    PROBLEM_MEDIA_TYPE,
    PROBLEM_TYPES,
    BadRequest,
    Conflict,
    DigestMismatch,
    Incompatible,
    InsufficientStorage,
    InvalidDescriptor,
    InvalidRecord,
    InvalidState,
    KvspError,
    LayersUnavailable,
    LeaseQuota,
    MalformedContainer,
    NotFound,
    PlanConflict,
    PreconditionFailed,
    ScopeDenied,
    StaleEpoch,
    UnknownResource,
    error_from_problem,
    render_problem,
)

# The draft's "KVSP Problem Types" table: suffix, status, meaning (H3).
TABLE: list[tuple[type[KvspError], str, int, str]] = [
    (NotFound, "kvsp-not-found", 404, "Block, lease, session, or directive unknown"),
    (ScopeDenied, "kvsp-scope-denied", 403, "Client not authorized for the scope"),
    (Incompatible, "kvsp-incompatible", 409, "Compatibility ID mismatch"),
    (LeaseQuota, "kvsp-lease-quota", 429, "Lease quota exceeded"),
    (StaleEpoch, "kvsp-stale-epoch", 409, "Epoch older than current"),
    (InvalidState, "kvsp-invalid-state", 409, "Operation not allowed in the instance state"),
    (DigestMismatch, "kvsp-digest-mismatch", 422, "Stored data does not match its digest"),
    (
        PlanConflict,
        "kvsp-plan-conflict",
        409,
        "Reshard plan does not match the current map version",
    ),
    (LayersUnavailable, "kvsp-layers-unavailable", 404, "Requested layers not held"),
]

# Errors that are not KVSP problem types: about:blank with their status (RFC 9457 4.2.1).
NON_KVSP: list[tuple[type[KvspError], int]] = [
    (KvspError, 500),
    (BadRequest, 400),
    (InvalidDescriptor, 400),
    (InvalidRecord, 400),
    (MalformedContainer, 400),
    (PreconditionFailed, 412),
    (Conflict, 409),  # an epoch never assigned: not "older than current"
    (UnknownResource, 404),  # a map, context or instance: not what kvsp-not-found covers
]

ALL_CLASSES = [row[0] for row in TABLE] + [row[0] for row in NON_KVSP]


def test_type_base() -> None:
    # H3: https://iana.org/assignments/kvsp# followed by the suffix.
    assert KVSP_TYPE_BASE == "https://iana.org/assignments/kvsp#"
    assert PROBLEM_MEDIA_TYPE == "application/problem+json"


@pytest.mark.parametrize(("cls", "suffix", "status", "title"), TABLE)
def test_problem_type_table(cls: type[KvspError], suffix: str, status: int, title: str) -> None:
    # H3: every type of the table, with its URI, status and meaning.
    error = cls("detail text")
    assert error.suffix == suffix
    assert error.type_uri == "https://iana.org/assignments/kvsp#" + suffix
    assert error.status == status
    assert error.title == title
    assert PROBLEM_TYPES[suffix] is cls


def test_problem_types_registry_is_the_table() -> None:
    # H3: the registry holds exactly the nine types of the draft's table.
    assert set(PROBLEM_TYPES) == {suffix for _, suffix, _, _ in TABLE}
    assert len(PROBLEM_TYPES) == 9


@pytest.mark.parametrize(("cls", "status"), NON_KVSP)
def test_non_kvsp_errors_are_about_blank(cls: type[KvspError], status: int) -> None:
    # H3 / RFC 9457 4.2.1: errors outside the table use about:blank and their status.
    error = cls("detail text")
    assert error.type_uri == "about:blank"
    assert error.status == status
    assert error.suffix is None


def test_hierarchy() -> None:
    # H3: one base class catches everything; the 400s and 404s nest.
    for cls in ALL_CLASSES:
        assert issubclass(cls, KvspError)
    assert issubclass(InvalidRecord, BadRequest)
    assert issubclass(InvalidDescriptor, BadRequest)
    assert issubclass(MalformedContainer, BadRequest)
    assert issubclass(LayersUnavailable, NotFound)
    assert issubclass(UnknownResource, NotFound)  # caught as one; about:blank on the wire


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_render_problem(cls: type[KvspError]) -> None:
    # H3: an RFC 9457 JSON object with type, title, status and detail.
    error = cls("replica 00ff: something went wrong")
    body = render_problem(error)
    assert isinstance(body, bytes)
    problem = json.loads(body)
    assert problem == {
        "type": error.type_uri,
        "title": error.title,
        "status": error.status,
        "detail": "replica 00ff: something went wrong",
    }
    assert isinstance(problem["status"], int)


def test_render_problem_instance_and_extensions() -> None:
    # H3 / RFC 9457: "instance" and extension members are carried.
    error = LayersUnavailable("layers 16-31 not held", held=[0, 15])
    problem = json.loads(render_problem(error, instance="/kvsp/blocks/x"))
    assert problem["instance"] == "/kvsp/blocks/x"
    assert problem["held"] == [0, 15]
    assert problem["type"] == "https://iana.org/assignments/kvsp#kvsp-layers-unavailable"
    assert problem["status"] == 404
    invalid = json.loads(render_problem(InvalidRecord("replica.size: bad", member="replica.size")))
    assert invalid["member"] == "replica.size"


def test_extensions_cannot_override_standard_members() -> None:
    # H3: an extension named like a standard member does not replace it.
    error = ScopeDenied("no", status=200, type="about:blank", title="fine")
    problem = error.to_problem()
    assert problem["status"] == 403
    assert problem["type"] == "https://iana.org/assignments/kvsp#kvsp-scope-denied"
    assert problem["title"] == "Client not authorized for the scope"


@pytest.mark.parametrize(("cls", "suffix", "status", "title"), TABLE)
def test_error_from_problem_round_trip(
    cls: type[KvspError], suffix: str, status: int, title: str
) -> None:
    # H3: a rendered KVSP problem turns back into the same class and detail.
    error = cls(f"{suffix} happened")
    again = error_from_problem(error.status, json.loads(render_problem(error)))
    assert type(again) is cls
    assert again.detail == f"{suffix} happened"
    assert again.status == status
    assert again.type_uri == KVSP_TYPE_BASE + suffix


def test_error_from_problem_type_wins_over_status() -> None:
    # H3: the KVSP type identifies the error even behind an unexpected status.
    problem = {"type": KVSP_TYPE_BASE + "kvsp-stale-epoch", "status": 400, "detail": "old"}
    error = error_from_problem(400, problem)
    assert type(error) is StaleEpoch
    assert error.detail == "old"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (404, NotFound),
        (403, ScopeDenied),
        (412, PreconditionFailed),
        (400, BadRequest),
        (409, BadRequest),
        (418, BadRequest),
        (422, BadRequest),
        (429, BadRequest),
        (451, BadRequest),
        (499, BadRequest),
        (500, KvspError),
        (502, KvspError),
        (503, KvspError),
        (599, KvspError),
    ],
)
def test_error_from_problem_falls_back_by_status_class(status: int, cls: type[KvspError]) -> None:
    # H4: unknown types and unlisted statuses are handled by their class.
    for problem in (
        {"type": KVSP_TYPE_BASE + "kvsp-from-the-future", "title": "New", "detail": "d"},
        {"type": "https://example.com/probs/out-of-credit", "detail": "d"},
        {"type": "about:blank", "detail": "d"},
        {"detail": "d"},
    ):
        error = error_from_problem(status, problem)
        assert type(error) is cls, problem
        assert error.detail == "d"
        assert error.status // 100 == status // 100


@pytest.mark.parametrize("body", [None, "oops", b"\x00", [1, 2], 42, {"type": 7, "detail": 8}])
def test_error_from_problem_malformed_body(body: Any) -> None:
    # H4: a body that is not a problem object still yields an error of the status class.
    error = error_from_problem(503, body)
    assert type(error) is KvspError
    assert error.detail == "HTTP 503"
    error = error_from_problem(404, body)
    assert type(error) is NotFound
    assert error.detail == "HTTP 404"


def test_error_from_problem_detail_falls_back_to_title() -> None:
    # H4: without a string detail, the title (then the status) describes the error.
    assert error_from_problem(500, {"title": "Overloaded"}).detail == "Overloaded"
    assert error_from_problem(500, {"title": "T", "detail": None}).detail == "T"
    assert error_from_problem(500, {}).detail == "HTTP 500"


def test_error_from_problem_type_must_be_exact() -> None:
    # H3: type URIs compare as strings; an http:// or suffix-less URI is not a KVSP type.
    for type_uri in (
        "http://iana.org/assignments/kvsp#kvsp-lease-quota",
        "https://iana.org/assignments/kvsp#KVSP-LEASE-QUOTA",
        "https://iana.org/assignments/kvsp#",
        "kvsp-lease-quota",
    ):
        error = error_from_problem(429, {"type": type_uri})
        assert type(error) is BadRequest, type_uri


@given(
    st.sampled_from([row[0] for row in TABLE]),
    st.text(max_size=200),
)
def test_render_parse_property(cls: type[KvspError], detail: str) -> None:
    # H3: any detail text survives render_problem -> error_from_problem.
    error = cls(detail)
    again = error_from_problem(error.status, json.loads(render_problem(error)))
    assert type(again) is cls
    assert again.detail == detail


def test_a_problem_of_an_unknown_type_keeps_its_status() -> None:
    # H4: by the class of the status code; a 503 or a 507 stays one, so a
    # client can tell "full" and "unavailable" from a server bug.
    assert isinstance(error_from_problem(507, {"detail": "full"}), InsufficientStorage)
    unavailable = error_from_problem(503, {"type": "about:blank", "detail": "down"})
    assert unavailable.status == 503 and unavailable.detail == "down"
    assert error_from_problem(500, None).status == 500
    assert error_from_problem(418, None).status == 418
    assert isinstance(error_from_problem(418, None), BadRequest)
