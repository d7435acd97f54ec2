"""KV Block Container (B1-B3, B5): golden bytes, round trips, slicing, hostile input."""

from __future__ import annotations

import hashlib
import os
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protocol import container as kc
from kvstore.protocol.codecs import CODEC_RAW, CODEC_ZSTD_RAW
from kvstore.protocol.compat import parse_descriptor
from kvstore.protocol.problems import DigestMismatch, LayersUnavailable, MalformedContainer

from .vectors import DESCRIPTOR, HEADER

DESC = parse_descriptor(DESCRIPTOR)  # 32 layers, 4 tokens, 8 heads x 128, bf16
SECTION = DESC.section_length(4)  # 8192 octets


def sections(layers: int, size: int = SECTION) -> list[tuple[bytes, bytes]]:
    return [(os.urandom(size), os.urandom(size)) for _ in range(layers)]


def test_appendix_header_golden_bytes() -> None:
    # B1: codec raw, layers 0-1, four tokens, K and V of 8192 octets each.
    blob = kc.encode(sections(2), first_layer=0, token_count=4)
    assert bytes(blob[:52]) == HEADER
    header = kc.decode_header(HEADER)
    assert header is not None
    assert (header.codec, header.first_layer, header.layer_count, header.token_count) == (
        1,
        0,
        2,
        4,
    )
    assert header.lengths == ((8192, 8192), (8192, 8192))
    assert header.pack() == HEADER


def test_decode_is_zero_copy() -> None:
    data = bytearray(kc.encode(sections(2), token_count=4))
    container = kc.decode(data, descriptor=DESC)
    k = container.layer(0).k
    data[52] ^= 0xFF  # the first octet of layer 0's K section
    assert k[0] == data[52]  # the view sees the change: nothing was copied


def test_digests() -> None:
    # B3: layer digest = SHA-256(K || V); replica digest = SHA-256(layer digests).
    secs = sections(3)
    container = kc.decode(kc.encode(secs, token_count=4))
    expected = [hashlib.sha256(k + v).digest() for k, v in secs]
    assert container.layer_digests() == expected
    assert kc.replica_digest(expected) == hashlib.sha256(b"".join(expected)).digest()


def test_verify_against_record_digests() -> None:
    # BL6: layers are verified against the record; the replica digest when all came.
    secs = sections(4)
    digests = [hashlib.sha256(k + v).digest() for k, v in secs]
    whole = kc.decode(kc.encode(secs, token_count=4))
    whole.verify(digests, kc.replica_digest(digests))
    part = kc.decode(whole.slice(1, 2).tobytes())
    part.verify(digests)
    with pytest.raises(DigestMismatch):
        whole.verify(digests, bytes(32))
    bad = list(digests)
    bad[2] = bytes(32)
    with pytest.raises(DigestMismatch, match="layer 2"):
        part.verify(bad)
    with pytest.raises(DigestMismatch):
        whole.verify(digests[:2])


def test_slice_shares_the_original_buffer() -> None:
    # BL2 support: slicing re-encodes the header only; sections stay views.
    secs = sections(8)
    container = kc.decode(kc.encode(secs, token_count=4))
    parts = container.slice(4, 7)
    assert parts.header.first_layer == 4
    assert parts.header.layer_count == 4
    assert all(isinstance(c, memoryview) for c in parts.chunks[1:])
    again = kc.decode(parts.tobytes())
    assert [bytes(layer.k) for layer in again] == [k for k, _ in secs[4:8]]
    assert [layer.index for layer in again] == [4, 5, 6, 7]
    assert len(parts) == len(parts.tobytes())
    # A slice of a slice keeps absolute layer numbers.
    assert bytes(kc.decode(again.slice(5, 5).tobytes()).layer(5).v) == secs[5][1]


@pytest.mark.parametrize(("first", "last"), [(3, 8), (-1, 2), (5, 4), (8, 8)])
def test_slice_outside_the_held_layers(first: int, last: int) -> None:
    # BL2: layers not held -> kvsp-layers-unavailable (404).
    container = kc.decode(kc.encode(sections(4), first_layer=4, token_count=4))
    with pytest.raises(LayersUnavailable) as info:
        container.slice(first, last)
    assert info.value.status == 404
    assert info.value.suffix == "kvsp-layers-unavailable"


def test_empty_container() -> None:
    blob = kc.encode([], first_layer=3, token_count=4)
    container = kc.decode(blob)
    assert len(container) == 0
    assert list(container) == []


def test_geometry_checks() -> None:
    # B2: raw sections must hold exactly token_count x kv_heads x head_dim elements.
    with pytest.raises(MalformedContainer, match="geometry needs 8192"):
        kc.decode(kc.encode(sections(1, 8190), token_count=4), descriptor=DESC)
    with pytest.raises(MalformedContainer, match="block size"):
        kc.decode(kc.encode(sections(1), token_count=3), descriptor=DESC)
    with pytest.raises(MalformedContainer, match="exceed the model"):
        kc.decode(kc.encode(sections(2), first_layer=31, token_count=4), descriptor=DESC)


def test_zstd_codec_round_trip_and_transcode() -> None:
    # B5: our private-use codec 0xFF01 transcodes to raw and back, bit-exact.
    secs = [(bytes(SECTION), bytes(range(256)) * 32) for _ in range(3)]
    raw = kc.decode(kc.encode(secs, token_count=4), descriptor=DESC)
    packed = kc.decode(kc.transcode(raw, CODEC_ZSTD_RAW, DESC), descriptor=DESC)
    assert packed.codec == CODEC_ZSTD_RAW
    assert packed.header.total_octets < raw.header.total_octets
    back = kc.decode(kc.transcode(packed, CODEC_RAW, DESC), descriptor=DESC)
    assert back.layer_digests() == raw.layer_digests()


# --- hostile input (STYLE 3): each a clear error, never a big allocation ---


def good() -> bytes:
    return bytes(kc.encode(sections(2, 16), token_count=4))


def patch(blob: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "shorter than"),
        (good()[:19], "shorter than"),
        (good()[:40], "announces 2 layers"),
        (good()[:-1], "lengths announce"),
        (good() + b"\x00", "lengths announce"),
        (patch(good(), 0, "!I", 0x4B564232), "bad magic"),
        (patch(good(), 4, "!B", 2), "version"),
        (patch(good(), 5, "!B", 1), "flags"),
        (patch(good(), 6, "!H", 0), "reserved"),
        (patch(good(), 6, "!H", 0x1234), "not supported"),
        (patch(good(), 12, "!I", 2**32 - 1), "exceeds the limit"),
        (patch(good(), 8, "!I", 2**32 - 1), "overflows"),
        (patch(good(), 20, "!Q", 2**63), "exceeds the limit"),
        (patch(good(), 28, "!Q", 17), "lengths announce"),
        (patch(good(), 20, "!Q", 2**30 + 1), "exceeds the limit"),
    ],
)
def test_malformed_containers(blob: bytes, message: str) -> None:
    with pytest.raises(MalformedContainer, match=message) as info:
        kc.decode(blob)
    assert info.value.status == 400


def test_lying_lengths_allocate_nothing() -> None:
    # A header claiming 4096 layers of 1 GiB sections, with no data behind it.
    header = struct.pack("!IBBHIII", kc.MAGIC, 1, 0, 1, 0, 4096, 4)
    header += struct.pack("!QQ", 2**30, 2**30) * 4096
    tracemalloc.start()
    try:
        with pytest.raises(MalformedContainer):
            kc.decode(header)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The header claims 8 TiB; what was allocated is proportional to the
    # 64 KiB header actually received (the parsed length table), not to that.
    assert peak < 16 * len(header)


def test_limits_are_configurable() -> None:
    blob = good()
    with pytest.raises(MalformedContainer, match="layer count"):
        kc.decode(blob, limits=kc.Limits(max_layers=1))
    with pytest.raises(MalformedContainer, match="total"):
        kc.decode(blob, limits=kc.Limits(max_total=63))


def test_decode_header_needs_more() -> None:
    blob = good()
    assert kc.decode_header(blob[:10]) is None
    assert kc.decode_header(blob[:30]) is None
    with pytest.raises(MalformedContainer):
        kc.decode_header(b"KVB2")


def test_encode_refuses_bad_arguments() -> None:
    with pytest.raises(MalformedContainer):
        kc.encode([], token_count=1, codec=0)
    with pytest.raises(ValueError):
        kc.encode([], token_count=2**32)


@settings(max_examples=60, deadline=None)
@given(
    first=st.integers(0, 100),
    data=st.data(),
    tokens=st.integers(0, 8),
    codec=st.sampled_from([CODEC_RAW, CODEC_ZSTD_RAW]),
)
def test_round_trip_random_geometry(
    first: int, data: st.DataObject, tokens: int, codec: int
) -> None:
    # B1: encode -> decode is the identity for any geometry and layer range.
    secs = data.draw(
        st.lists(st.tuples(st.binary(max_size=64), st.binary(max_size=64)), max_size=12)
    )
    blob = kc.encode(secs, first_layer=first, token_count=tokens, codec=codec)
    container = kc.decode(blob)
    assert container.first_layer == first
    assert container.token_count == tokens
    assert [(bytes(x.k), bytes(x.v)) for x in container] == secs
    assert container.parts().tobytes() == bytes(blob)
    if secs:
        a = data.draw(st.integers(first, first + len(secs) - 1))
        b = data.draw(st.integers(a, first + len(secs) - 1))
        part = kc.decode(container.slice(a, b).tobytes())
        assert [(bytes(x.k), bytes(x.v)) for x in part] == secs[a - first : b - first + 1]
        assert part.layer_digests() == container.layer_digests()[a - first : b - first + 1]
