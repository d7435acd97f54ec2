"""The "KVSP Codecs" registry (B2, B5): how a K or V section is encoded.

=======  =================  ====================================================
value    name               section encoding
=======  =================  ====================================================
0x0000   (reserved)         never valid in a container
0x0001   raw                kvsp-layout-1 elements, unchanged
0xFF01   kvstore-zstd-raw   one Zstandard frame (RFC 8878) whose content is the
                            raw section; the frame header MUST carry the content
                            size, and nothing may follow the frame
=======  =================  ====================================================

0xFF01 is in the Private Use range. Its layer digests are computed over the
sections as stored (compressed octets), like any codec's; a client that wants
producer-level integrity requests the replica's own codec (BL6). See
``docs/codecs.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import zstandard

from ._bytes import BytesLike
from .problems import MalformedContainer

CODEC_RESERVED = 0x0000
CODEC_RAW = 0x0001
CODEC_ZSTD_RAW = 0xFF01
PRIVATE_USE = range(0xFF00, 0x10000)


class Codec(Protocol):
    """Section encoding of one codec value."""

    @property
    def value(self) -> int: ...

    @property
    def name(self) -> str: ...

    def encode_section(self, raw: BytesLike) -> BytesLike:
        """Encode one raw (kvsp-layout-1) K or V section."""
        ...

    def decode_section(self, data: BytesLike, raw_length: int) -> BytesLike:
        """Decode one section back to exactly ``raw_length`` raw octets.

        Must raise :class:`MalformedContainer` (never allocate more than
        ``raw_length``) when the data does not decode to that length.
        """
        ...


@dataclass(frozen=True, slots=True)
class RawCodec:
    value: int = CODEC_RAW
    name: str = "raw"

    def encode_section(self, raw: BytesLike) -> BytesLike:
        return raw

    def decode_section(self, data: BytesLike, raw_length: int) -> BytesLike:
        if len(memoryview(data)) != raw_length:
            raise MalformedContainer(
                f"raw section holds {len(memoryview(data))} octets, geometry needs {raw_length}"
            )
        return data


@dataclass(frozen=True, slots=True)
class ZstdRawCodec:
    value: int = CODEC_ZSTD_RAW
    name: str = "kvstore-zstd-raw"
    level: int = 3

    def encode_section(self, raw: BytesLike) -> BytesLike:
        # compress() writes the content size into the frame header, which
        # decode_section relies on to bound memory before decompressing.
        return zstandard.ZstdCompressor(level=self.level).compress(raw)

    def decode_section(self, data: BytesLike, raw_length: int) -> BytesLike:
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise MalformedContainer(f"zstd section: bad frame header ({exc})") from exc
        if size != raw_length:
            # -1 means unknown: refuse rather than decompress an unbounded stream.
            raise MalformedContainer(
                f"zstd section declares {size} octets, geometry needs {raw_length}"
            )
        decoder = zstandard.ZstdDecompressor().decompressobj()
        try:
            out = decoder.decompress(data)
        except zstandard.ZstdError as exc:
            raise MalformedContainer(f"zstd section: {exc}") from exc
        if not decoder.eof or decoder.unused_data or len(out) != raw_length:
            raise MalformedContainer("zstd section: truncated frame or trailing octets")
        return out


RAW = RawCodec()
ZSTD_RAW = ZstdRawCodec()

CODECS: dict[int, Codec] = {RAW.value: RAW, ZSTD_RAW.value: ZSTD_RAW}


def get_codec(value: int) -> Codec:
    """The codec registered under ``value``; :class:`MalformedContainer` if unknown."""
    codec = CODECS.get(value)
    if codec is None:
        reason = "reserved" if value == CODEC_RESERVED else "not supported"
        raise MalformedContainer(f"codec 0x{value:04x} is {reason}", codec=value)
    return codec


def codec_by_name(name: str) -> Codec:
    for codec in CODECS.values():
        if codec.name == name:
            return codec
    raise ValueError(f"unknown codec name {name!r}; known: {[c.name for c in CODECS.values()]}")
