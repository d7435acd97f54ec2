"""Data-plane records (R1, R2, R5, L1, L2, L4, LE1, PF1, PF3, B3)."""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.problems import DigestMismatch, InvalidRecord
from kvstore.protocol.records import (
    TIERS,
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaRecord,
    Residency,
    TargetEstimate,
)

from .vectors import COMPAT_ID, K0, K1, SCOPE_ID

K2 = hashlib.sha256(b"third block key").hexdigest()
LAYER_DIGESTS = [hashlib.sha256(f"layer {i}".encode()).hexdigest() for i in range(32)]
DIRECTIVE_ID = "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10"


def replica_digest(layer_digests: list[str]) -> str:
    """B3, written out: SHA-256 over the raw layer digests in ascending order."""
    return (
        "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in layer_digests)).hexdigest()
    )


def moqt_namespace(fields: list[bytes]) -> str:
    """R2: base64url (no padding) of the Track Namespace Fields, each with a length octet."""
    raw = b"".join(bytes([len(f)]) + f for f in fields)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


# The draft's Replica Record example with its placeholders filled in.
REPLICA: dict[str, Any] = {
    "block_key": K0,
    "compat_id": COMPAT_ID,
    "scope_id": SCOPE_ID,
    "holder": "https://h1.example/kvsp/",
    "codec": 1,
    "size": 2097152,
    "digest": replica_digest(LAYER_DIGESTS),
    "layer_digests": LAYER_DIGESTS,
    "residency": [
        {"tier": "device", "layers": [0, 15]},
        {"tier": "host", "layers": [16, 31], "read_mbit_per_s": 400000},
    ],
    "ttl_ms": 600000,
}

# The draft's lookup request example.
LOOKUP: dict[str, Any] = {
    "scope_id": SCOPE_ID,
    "compat_id": COMPAT_ID,
    "block_keys": [K0, K1, K2],
    "targets": ["https://ii7.example/kvsp/", "https://ii9.example/kvsp/"],
}

# The draft's prefetch directive example.
PREFETCH: dict[str, Any] = {
    "directive": DIRECTIVE_ID,
    "request_ref": "opaque-value-from-PC",
    "scope_id": SCOPE_ID,
    "compat_id": COMPAT_ID,
    "blocks": [{"block_key": K0, "sources": ["https://h1.example/kvsp/"]}],
    "layer_order": "ascending",
    "deadline_ms": 50,
    "lease_ms": 2000,
}

LEASE: dict[str, Any] = {"block_keys": [K0, K1], "ttl_ms": 2000}
LEASE_GRANT: dict[str, Any] = {"lease": "lease-0001", "ttl_ms": 2000, "block_keys": [K0, K1]}
PREFETCH_STATUS: dict[str, Any] = {"directive": DIRECTIVE_ID, "state": "partial", "loaded": [K0]}


def replica(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(REPLICA)
    out.update(changes)
    return out


def without(value: dict[str, Any], name: str) -> dict[str, Any]:
    out = copy.deepcopy(value)
    del out[name]
    return out


def with_(value: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(value)
    out.update(changes)
    return out


def assert_invalid(parse: Callable[[Any], Any], value: Any, member: str) -> InvalidRecord:
    """The parse fails with InvalidRecord naming ``member`` as the offending path."""
    with pytest.raises(InvalidRecord) as info:
        parse(value)
    assert str(info.value).startswith(member + ":"), str(info.value)
    assert info.value.extensions["member"] == member
    assert info.value.status == 400
    return info.value


# --- Replica Record ---------------------------------------------------------


def test_replica_draft_example_parses() -> None:
    # R2: every member of the draft's example, read back as typed values.
    record = ReplicaRecord.from_json(REPLICA)
    assert record.block_key == K0
    assert record.compat_id == COMPAT_ID
    assert record.scope_id == SCOPE_ID
    assert record.holder == "https://h1.example/kvsp/"
    assert record.codec == 1
    assert record.size == 2097152
    assert record.ttl_ms == 600000
    assert record.layer_digests == tuple(LAYER_DIGESTS)
    assert record.residency == (
        Residency("device", 0, 15),
        Residency("host", 16, 31, 400000.0),
    )
    assert record.residency[0].layer_count == 16
    assert record.layers == (0, 31)
    assert record.moqt_namespace is None


def test_replica_round_trip() -> None:
    # R2: to_json -> from_json gives an equal record; absent options are left out.
    record = ReplicaRecord.from_json(REPLICA)
    out = record.to_json()
    assert ReplicaRecord.from_json(out) == record
    assert "moqt_namespace" not in out
    assert "read_mbit_per_s" not in out["residency"][0]
    assert out["residency"][1]["read_mbit_per_s"] == 400000


def test_replica_unknown_members_ignored() -> None:
    # R1: unknown members at every level are ignored.
    value = replica(future_member={"x": [1, 2]}, BLOCK_KEY="not even hex")
    value["residency"][0]["compression"] = "lz4"
    assert ReplicaRecord.from_json(value) == ReplicaRecord.from_json(REPLICA)


def test_replica_member_names_case_sensitive() -> None:
    # R1: "Block_Key" is not "block_key".
    value = without(REPLICA, "block_key")
    value["Block_Key"] = K0
    assert_invalid(ReplicaRecord.from_json, value, "replica.block_key")


def test_replica_nested_member_names_case_sensitive() -> None:
    # R1: case-sensitivity holds inside residency entries too.
    value = replica()
    value["residency"][1] = {"Tier": "host", "layers": [16, 31]}
    assert_invalid(ReplicaRecord.from_json, value, "replica.residency[1].tier")


@pytest.mark.parametrize(
    "name",
    ["block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest", "ttl_ms"],
)
def test_replica_required_members(name: str) -> None:
    # R2: each required member missing (or null) is rejected by its path.
    assert_invalid(ReplicaRecord.from_json, without(REPLICA, name), f"replica.{name}")
    assert_invalid(ReplicaRecord.from_json, replica(**{name: None}), f"replica.{name}")


def test_replica_residency_required() -> None:
    # R2: residency is a required array.
    assert_invalid(ReplicaRecord.from_json, without(REPLICA, "residency"), "replica.residency")
    assert_invalid(ReplicaRecord.from_json, replica(residency={}), "replica.residency")


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        # wrong types: bool and string where an integer is expected (R2)
        ({"codec": True}, "replica.codec"),
        ({"size": "2097152"}, "replica.size"),
        ({"ttl_ms": 600000.5}, "replica.ttl_ms"),
        ({"ttl_ms": False}, "replica.ttl_ms"),
        # out-of-range integers
        ({"codec": 0}, "replica.codec"),  # 0x0000 is reserved (B5)
        ({"codec": 0x10000}, "replica.codec"),
        ({"size": -1}, "replica.size"),
        ({"size": 2**53}, "replica.size"),
        ({"ttl_ms": 2**32}, "replica.ttl_ms"),
        # hex32 / hex16 / digest forms
        ({"block_key": K0[:-2]}, "replica.block_key"),
        ({"block_key": K0 + "00"}, "replica.block_key"),
        ({"block_key": K0.upper()}, "replica.block_key"),
        ({"block_key": 17}, "replica.block_key"),
        ({"compat_id": COMPAT_ID[:32]}, "replica.compat_id"),
        ({"scope_id": SCOPE_ID + "00"}, "replica.scope_id"),
        ({"scope_id": SCOPE_ID.upper()}, "replica.scope_id"),
        ({"scope_id": K0}, "replica.scope_id"),
        ({"digest": REPLICA["digest"].upper()}, "replica.digest"),
        ({"digest": REPLICA["digest"][len("sha-256:") :]}, "replica.digest"),
        ({"digest": "sha-512:" + REPLICA["digest"][len("sha-256:") :]}, "replica.digest"),
        (
            {"layer_digests": [*LAYER_DIGESTS[:-1], LAYER_DIGESTS[-1].upper()]},
            "replica.layer_digests[31]",
        ),
        ({"layer_digests": [*LAYER_DIGESTS[:-1], 5]}, "replica.layer_digests[31]"),
        ({"layer_digests": "abc"}, "replica.layer_digests"),
        # holder URI (H1, H7)
        ({"holder": "ftp://h1.example/kvsp/"}, "replica.holder"),
        ({"holder": "/kvsp/"}, "replica.holder"),
        ({"holder": "h1.example/kvsp/"}, "replica.holder"),
        ({"holder": "https:///kvsp/"}, "replica.holder"),
        ({"holder": 42}, "replica.holder"),
    ],
)
def test_replica_invalid_members(changes: dict[str, Any], member: str) -> None:
    # R2: wrong types, ranges and forms are rejected, naming the member.
    assert_invalid(ReplicaRecord.from_json, replica(**changes), member)


def test_replica_not_an_object() -> None:
    # R2: the record itself must be a JSON object.
    assert_invalid(ReplicaRecord.from_json, [REPLICA], "replica")
    assert_invalid(ReplicaRecord.from_json, None, "replica")


@pytest.mark.parametrize(
    ("residency", "member"),
    [
        # R2: inclusive ranges MUST NOT overlap, in any order of entries
        (
            [{"tier": "device", "layers": [0, 16]}, {"tier": "host", "layers": [16, 31]}],
            "replica.residency",
        ),
        (
            [{"tier": "host", "layers": [10, 31]}, {"tier": "device", "layers": [0, 10]}],
            "replica.residency",
        ),
        (
            [{"tier": "device", "layers": [0, 31]}, {"tier": "host", "layers": [4, 5]}],
            "replica.residency",
        ),
        # reversed range
        ([{"tier": "device", "layers": [15, 0]}], "replica.residency[0].layers"),
        # not a pair of non-negative integers
        ([{"tier": "device", "layers": [0]}], "replica.residency[0].layers"),
        ([{"tier": "device", "layers": [0, 1, 2]}], "replica.residency[0].layers"),
        ([{"tier": "device", "layers": "0-15"}], "replica.residency[0].layers"),
        ([{"tier": "device"}], "replica.residency[0].layers"),
        ([{"tier": "device", "layers": [-1, 15]}], "replica.residency[0].layers[0]"),
        ([{"tier": "device", "layers": [0, True]}], "replica.residency[0].layers[1]"),
        ([{"tier": "device", "layers": [0, "15"]}], "replica.residency[0].layers[1]"),
        # tier: a lowercase registry name (R5)
        ([{"tier": "Device", "layers": [0, 31]}], "replica.residency[0].tier"),
        ([{"tier": 1, "layers": [0, 31]}], "replica.residency[0].tier"),
        ([{"layers": [0, 31]}], "replica.residency[0].tier"),
        # read_mbit_per_s: a positive number
        (
            [{"tier": "host", "layers": [0, 31], "read_mbit_per_s": 0}],
            "replica.residency[0].read_mbit_per_s",
        ),
        (
            [{"tier": "host", "layers": [0, 31], "read_mbit_per_s": -5}],
            "replica.residency[0].read_mbit_per_s",
        ),
        (
            [{"tier": "host", "layers": [0, 31], "read_mbit_per_s": True}],
            "replica.residency[0].read_mbit_per_s",
        ),
        (
            [{"tier": "host", "layers": [0, 31], "read_mbit_per_s": "fast"}],
            "replica.residency[0].read_mbit_per_s",
        ),
        (["device"], "replica.residency[0]"),
    ],
)
def test_replica_invalid_residency(residency: list[Any], member: str) -> None:
    # R2: residency entries are validated one by one, by path.
    assert_invalid(ReplicaRecord.from_json, replica(residency=residency), member)


def test_replica_adjacent_residency_ranges_are_valid() -> None:
    # R2: [0, 15] and [16, 31] touch but do not overlap; a one-layer range is fine.
    value = replica(
        residency=[
            {"tier": "remote-storage", "layers": [31, 31], "read_mbit_per_s": 8000},
            {"tier": "device", "layers": [0, 30]},
        ]
    )
    record = ReplicaRecord.from_json(value)
    assert record.layers == (0, 31)
    assert record.residency[0].layer_count == 1


def test_replica_every_registered_tier_accepted() -> None:
    # R5: the storage tier registry.
    assert TIERS == ("device", "host", "local-storage", "remote-memory", "remote-storage")
    for tier in TIERS:
        record = ReplicaRecord.from_json(replica(residency=[{"tier": tier, "layers": [0, 31]}]))
        assert record.residency[0].tier == tier


def test_replica_digest_must_match_layer_digests() -> None:
    # B3/R2: digest == SHA-256 of the concatenated raw layer digests, else DigestMismatch.
    wrong = "sha-256:" + hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(DigestMismatch) as info:
        ReplicaRecord.from_json(replica(digest=wrong))
    assert info.value.status == 422
    assert K0 in str(info.value)
    # The digest over hex text (not raw octets) is a different, wrong value.
    hex_text = "sha-256:" + hashlib.sha256("".join(LAYER_DIGESTS).encode()).hexdigest()
    with pytest.raises(DigestMismatch):
        ReplicaRecord.from_json(replica(digest=hex_text))
    # Reordering the layer digests breaks it too.
    with pytest.raises(DigestMismatch):
        ReplicaRecord.from_json(replica(layer_digests=LAYER_DIGESTS[::-1]))


def test_replica_without_layer_digests_is_not_cross_checked() -> None:
    # R2: layer_digests is only REQUIRED for replicas served by layer range.
    value = without(REPLICA, "layer_digests")
    value["digest"] = "sha-256:" + hashlib.sha256(b"whole container").hexdigest()
    record = ReplicaRecord.from_json(value)
    assert record.layer_digests is None
    assert "layer_digests" not in record.to_json()
    assert ReplicaRecord.from_json(value | {"layer_digests": None}) == record


def test_replica_layer_digests_cover_residency() -> None:
    # R2: a residency that names layer 31 needs at least 32 layer digests.
    short = LAYER_DIGESTS[:16]
    assert_invalid(
        ReplicaRecord.from_json,
        replica(layer_digests=short, digest=replica_digest(short)),
        "replica.layer_digests",
    )
    # Layers 0-15 only: 16 digests suffice.
    record = ReplicaRecord.from_json(
        replica(
            layer_digests=short,
            digest=replica_digest(short),
            residency=[{"tier": "device", "layers": [0, 15]}],
        )
    )
    assert record.layers == (0, 15)


def test_replica_too_many_layer_digests() -> None:
    # R2 (hostile input bound): at most 4096 layers per record.
    many = [LAYER_DIGESTS[0]] * 4097
    assert_invalid(
        ReplicaRecord.from_json,
        replica(layer_digests=many, digest=replica_digest(many)),
        "replica.layer_digests",
    )


def test_replica_moqt_form_round_trip() -> None:
    # R2: the MOQT form (moqt holder + moqt_namespace) is parsed and carried.
    ns = moqt_namespace([b"kvsp", bytes.fromhex(COMPAT_ID), bytes.fromhex(SCOPE_ID), b"k", b"0"])
    value = replica(holder="moqt://relay.example:4443/kvsp", moqt_namespace=ns)
    record = ReplicaRecord.from_json(value)
    assert record.holder == "moqt://relay.example:4443/kvsp"
    assert record.moqt_namespace == ns
    assert record.to_json()["moqt_namespace"] == ns
    assert ReplicaRecord.from_json(record.to_json()) == record


def test_replica_moqt_holder_needs_namespace() -> None:
    # R2: a moqt holder without moqt_namespace is invalid.
    value = replica(holder="moqt://relay.example/kvsp")
    assert_invalid(ReplicaRecord.from_json, value, "replica.moqt_namespace")
    assert_invalid(
        ReplicaRecord.from_json, value | {"moqt_namespace": None}, "replica.moqt_namespace"
    )


def test_replica_moqt_namespace_bad_length() -> None:
    # R2: one base64 character left over is never valid base64url.
    value = replica(holder="moqt://relay.example/kvsp", moqt_namespace="AAAAA")
    assert_invalid(ReplicaRecord.from_json, value, "replica.moqt_namespace")
    value = replica(holder="moqt://relay.example/kvsp", moqt_namespace=7)
    assert_invalid(ReplicaRecord.from_json, value, "replica.moqt_namespace")


@pytest.mark.parametrize("namespace", ["AAA=", "ab+/", "!!!!"])
def test_replica_moqt_namespace_must_be_unpadded_base64url(namespace: str) -> None:
    # R2: moqt_namespace is base64url WITHOUT padding.
    value = replica(holder="moqt://relay.example/kvsp", moqt_namespace=namespace)
    assert_invalid(ReplicaRecord.from_json, value, "replica.moqt_namespace")


def test_replica_uppercase_moqt_scheme_needs_namespace() -> None:
    # R2: the scheme is case-insensitive (RFC 3986), so MOQT:// is a moqt holder too.
    value = replica(holder="MOQT://relay.example/kvsp")
    assert_invalid(ReplicaRecord.from_json, value, "replica.moqt_namespace")


def test_replica_plain_http_holder_is_parsed() -> None:
    # H1 is enforced by the roles' TLS settings, not by record parsing: the
    # explicit, loopback-only --insecure-http development mode names its
    # holders with http:// URIs, and those records must still parse.
    record = ReplicaRecord.from_json(replica(holder="http://127.0.0.1:8080/kvsp/"))
    assert record.holder == "http://127.0.0.1:8080/kvsp/"
    assert_invalid(ReplicaRecord.from_json, replica(holder="ftp://h1.example/"), "replica.holder")


# Hypothesis: generated valid Replica Records round-trip.

hex32s = st.binary(min_size=32, max_size=32).map(bytes.hex)
hex16s = st.binary(min_size=16, max_size=16).map(bytes.hex)
holders = st.sampled_from(
    ["https://h1.example/kvsp/", "https://cache.example:8443/", "https://[2001:db8::1]/x/"]
)


@st.composite
def replica_records(draw: st.DrawFn) -> dict[str, Any]:
    n_layers = draw(st.integers(min_value=1, max_value=48))
    digests = draw(st.lists(hex32s, min_size=n_layers, max_size=n_layers))
    cuts = sorted(
        draw(st.sets(st.integers(min_value=1, max_value=n_layers - 1))) if n_layers > 1 else []
    )
    bounds = [0, *cuts, n_layers]
    residency = []
    for a, b in itertools.pairwise(bounds):
        entry: dict[str, Any] = {"tier": draw(st.sampled_from(TIERS)), "layers": [a, b - 1]}
        if draw(st.booleans()):
            entry["read_mbit_per_s"] = draw(st.integers(min_value=1, max_value=10**7))
        residency.append(entry)
    residency = draw(st.permutations(residency))
    value: dict[str, Any] = {
        "block_key": draw(hex32s),
        "compat_id": draw(hex32s),
        "scope_id": draw(hex16s),
        "holder": draw(holders),
        "codec": draw(st.one_of(st.just(1), st.integers(min_value=0xFF00, max_value=0xFFFF))),
        "size": draw(st.integers(min_value=0, max_value=2**53 - 1)),
        "residency": residency,
        "ttl_ms": draw(st.integers(min_value=0, max_value=2**32 - 1)),
    }
    if draw(st.booleans()):
        value["layer_digests"] = digests
        value["digest"] = replica_digest(digests)
    else:
        value["digest"] = "sha-256:" + draw(hex32s)
    return value


@given(replica_records())
def test_replica_round_trip_property(value: dict[str, Any]) -> None:
    # R2, R1: any valid record survives to_json -> from_json, and the JSON is stable.
    record = ReplicaRecord.from_json(value)
    again = ReplicaRecord.from_json(record.to_json())
    assert again == record
    assert again.to_json() == record.to_json()
    assert record.block_key == value["block_key"]
    assert sum(r.layer_count for r in record.residency) == max(r.last for r in record.residency) + 1


@given(replica_records(), st.integers(min_value=0, max_value=47))
def test_replica_overlap_property(value: dict[str, Any], layer: int) -> None:
    # R2: adding any range that shares a layer with an existing one is rejected.
    last = max(entry["layers"][1] for entry in value["residency"])
    layer = min(layer, last)
    value["residency"].append({"tier": "host", "layers": [layer, layer]})
    assert_invalid(ReplicaRecord.from_json, value, "replica.residency")


# --- Lookup (L1, L2, L4) ----------------------------------------------------


def test_lookup_request_draft_example() -> None:
    # L1: the draft's example parses and round-trips.
    request = LookupRequest.from_json(LOOKUP)
    assert request.scope_id == SCOPE_ID
    assert request.compat_id == COMPAT_ID
    assert request.block_keys == (K0, K1, K2)
    assert request.targets == ("https://ii7.example/kvsp/", "https://ii9.example/kvsp/")
    assert LookupRequest.from_json(request.to_json()) == request


def test_lookup_request_targets_optional() -> None:
    # L1: targets is optional; absent stays absent on the wire.
    request = LookupRequest.from_json(without(LOOKUP, "targets"))
    assert request.targets is None
    assert "targets" not in request.to_json()
    assert LookupRequest.from_json(request.to_json()) == request


def test_lookup_request_unknown_members_and_case() -> None:
    # R1
    assert LookupRequest.from_json(with_(LOOKUP, hint="x")) == LookupRequest.from_json(LOOKUP)
    value = without(LOOKUP, "block_keys")
    value["Block_Keys"] = [K0]
    assert_invalid(LookupRequest.from_json, value, "lookup.block_keys")


def test_lookup_request_size_bounded() -> None:
    # L4: the lookup size is bounded by a quota.
    assert_invalid(lambda v: LookupRequest.from_json(v, max_keys=2), LOOKUP, "lookup.block_keys")
    assert LookupRequest.from_json(LOOKUP, max_keys=3).block_keys == (K0, K1, K2)
    assert_invalid(lambda v: LookupRequest.from_json(v, max_targets=1), LOOKUP, "lookup.targets")


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"scope_id": COMPAT_ID}, "lookup.scope_id"),
        ({"compat_id": SCOPE_ID}, "lookup.compat_id"),
        ({"block_keys": [K0, K1.upper()]}, "lookup.block_keys[1]"),
        ({"block_keys": [K0, None]}, "lookup.block_keys[1]"),
        ({"block_keys": K0}, "lookup.block_keys"),
        ({"targets": ["https://ii7.example/kvsp/", "mailto:ops@example.com"]}, "lookup.targets[1]"),
        ({"targets": [7]}, "lookup.targets[0]"),
        ({"targets": "https://ii7.example/kvsp/"}, "lookup.targets"),
    ],
)
def test_lookup_request_invalid(changes: dict[str, Any], member: str) -> None:
    # L1
    assert_invalid(LookupRequest.from_json, with_(LOOKUP, **changes), member)


@pytest.mark.parametrize(
    "keys",
    [
        (K0, K1, K2),
        (),
        (K0, 'a"b' + "0" * 61),  # not hex: escaped by the generic encoder
        (K0, "\u00e9" * 64),
        (K0, "\\" * 64),
        (K0, "\n" + "0" * 63),
    ],
)
def test_lookup_request_encode(keys: tuple[str, ...]) -> None:
    # encode() is to_json() as octets, whatever the keys hold.
    for request in (
        LookupRequest(SCOPE_ID, COMPAT_ID, keys),
        LookupRequest(
            SCOPE_ID, COMPAT_ID, keys, targets=("https://ii7.example/kvsp/",), shapes_only=True
        ),
    ):
        assert json.loads(request.encode()) == request.to_json()
    decoded = LookupRequest.from_json(
        json.loads(LookupRequest(SCOPE_ID, COMPAT_ID, (K0,), shapes_only=True).encode())
    )
    assert decoded.shapes_only is True


def test_shape_runs_round_trip_and_validation() -> None:
    # Ours: a shapes-only answer covers exactly the matched keys.
    from kvstore.protocol.records import ReplicaShape, ShapeRuns

    shapes = ShapeRuns(((ReplicaShape.of(ReplicaRecord.from_json(replica())),),), ((0, 2), (0, 1)))
    assert shapes.matched == 3 and shapes.counts() == [(shapes.groups[0], 3)]
    answer = LookupResponse(3, (), shapes=shapes)
    assert LookupResponse.from_json(answer.to_json()) == answer
    value = answer.to_json()
    value["matched"] = 4
    assert_invalid(LookupResponse.from_json, value, "lookup_response.shapes")
    for runs, member in (([[1, 3]], "runs[0][0]"), ([[0, 0]], "runs[0][1]"), ([[0]], "runs[0]")):
        bad = {"matched": 3, "shapes": {"groups": value["shapes"]["groups"], "runs": runs}}
        assert_invalid(LookupResponse.from_json, bad, "lookup_response.shapes." + member)


def lookup_response() -> dict[str, Any]:
    second = replica(holder="https://h2.example/kvsp/", ttl_ms=1000)
    return {
        "matched": 2,
        "replicas": [[REPLICA, second], [replica(block_key=K1)]],
        "targets": [
            {"instance": "https://ii7.example/kvsp/", "fetch_us": 95.5, "recompute_us": 190.0},
            {"instance": "https://ii9.example/kvsp/", "fetch_us": 0, "recompute_us": 0},
        ],
    }


def test_lookup_response_round_trip() -> None:
    # L1, L2: matched, the replicas of each matched key, and per-target estimates.
    response = LookupResponse.from_json(lookup_response())
    assert response.matched == 2
    assert [len(r) for r in response.replicas] == [2, 1]
    assert response.replicas[0][1].holder == "https://h2.example/kvsp/"
    assert response.replicas[1][0].block_key == K1
    assert response.targets[0] == TargetEstimate("https://ii7.example/kvsp/", 95.5, 190.0)
    assert LookupResponse.from_json(response.to_json()) == response


def test_lookup_response_miss() -> None:
    # L1: a miss is matched 0 with no replicas and no targets.
    response = LookupResponse.from_json({"matched": 0})
    assert response == LookupResponse(0, ())
    assert response.to_json() == {"matched": 0, "replicas": []}
    assert LookupResponse.from_json(response.to_json()) == response


def test_lookup_response_matched_must_equal_replica_lists() -> None:
    # L1: one list of records per matched key.
    assert_invalid(
        LookupResponse.from_json, with_(lookup_response(), matched=3), "lookup_response.replicas"
    )
    assert_invalid(
        LookupResponse.from_json, with_(lookup_response(), matched=1), "lookup_response.replicas"
    )


def test_lookup_response_invalid_members() -> None:
    # L1, L2, R2: nested records are validated with their full path.
    value = lookup_response()
    value["replicas"][1][0]["scope_id"] = "zz"
    assert_invalid(LookupResponse.from_json, value, "lookup_response.replicas[1][0].scope_id")
    value = lookup_response()
    value["replicas"][0] = REPLICA
    assert_invalid(LookupResponse.from_json, value, "lookup_response.replicas[0]")
    value = lookup_response()
    value["targets"][1]["fetch_us"] = -1
    assert_invalid(LookupResponse.from_json, value, "lookup_response.targets[1].fetch_us")
    value = lookup_response()
    del value["targets"][0]["recompute_us"]
    assert_invalid(LookupResponse.from_json, value, "lookup_response.targets[0].recompute_us")
    assert_invalid(
        LookupResponse.from_json, with_(lookup_response(), matched="2"), "lookup_response.matched"
    )
    bad_digest = lookup_response()
    bad_digest["replicas"][0][0]["digest"] = "sha-256:" + "0" * 64
    with pytest.raises(DigestMismatch):
        LookupResponse.from_json(bad_digest)


# --- Leases (LE1) -----------------------------------------------------------


def test_lease_request_round_trip() -> None:
    # LE1: block keys and ttl_ms; scope and compat are optional.
    request = LeaseRequest.from_json(LEASE)
    assert request == LeaseRequest((K0, K1), 2000)
    assert request.to_json() == LEASE
    full = with_(LEASE, scope_id=SCOPE_ID, compat_id=COMPAT_ID, extra=True)  # R1
    parsed = LeaseRequest.from_json(full)
    assert (parsed.scope_id, parsed.compat_id) == (SCOPE_ID, COMPAT_ID)
    assert LeaseRequest.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize(
    ("value", "member"),
    [
        (with_(LEASE, block_keys=[]), "lease.block_keys"),
        (without(LEASE, "block_keys"), "lease.block_keys"),
        (with_(LEASE, block_keys=[K0, "xyz"]), "lease.block_keys[1]"),
        (without(LEASE, "ttl_ms"), "lease.ttl_ms"),
        (with_(LEASE, ttl_ms=0), "lease.ttl_ms"),
        (with_(LEASE, ttl_ms=2**32), "lease.ttl_ms"),
        (with_(LEASE, ttl_ms=True), "lease.ttl_ms"),
        (with_(LEASE, ttl_ms="2000"), "lease.ttl_ms"),
        (with_(LEASE, scope_id=COMPAT_ID), "lease.scope_id"),
        (with_(LEASE, compat_id=SCOPE_ID), "lease.compat_id"),
        ({"Block_Keys": [K0], "ttl_ms": 2000}, "lease.block_keys"),  # R1
    ],
)
def test_lease_request_invalid(value: dict[str, Any], member: str) -> None:
    # LE1
    assert_invalid(LeaseRequest.from_json, value, member)


def test_lease_request_size_bounded() -> None:
    # LE1, SEC3: the number of keys per lease request is bounded.
    assert_invalid(lambda v: LeaseRequest.from_json(v, max_keys=1), LEASE, "lease.block_keys")


def test_lease_grant_round_trip() -> None:
    # LE1: the lease identifier and the granted TTL.
    grant = LeaseGrant.from_json(with_(LEASE_GRANT, note="x"))
    assert grant == LeaseGrant("lease-0001", 2000, (K0, K1))
    assert LeaseGrant.from_json(grant.to_json()) == grant
    bare = LeaseGrant.from_json({"lease": "l", "ttl_ms": 0})
    assert bare.block_keys == ()
    assert bare.to_json() == {"lease": "l", "ttl_ms": 0}


@pytest.mark.parametrize(
    ("value", "member"),
    [
        (without(LEASE_GRANT, "lease"), "lease_grant.lease"),
        (with_(LEASE_GRANT, lease=12), "lease_grant.lease"),
        (with_(LEASE_GRANT, lease="x" * 129), "lease_grant.lease"),
        (without(LEASE_GRANT, "ttl_ms"), "lease_grant.ttl_ms"),
        (with_(LEASE_GRANT, ttl_ms=-1), "lease_grant.ttl_ms"),
        (with_(LEASE_GRANT, ttl_ms=1.5), "lease_grant.ttl_ms"),
        (with_(LEASE_GRANT, block_keys=["00"]), "lease_grant.block_keys[0]"),
        ({"Lease": "l", "ttl_ms": 5}, "lease_grant.lease"),  # R1
    ],
)
def test_lease_grant_invalid(value: dict[str, Any], member: str) -> None:
    # LE1
    assert_invalid(LeaseGrant.from_json, value, member)


# --- Prefetch (PF1, PF3) ----------------------------------------------------


def test_prefetch_directive_draft_example() -> None:
    # PF1: the draft's example parses and round-trips.
    directive = PrefetchDirective.from_json(PREFETCH)
    assert directive.directive == DIRECTIVE_ID
    assert directive.request_ref == "opaque-value-from-PC"
    assert directive.scope_id == SCOPE_ID
    assert directive.compat_id == COMPAT_ID
    assert directive.blocks[0].block_key == K0
    assert directive.blocks[0].sources == ("https://h1.example/kvsp/",)
    assert (directive.layer_order, directive.deadline_ms, directive.lease_ms) == (
        "ascending",
        50,
        2000,
    )
    assert directive.to_json() == PREFETCH
    assert PrefetchDirective.from_json(directive.to_json()) == directive


def test_prefetch_directive_defaults_and_unknown_members() -> None:
    # PF1, R1: layer_order defaults to ascending, request_ref is optional.
    value = without(without(PREFETCH, "layer_order"), "request_ref")
    value["priority"] = "high"
    value["blocks"][0]["weight"] = 3
    directive = PrefetchDirective.from_json(value)
    assert directive.layer_order == "ascending"
    assert directive.request_ref is None
    assert "request_ref" not in directive.to_json()
    assert PrefetchDirective.from_json(directive.to_json()) == directive


def test_prefetch_directive_uuid_case_insensitive() -> None:
    # PF1: UUIDs are case-insensitive on input and normalized to lowercase.
    directive = PrefetchDirective.from_json(with_(PREFETCH, directive=DIRECTIVE_ID.upper()))
    assert directive.directive == DIRECTIVE_ID


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"directive": "not-a-uuid"}, "prefetch.directive"),
        ({"directive": DIRECTIVE_ID.replace("-", "")}, "prefetch.directive"),
        ({"directive": "{" + DIRECTIVE_ID + "}"}, "prefetch.directive"),
        ({"directive": "urn:uuid:" + DIRECTIVE_ID}, "prefetch.directive"),
        ({"directive": "a2b7c9e01-f3d-4c1a-8f5b-6d2e9a7c3b10"}, "prefetch.directive"),
        ({"directive": 5}, "prefetch.directive"),
        ({"layer_order": "descending"}, "prefetch.layer_order"),
        ({"layer_order": "Ascending"}, "prefetch.layer_order"),
        ({"deadline_ms": -1}, "prefetch.deadline_ms"),
        ({"deadline_ms": "50"}, "prefetch.deadline_ms"),
        ({"lease_ms": 2**32}, "prefetch.lease_ms"),
        ({"lease_ms": True}, "prefetch.lease_ms"),
        ({"request_ref": 17}, "prefetch.request_ref"),
        ({"scope_id": "6D1C6481CD428737DA312C089DB3832A"}, "prefetch.scope_id"),
        ({"compat_id": COMPAT_ID[1:]}, "prefetch.compat_id"),
        ({"blocks": [{"block_key": K0, "sources": []}]}, "prefetch.blocks[0].sources"),
        ({"blocks": [{"block_key": K0}]}, "prefetch.blocks[0].sources"),
        (
            {"blocks": [{"block_key": K0, "sources": ["https://h1.example/", "h2"]}]},
            "prefetch.blocks[0].sources[1]",
        ),
        ({"blocks": [{"sources": ["https://h1.example/"]}]}, "prefetch.blocks[0].block_key"),
        (
            {"blocks": [{"Block_Key": K0, "sources": ["https://h1.example/"]}]},
            "prefetch.blocks[0].block_key",
        ),
        ({"blocks": [K0]}, "prefetch.blocks[0]"),
        ({"blocks": {"block_key": K0}}, "prefetch.blocks"),
    ],
)
def test_prefetch_directive_invalid(changes: dict[str, Any], member: str) -> None:
    # PF1
    assert_invalid(PrefetchDirective.from_json, with_(PREFETCH, **changes), member)


@pytest.mark.parametrize(
    "name", ["directive", "scope_id", "compat_id", "blocks", "deadline_ms", "lease_ms"]
)
def test_prefetch_directive_required_members(name: str) -> None:
    # PF1
    assert_invalid(PrefetchDirective.from_json, without(PREFETCH, name), f"prefetch.{name}")


def test_prefetch_directive_bounds() -> None:
    # PF5/SEC3: blocks per directive and sources per block are bounded.
    two = with_(PREFETCH, blocks=PREFETCH["blocks"] * 2)
    assert_invalid(lambda v: PrefetchDirective.from_json(v, max_blocks=1), two, "prefetch.blocks")
    sources = [f"https://h{i}.example/" for i in range(65)]
    many = with_(PREFETCH, blocks=[{"block_key": K0, "sources": sources}])
    assert_invalid(PrefetchDirective.from_json, many, "prefetch.blocks[0].sources")


@pytest.mark.parametrize("state", ["pending", "partial", "complete", "failed"])
def test_prefetch_status_states(state: str) -> None:
    # PF3: pending | partial | complete | failed, with the loaded keys.
    status = PrefetchStatus.from_json(with_(PREFETCH_STATUS, state=state, extra=[1]))
    assert status.state == state
    assert status.loaded == (K0,)
    assert PrefetchStatus.from_json(status.to_json()) == status


def test_prefetch_status_loaded_optional() -> None:
    # PF3
    status = PrefetchStatus.from_json({"directive": DIRECTIVE_ID, "state": "pending"})
    assert status.loaded == ()
    assert status.to_json() == {"directive": DIRECTIVE_ID, "state": "pending", "loaded": []}


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"state": "done"}, "prefetch_status.state"),
        ({"state": "Complete"}, "prefetch_status.state"),
        ({"state": None}, "prefetch_status.state"),
        ({"directive": "x"}, "prefetch_status.directive"),
        ({"loaded": [K0, "k"]}, "prefetch_status.loaded[1]"),
        ({"loaded": K0}, "prefetch_status.loaded"),
    ],
)
def test_prefetch_status_invalid(changes: dict[str, Any], member: str) -> None:
    # PF3
    assert_invalid(PrefetchStatus.from_json, with_(PREFETCH_STATUS, **changes), member)
