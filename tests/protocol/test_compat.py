"""Compatibility Descriptor and ID (C1-C4)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.compat import (
    ELEMENT_SIZES,
    check_compatible,
    compat_id,
    parse_descriptor,
)
from kvstore.protocol.problems import Incompatible, InvalidDescriptor

from .vectors import CANONICAL, COMPAT_ID, DESCRIPTOR


def descriptor(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(DESCRIPTOR)
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def test_appendix_canonical_form_and_compat_id() -> None:
    # C2: JCS of the appendix descriptor and its Compatibility ID, byte for byte.
    desc = parse_descriptor(DESCRIPTOR)
    assert desc.canonical().decode() == CANONICAL
    assert desc.compat_id.hex() == COMPAT_ID
    assert compat_id(DESCRIPTOR).hex() == COMPAT_ID


def test_member_order_does_not_change_the_id() -> None:
    # C2: JCS sorts members, so the order a peer sent them in is irrelevant.
    reordered = dict(reversed(list(DESCRIPTOR.items())))
    assert compat_id(reordered).hex() == COMPAT_ID


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("model", "other-model"),
        ("layers", 33),
        ("kv_dtype", "fp16"),
        ("positional", "rope;theta=10000"),
        ("block_tokens", 16),
        ("adapters", ["sha-256:" + "ab" * 32]),
    ],
)
def test_every_member_is_part_of_the_identity(member: str, value: Any) -> None:
    # C2/C3: changing anything that shapes the cache changes the ID.
    assert compat_id(descriptor(**{member: value})).hex() != COMPAT_ID


def test_extension_members_are_kept_and_hashed() -> None:
    desc = parse_descriptor(descriptor(quantization="awq"))
    assert desc.to_json()["quantization"] == "awq"
    assert desc.compat_id.hex() != COMPAT_ID


def test_geometry_helpers() -> None:
    desc = parse_descriptor(DESCRIPTOR)
    # B2: tokens x kv_heads x head_dim elements of 2 octets (the appendix's 8192).
    assert desc.section_length(4) == 8192
    assert desc.block_octets == 2 * 32 * 8192
    assert desc.element_size == 2


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"model": 7}, "model"),
        ({"model_digest": "sha-256:" + "AB" * 32}, "model_digest"),
        ({"model_digest": "sha-512:" + "ab" * 32}, "model_digest"),
        ({"tokenizer_digest": "sha-256:abc"}, "tokenizer_digest"),
        ({"adapters": []}, "adapters"),
        ({"adapters": "sha-256:" + "ab" * 32}, "adapters"),
        ({"adapters": ["sha-256:" + "ab" * 32, "md5:x"]}, "adapters[1]"),
        ({"layers": 0}, "layers"),
        ({"layers": True}, "layers"),
        ({"layers": 32.0}, "layers"),
        ({"kv_heads": -1}, "kv_heads"),
        ({"head_dim": "128"}, "head_dim"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"kv_dtype": "BF16"}, "kv_dtype"),
        ({"positional": "alibi"}, "positional"),
        ({"positional": "rope;theta=010000"}, "positional"),
        ({"positional": "rope;scaling=yarn"}, "positional"),
        ({"positional": "rope;theta=10000,scaling="}, "positional"),
        ({"positional": "none;theta=1"}, "positional"),
        ({"block_tokens": 2**32}, "block_tokens"),
        ({"layout": "kvsp-layout-2"}, "layout"),
        ({"layout": None}, "layout"),
    ],
)
def test_invalid_descriptors_name_the_member(changes: dict[str, Any], member: str) -> None:
    # C1: invalid descriptors are rejected with an error naming the member.
    with pytest.raises(InvalidDescriptor) as info:
        parse_descriptor(descriptor(**changes))
    assert f"descriptor.{member}:" in str(info.value)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "positional", ["none", "rope", "rope;theta=10000", "rope;theta=500000,scaling=llama3"]
)
def test_positional_registry_syntax(positional: str) -> None:
    assert parse_descriptor(descriptor(positional=positional)).positional == positional


@pytest.mark.parametrize("kv_dtype", sorted(ELEMENT_SIZES))
def test_element_type_registry(kv_dtype: str) -> None:
    assert parse_descriptor(descriptor(kv_dtype=kv_dtype)).kv_dtype == kv_dtype


def test_adapters_round_trip_in_order() -> None:
    adapters = ["sha-256:" + "01" * 32, "sha-256:" + "02" * 32]
    desc = parse_descriptor(descriptor(adapters=adapters))
    assert desc.to_json()["adapters"] == adapters
    swapped = parse_descriptor(descriptor(adapters=adapters[::-1]))
    # Order of application is part of the identity.
    assert swapped.compat_id != desc.compat_id


def test_not_an_object() -> None:
    with pytest.raises(InvalidDescriptor):
        parse_descriptor(["model"])


def test_uncanonicalizable_extension_is_rejected() -> None:
    with pytest.raises(InvalidDescriptor):
        parse_descriptor(descriptor(extra=float("nan")))


def test_check_compatible() -> None:
    # C3: different IDs are never substituted.
    check_compatible(COMPAT_ID, bytes.fromhex(COMPAT_ID))
    with pytest.raises(Incompatible) as info:
        check_compatible(COMPAT_ID, "00" * 32)
    assert info.value.status == 409
    assert info.value.type_uri.endswith("#kvsp-incompatible")


@given(
    layers=st.integers(1, 2**32 - 1),
    heads=st.integers(1, 1024),
    dim=st.integers(1, 1024),
    block=st.integers(1, 4096),
    dtype=st.sampled_from(sorted(ELEMENT_SIZES)),
)
def test_descriptor_json_round_trip(
    layers: int, heads: int, dim: int, block: int, dtype: str
) -> None:
    desc = parse_descriptor(
        descriptor(layers=layers, kv_heads=heads, head_dim=dim, block_tokens=block, kv_dtype=dtype)
    )
    again = parse_descriptor(desc.to_json())
    assert again == desc
    assert again.compat_id == desc.compat_id
