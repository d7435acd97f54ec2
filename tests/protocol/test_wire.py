"""HTTP-level pieces: ids, paths, layer ranges, Repr-Digest, Cache-Control (H2, H5, H6, BL1-BL5)."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.problems import BadRequest, DigestMismatch
from kvstore.protocol.wire import (
    BLOCK_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    NO_STORE,
    block_cache_control,
    block_path,
    block_resource_name,
    format_layers,
    parse_layers,
    parse_repr_digest,
    replica_path,
    repr_digest,
    role_id,
)

from .vectors import COMPAT_ID, K0, SCOPE_ID

B64URL = re.compile(r"[A-Za-z0-9_-]{43}")


def test_media_types_and_no_store() -> None:
    # H2, BL1, H5
    assert JSON_MEDIA_TYPE == "application/kvsp+json"
    assert BLOCK_MEDIA_TYPE == "application/kvsp-block"
    assert NO_STORE == "no-store"


# --- H6: {holder-id} / {instance-id} ----------------------------------------


def test_role_id_known_value() -> None:
    # H6: base64url without padding of SHA-256 of the base URI (pinned value).
    assert role_id("https://h1.example/kvsp/") == "lHUr-xSeDt_3qpqwQwQffdTj0kqh7BCC4vrbIxWUOkw"


@given(st.text(min_size=0, max_size=200))
def test_role_id_property(base_uri: str) -> None:
    # H6: 43 path-safe characters, no padding, decoding to the SHA-256 of the URI.
    ident = role_id(base_uri)
    assert B64URL.fullmatch(ident), ident
    assert "=" not in ident
    decoded = base64.urlsafe_b64decode(ident + "=")
    assert decoded == hashlib.sha256(base_uri.encode("utf-8")).digest()


def test_role_id_is_exact_uri() -> None:
    # H6: the id is of the URI as configured; a different string is a different id.
    assert role_id("https://h1.example/kvsp/") != role_id("https://h1.example/kvsp")
    assert role_id("https://ii7.example/kvsp/") != role_id("https://h1.example/kvsp/")


# --- BL1, P1: resource paths ------------------------------------------------


def test_block_path() -> None:
    # BL1: blocks/{compat}/{scope}/{block_key}, relative to the base URI (H7).
    assert block_path(COMPAT_ID, SCOPE_ID, K0) == f"blocks/{COMPAT_ID}/{SCOPE_ID}/{K0}"
    assert not block_path(COMPAT_ID, SCOPE_ID, K0).startswith("/")
    assert block_resource_name(COMPAT_ID, SCOPE_ID, K0) == (
        f"blocks/{COMPAT_ID}/{SCOPE_ID}/{K0}".encode("ascii")
    )


def test_replica_path() -> None:
    # P1, H6: replicas/{holder-id}/{block_key}
    holder = "https://h1.example/kvsp/"
    assert replica_path(holder, K0) == f"replicas/{role_id(holder)}/{K0}"


# --- BL2: layers=a-b --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0-15", (0, 15)),
        ("16-31", (16, 31)),
        ("3-3", (3, 3)),
        ("0-0", (0, 0)),
        ("0-4294967295", (0, 4294967295)),
    ],
)
def test_parse_layers(value: str, expected: tuple[int, int]) -> None:
    # BL2: an inclusive range a..b
    assert parse_layers(value) == expected
    assert format_layers(*expected) == value


@pytest.mark.parametrize(
    "value",
    [
        "15-0",  # reversed
        "0-4294967296",  # beyond uint32
        "4294967296-4294967297",
        "01-2",  # leading zero
        "1-02",
        "1",
        "1-",
        "-1",
        "-1-2",
        "1--2",
        "a-b",
        "1-2 ",
        " 1-2",
        "1 - 2",
        "1-2,4-5",
        "+1-2",
        "",
        "１-２",  # fullwidth digits  # noqa: RUF001
    ],
)
def test_parse_layers_invalid(value: str) -> None:
    # BL2: malformed ranges are a 400 Bad Request.
    with pytest.raises(BadRequest) as info:
        parse_layers(value)
    assert info.value.status == 400


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_layers_round_trip_property(a: int, b: int) -> None:
    # BL2
    first, last = min(a, b), max(a, b)
    assert parse_layers(format_layers(first, last)) == (first, last)


# --- BL4: Repr-Digest (RFC 9530) --------------------------------------------


def test_repr_digest_rfc9530_example() -> None:
    # BL4: RFC 9530's own example: {"hello": "world"} -> sha-256=:X48E9q...PE=:
    assert repr_digest(b'{"hello": "world"}') == (
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"
    )


def test_repr_digest_chunks() -> None:
    # BL4: the digest is over the whole representation, however it is chunked.
    body = bytes(range(256)) * 40
    whole = repr_digest(body)
    assert repr_digest(body[:100], bytearray(body[100:3000]), memoryview(body)[3000:]) == whole
    assert repr_digest() == "sha-256=:" + base64.b64encode(hashlib.sha256().digest()).decode() + ":"
    assert repr_digest(body + b"x") != whole


@given(st.binary(max_size=4096))
def test_repr_digest_round_trip_property(body: bytes) -> None:
    # BL4, BL6: the value parsed back is the SHA-256 of the body.
    assert parse_repr_digest(repr_digest(body)) == hashlib.sha256(body).digest()


def test_parse_repr_digest_dictionary() -> None:
    # BL4: an RFC 9530 dictionary; other algorithms are ignored, whitespace is tolerated.
    digest = hashlib.sha256(b"block").digest()
    b64 = base64.b64encode(digest).decode()
    sha512 = base64.b64encode(hashlib.sha512(b"block").digest()).decode()
    assert parse_repr_digest(f"sha-512=:{sha512}:, sha-256=:{b64}:") == digest
    assert parse_repr_digest(f"sha-256=:{b64}:,sha-512=:{sha512}:") == digest
    assert parse_repr_digest(f"  sha-256=:{b64}:  ") == digest


@pytest.mark.parametrize(
    "value",
    [
        "",
        "sha-512=:" + base64.b64encode(hashlib.sha512(b"x").digest()).decode() + ":",
        "sha-256=:" + base64.b64encode(b"too short").decode() + ":",  # not 32 octets
        "sha-256=:" + base64.b64encode(bytes(33)).decode() + ":",
        "sha-256=" + base64.b64encode(bytes(32)).decode(),  # not a byte sequence
        "sha-256=:" + hashlib.sha256(b"x").hexdigest() + ":",  # hex, not base64
        "SHA-256=:" + base64.b64encode(bytes(32)).decode() + ":",  # keys are lowercase
        "sha-256=:!!!!:",
    ],
)
def test_parse_repr_digest_without_sha256(value: str) -> None:
    # BL4, BL6: no usable sha-256 member -> the client treats it as a digest failure.
    with pytest.raises(DigestMismatch) as info:
        parse_repr_digest(value)
    assert info.value.status == 422


@pytest.mark.parametrize("value", ["sha-256=:abc:", "sha-256=:" + "A" * 45 + ":"])
def test_parse_repr_digest_bad_padding_is_digest_mismatch(value: str) -> None:
    # BL4, BL6: a malformed field value is a digest failure, not an internal error.
    with pytest.raises(DigestMismatch):
        parse_repr_digest(value)


# --- BL5: Cache-Control for block data --------------------------------------


@pytest.mark.parametrize(
    ("remaining_ms", "expected"),
    [
        (600000, "private, immutable, max-age=600"),
        (1999, "private, immutable, max-age=1"),  # rounded down, never beyond the TTL
        (1000, "private, immutable, max-age=1"),
        (999, "private, immutable, max-age=0"),
        (0, "private, immutable, max-age=0"),
        (-5000, "private, immutable, max-age=0"),
    ],
)
def test_block_cache_control(remaining_ms: int, expected: str) -> None:
    # BL5: private, immutable, max-age <= remaining replica TTL.
    assert block_cache_control(remaining_ms) == expected


@given(st.integers(min_value=-(10**9), max_value=2**40))
def test_block_cache_control_never_exceeds_ttl(remaining_ms: int) -> None:
    # BL5
    value = block_cache_control(remaining_ms)
    match = re.fullmatch(r"private, immutable, max-age=(\d+)", value)
    assert match is not None
    assert int(match[1]) * 1000 <= max(0, remaining_ms)
    assert "no-store" not in value
