"""Encryption at rest for persistent tiers (SEC4): AES-256-GCM, optional zstd.

Sealed segment layout::

    offset  size  field
    0       4     magic "KVE1"
    4       1     flags: bit 0 = plaintext was zstd-compressed before sealing
    5       12    nonce (random per seal)
    17      ...   AES-GCM ciphertext with its 16-octet tag

The associated data is the segment's name (block resource name plus layer
range) and the flags octet, so a segment copied under another key, or with its
flags flipped, fails to open: tampering is an error, never garbage.
"""

from __future__ import annotations

import os

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..protocol._bytes import BytesLike
from ..protocol.problems import CorruptData

MAGIC = b"KVE1"
FLAG_ZSTD = 0x01
_NONCE = 12
_HEAD = len(MAGIC) + 1 + _NONCE
_TAG = 16


class SegmentSealer:
    """Seals and opens segments of persistent tiers; ``key=None`` means no encryption."""

    def __init__(
        self,
        key: bytes | None = None,
        *,
        compress: bool = False,
        level: int = 3,
        max_plain_octets: int = 1 << 31,
    ) -> None:
        if key is not None and len(key) not in (16, 24, 32):
            raise ValueError("encryption key must be 16, 24 or 32 octets (AES-128/192/256)")
        self._aead = AESGCM(key) if key is not None else None
        self._compress = compress
        self._level = level
        #: Largest plaintext a stored segment may open to (a decompression bomb
        #: is refused before anything is allocated).
        self.max_plain_octets = max_plain_octets

    @property
    def authenticates(self) -> bool:
        """True when opening a segment proves it unaltered (AES-GCM is on)."""
        return self._aead is not None

    @property
    def active(self) -> bool:
        return self._aead is not None or self._compress

    def seal(self, name: bytes, plaintext: BytesLike) -> BytesLike:
        """The octets to store for segment ``name``."""
        if not self.active:
            return plaintext
        flags = 0
        data: BytesLike = plaintext
        if self._compress:
            data = zstandard.ZstdCompressor(level=self._level).compress(plaintext)
            flags |= FLAG_ZSTD
        if self._aead is None:
            return MAGIC + bytes([flags]) + bytes(_NONCE) + bytes(data)
        nonce = os.urandom(_NONCE)
        # One pass, no intermediate copies: encrypt straight into the output.
        out = bytearray(_HEAD + len(memoryview(data)) + _TAG)
        out[:_HEAD] = MAGIC + bytes([flags]) + nonce
        self._aead.encrypt_into(nonce, data, name + bytes([flags]), memoryview(out)[_HEAD:])
        return out

    def open(self, name: bytes, stored: BytesLike) -> BytesLike:
        """The plaintext of a stored segment; :class:`CorruptData` if it was altered."""
        if not self.active:
            return stored
        view = memoryview(stored)
        if len(view) < _HEAD or bytes(view[:4]) != MAGIC:
            raise CorruptData(f"segment {name.decode()} is not a sealed segment")
        flags = view[4]
        body: BytesLike = view[_HEAD:]
        if self._aead is not None:
            if len(view) < _HEAD + _TAG:
                raise CorruptData(f"segment {name.decode()} is truncated")
            plain = bytearray(len(view) - _HEAD - _TAG)
            try:
                self._aead.decrypt_into(bytes(view[5:_HEAD]), body, name + bytes([flags]), plain)
                body = plain
            except InvalidTag:
                raise CorruptData(
                    f"segment {name.decode()} failed authentication (altered or misplaced)"
                ) from None
        if flags & FLAG_ZSTD:
            try:
                size = zstandard.frame_content_size(body)
                if not 0 <= size <= self.max_plain_octets:
                    raise CorruptData(f"segment {name.decode()}: bad decompressed size {size}")
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
            except (zstandard.ZstdError, MemoryError) as exc:
                raise CorruptData(f"segment {name.decode()}: {exc!r}") from exc
        return body
