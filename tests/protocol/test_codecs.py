"""Codec registry (B5): raw, and our private-use zstd codec, against hostile sections."""

from __future__ import annotations

import pytest
import zstandard

from kvstore.protocol.codecs import (
    CODEC_RAW,
    CODEC_ZSTD_RAW,
    PRIVATE_USE,
    RAW,
    ZSTD_RAW,
    codec_by_name,
    get_codec,
)
from kvstore.protocol.problems import MalformedContainer


def test_registry() -> None:
    assert get_codec(CODEC_RAW).name == "raw"
    assert get_codec(CODEC_ZSTD_RAW).name == "kvstore-zstd-raw"
    assert CODEC_ZSTD_RAW in PRIVATE_USE
    assert codec_by_name("raw") is RAW
    with pytest.raises(MalformedContainer, match="reserved"):
        get_codec(0)
    with pytest.raises(MalformedContainer, match="not supported"):
        get_codec(2)
    with pytest.raises(ValueError):
        codec_by_name("lz4")


def test_raw_checks_length() -> None:
    assert RAW.decode_section(b"abcd", 4) == b"abcd"
    with pytest.raises(MalformedContainer):
        RAW.decode_section(b"abc", 4)


def test_zstd_round_trip() -> None:
    raw = bytes(range(256)) * 64
    packed = ZSTD_RAW.encode_section(raw)
    assert len(memoryview(packed)) < len(raw)
    assert bytes(ZSTD_RAW.decode_section(packed, len(raw))) == raw


def test_zstd_bomb_is_refused_before_decompressing() -> None:
    # A frame that honestly declares 64 MiB, where the geometry allows 4 KiB.
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(MalformedContainer, match="declares 67108864"):
        ZSTD_RAW.decode_section(bomb, 4096)


def test_zstd_without_content_size_is_refused() -> None:
    compressor = zstandard.ZstdCompressor().compressobj()
    frame = compressor.compress(bytes(4096)) + compressor.flush()
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(MalformedContainer):
        ZSTD_RAW.decode_section(frame, 4096)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda f: f[:-3],  # truncated
        lambda f: f + b"xyz",  # trailing octets
        lambda f: b"\x00" * len(f),  # not a frame
        lambda f: f[:6],  # header only
    ],
)
def test_zstd_damaged_frames(mangle: object) -> None:
    frame = ZSTD_RAW.encode_section(bytes(range(256)) * 16)
    with pytest.raises(MalformedContainer):
        ZSTD_RAW.decode_section(mangle(bytes(frame)), 4096)  # type: ignore[operator]
