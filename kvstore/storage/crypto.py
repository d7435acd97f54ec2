"""How persistent tiers store a segment (SEC4, integrity at rest): sealed with
AES-256-GCM when a key is configured, else checksummed; optionally zstd.

Every octet a persistent tier holds is checked, when it is read back, against
a value written with it when it was stored: the AES-GCM tag (a sealed
segment is checked by its tag alone), or a checksum taken at store time.
Never against a value re-derived from what was read (a bad disk, bit rot or
a careless copy must fail, not be served).

Sealed form (a key is configured)::

    offset  size  field
    0       4     magic "KVE1"
    4       1     flags: bit 0 = plaintext was zstd-compressed before sealing
    5       12    nonce (random per seal)
    17      ...   AES-GCM ciphertext with its 16-octet tag

The associated data is the segment's name (block resource name plus layer
range) and the flags octet, so a segment copied under another key, or with its
flags flipped, fails to open: tampering is an error, never garbage.

Checksummed form (no key)::

    offset  size  field
    0       4     magic "KVC2"
    4       1     flags (as above)
    5       8     XXH3-64 (network byte order) of name, flags octet and body
    13      ...   body: the plaintext, or its zstd frame

XXH3 (the xxhash library) runs at memory speed, about 19 GB/s a core here
against 4.3 for zlib's CRC-32, which segments written before it carry: the
form ``KVC1``, a 4-octet CRC-32 at offset 5, still read. The checksum covers
the name as well, so a segment copied under another key fails too. It
detects corruption, not a forger: turn encryption on against one.
"""

from __future__ import annotations

import os
import struct
import zlib

import xxhash
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..logs import describe
from ..protocol._bytes import BytesLike
from .errors import CorruptData

MAGIC = b"KVE1"
CHECKED = b"KVC2"
#: The checksummed form before XXH3 (a CRC-32): still read, no longer written.
CHECKED_CRC32 = b"KVC1"
FLAG_ZSTD = 0x01
_NONCE = 12
_HEAD = len(MAGIC) + 1 + _NONCE
_TAG = 16
_SUM = struct.Struct("!Q")
_CHECKED_HEAD = len(CHECKED) + 1 + _SUM.size
_CRC = struct.Struct("!I")
_CRC_HEAD = len(CHECKED_CRC32) + 1 + _CRC.size
#: Octets a checksummed segment takes beyond its body (capacity planning).
CHECKSUM_OVERHEAD = _CHECKED_HEAD


def _sum(name: bytes, flags: int, body: BytesLike) -> int:
    hasher = xxhash.xxh3_64(name + bytes([flags]))
    hasher.update(body)
    return hasher.intdigest()


def _crc(name: bytes, flags: int, body: BytesLike) -> int:
    return zlib.crc32(body, zlib.crc32(name + bytes([flags])))


class SegmentSealer:
    """Seals and opens what persistent tiers store; ``key=None``: checksummed, not encrypted."""

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
        """True when opening a segment proves it unaltered against a forger
        (AES-GCM is on); a checksum alone catches accidents only."""
        return self._aead is not None

    def seal(self, name: bytes, plaintext: BytesLike) -> BytesLike:
        """The octets to store for segment ``name``."""
        flags = 0
        data: BytesLike = plaintext
        if self._compress:
            data = zstandard.ZstdCompressor(level=self._level).compress(plaintext)
            flags |= FLAG_ZSTD
        size = len(memoryview(data))
        if self._aead is None:
            # One copy of the body, joined behind its head. (A slice of a
            # bytearray assigned from a memoryview first copies the view into
            # a temporary bytearray: 2 MiB of fresh pages to fault in, which
            # made this 25 times slower than the copy itself.)
            head = CHECKED + bytes([flags]) + _SUM.pack(_sum(name, flags, data))
            return b"".join((head, data))
        nonce = os.urandom(_NONCE)
        # One pass, no intermediate copies: encrypt straight into the output.
        out = bytearray(_HEAD + size + _TAG)
        out[:_HEAD] = MAGIC + bytes([flags]) + nonce
        self._aead.encrypt_into(nonce, data, name + bytes([flags]), memoryview(out)[_HEAD:])
        return out

    def open(self, name: bytes, stored: BytesLike) -> BytesLike:
        """The plaintext of a stored segment; :class:`CorruptData` if it was
        altered, or is not in the form this sealer writes (another key
        configuration, an older kvstore)."""
        view = memoryview(stored)
        what = name.decode(errors="replace")
        if self._aead is not None:
            if len(view) < _HEAD + _TAG or bytes(view[:4]) != MAGIC:
                raise CorruptData(
                    f"segment {what} is not a sealed segment (encryption was on "
                    "when it was stored?)"
                    if bytes(view[:4]) == CHECKED
                    else f"segment {what} is not a sealed segment"
                )
            flags = view[4]
            plain = bytearray(len(view) - _HEAD - _TAG)
            try:
                self._aead.decrypt_into(
                    bytes(view[5:_HEAD]), view[_HEAD:], name + bytes([flags]), plain
                )
            except InvalidTag:
                raise CorruptData(
                    f"segment {what} failed authentication (altered or misplaced)"
                ) from None
            body: BytesLike = plain
        else:
            form = bytes(view[:4])
            if form == CHECKED and len(view) >= _CHECKED_HEAD:
                flags = view[4]
                body = view[_CHECKED_HEAD:]
                good = _sum(name, flags, body) == _SUM.unpack_from(view, 5)[0]
            elif form == CHECKED_CRC32 and len(view) >= _CRC_HEAD:  # written before XXH3
                flags = view[4]
                body = view[_CRC_HEAD:]
                good = _crc(name, flags, body) == _CRC.unpack_from(view, 5)[0]
            else:
                hint = " (stored encrypted: configure its key)" if form == MAGIC else ""
                raise CorruptData(f"segment {what} is not a checksummed segment{hint}")
            if not good:
                raise CorruptData(f"segment {what} fails its checksum (altered or misplaced)")
        if flags & ~FLAG_ZSTD:
            raise CorruptData(f"segment {what}: unknown flags {flags:#x}")
        if flags & FLAG_ZSTD:
            try:
                size = zstandard.frame_content_size(body)
                if not 0 <= size <= self.max_plain_octets:
                    raise CorruptData(f"segment {what}: bad decompressed size {size}")
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
            except (zstandard.ZstdError, MemoryError) as exc:
                raise CorruptData(f"segment {what}: {describe(exc)}") from exc
        return body
