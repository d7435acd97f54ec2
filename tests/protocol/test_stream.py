"""Incremental decoding, layer by layer (B4), with verification on arrival (BL6, BL8)."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protocol import container as kc
from kvstore.protocol.compat import parse_descriptor
from kvstore.protocol.problems import DigestMismatch, MalformedContainer
from kvstore.protocol.stream import StreamDecoder

from .vectors import DESCRIPTOR

DESC = parse_descriptor(DESCRIPTOR)


def make(layers: int, size: int = 64, first: int = 0) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    secs = [(os.urandom(size), os.urandom(size)) for _ in range(layers)]
    return bytes(kc.encode(secs, first_layer=first, token_count=4)), secs


def feed_all(decoder: StreamDecoder, blob: bytes, step: int) -> list[object]:
    events: list[object] = []
    for i in range(0, len(blob), step):
        events += decoder.feed(blob[i : i + step])
    decoder.close()
    return events


def test_each_layer_is_released_as_soon_as_it_is_complete() -> None:
    # B4: layer l is available once its octets arrived, before the rest.
    blob, secs = make(3, size=100, first=5)
    decoder = StreamDecoder()
    header_end = 20 + 16 * 3
    events = decoder.feed(blob[: header_end + 150])  # header + K0 + half of V0
    assert isinstance(events[0], kc.ContainerHeader)
    assert len(events) == 1
    events = decoder.feed(blob[header_end + 150 : header_end + 200])  # the rest of layer 5
    assert len(events) == 1
    layer = events[0]
    assert isinstance(layer, kc.Layer)
    assert layer.index == 5
    assert (bytes(layer.k), bytes(layer.v)) == secs[0]
    assert not decoder.complete
    rest = decoder.feed(blob[header_end + 200 :])
    assert [e.index for e in rest if isinstance(e, kc.Layer)] == [6, 7]
    decoder.close()
    assert decoder.complete


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(0, 6), size=st.integers(0, 40), step=st.integers(1, 300))
def test_any_chunking_gives_the_same_layers(layers: int, size: int, step: int) -> None:
    blob, secs = make(layers, size)
    events = feed_all(StreamDecoder(), blob, step)
    got = [(bytes(e.k), bytes(e.v)) for e in events if isinstance(e, kc.Layer)]
    assert got == secs
    assert sum(isinstance(e, kc.ContainerHeader) for e in events) == 1


def test_verifies_each_layer_against_record_digests() -> None:
    # BL6/BL8: a corrupted layer is refused when it arrives.
    blob, secs = make(3)
    digests = [hashlib.sha256(k + v).digest() for k, v in secs]
    feed_all(StreamDecoder(layer_digests=digests), blob, 7)
    corrupt = bytearray(blob)
    corrupt[-1] ^= 1  # last octet of layer 2's V section
    decoder = StreamDecoder(layer_digests=digests)
    events = decoder.feed(corrupt[: len(corrupt) - 128])
    assert [e.index for e in events if isinstance(e, kc.Layer)] == [0, 1]
    with pytest.raises(DigestMismatch, match="layer 2"):
        decoder.feed(corrupt[len(corrupt) - 128 :])


def test_checks_geometry_when_the_header_arrives() -> None:
    blob, _ = make(1, size=10)
    with pytest.raises(MalformedContainer, match="geometry"):
        StreamDecoder(descriptor=DESC).feed(blob[:40])


@pytest.mark.parametrize("cut", [0, 5, 30, 60, 100])
def test_truncated_stream_fails_on_close(cut: int) -> None:
    blob, _ = make(2)
    decoder = StreamDecoder()
    decoder.feed(blob[:cut])
    with pytest.raises(MalformedContainer, match=r"empty|ended"):
        decoder.close()


def test_trailing_octets_are_refused() -> None:
    blob, _ = make(1)
    with pytest.raises(MalformedContainer, match="after the last layer"):
        StreamDecoder().feed(blob + b"x")


def test_bad_magic_fails_fast() -> None:
    with pytest.raises(MalformedContainer, match="magic"):
        StreamDecoder().feed(b"GET / HTTP/1.1\r\n")


def test_lying_header_buffers_only_what_arrived() -> None:
    # A header announcing 1 GiB sections; only 1000 octets follow.
    header = struct.pack("!IBBHIII", kc.MAGIC, 1, 0, 1, 0, 1, 4) + struct.pack("!QQ", 2**30, 2**30)
    decoder = StreamDecoder()
    decoder.feed(header + bytes(1000))
    assert len(decoder._layer) == 1000
    with pytest.raises(MalformedContainer):
        decoder.close()


def test_layer_count_limit_applies_before_the_table_arrives() -> None:
    header = struct.pack("!IBBHIII", kc.MAGIC, 1, 0, 1, 0, 2**31, 4)
    with pytest.raises(MalformedContainer, match="exceeds the limit"):
        StreamDecoder().feed(header)


def test_zero_length_layers_complete_without_data() -> None:
    blob = bytes(kc.encode([(b"", b""), (b"ab", b"c"), (b"", b"")], token_count=0))
    events = feed_all(StreamDecoder(), blob, 3)
    layers = [e for e in events if isinstance(e, kc.Layer)]
    assert [(bytes(x.k), bytes(x.v)) for x in layers] == [(b"", b""), (b"ab", b"c"), (b"", b"")]


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(0, 6), size=st.integers(0, 40), step=st.integers(1, 300))
def test_layer_hasher_matches_the_decoded_digests(layers: int, size: int, step: int) -> None:
    # B3 computed while the octets arrive, in any chunking, equals the digests
    # of the decoded container.
    from kvstore.protocol.stream import LayerHasher

    blob, _ = make(layers, size)
    hasher = LayerHasher()
    for i in range(0, len(blob), step):
        hasher.feed(blob[i : i + step])
    hasher.close()
    assert hasher.digests == kc.decode(blob).layer_digests()
