"""HTTP-level pieces of KVSP that need no I/O (H2, H5, H6, BL1-BL5).

Resource paths are relative to a role's base URI (H7); this module builds and
parses them, the ``layers=a-b`` query, and the ``Repr-Digest`` field (RFC 9530).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from ._bytes import BytesLike
from .problems import BadRequest, DigestMismatch

JSON_MEDIA_TYPE = "application/kvsp+json"
BLOCK_MEDIA_TYPE = "application/kvsp-block"
NO_STORE = "no-store"  # H5: every response other than block data

_LAYERS = re.compile(r"(0|[1-9][0-9]{0,9})-(0|[1-9][0-9]{0,9})")
_REPR_DIGEST = re.compile(r"\s*sha-256\s*=\s*:([A-Za-z0-9+/]+={0,2}):\s*")


def role_id(base_uri: str) -> str:
    """``{holder-id}`` / ``{instance-id}``: base64url, no padding, of SHA-256(base URI) (H6)."""
    digest = hashlib.sha256(base_uri.encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def block_path(compat_id: str, scope_id: str, block_key: str) -> str:
    """``blocks/{compat}/{scope}/{block_key}`` (BL1)."""
    return f"blocks/{compat_id}/{scope_id}/{block_key}"


def replica_path(holder: str, block_key: str) -> str:
    """``replicas/{holder-id}/{block_key}`` (P1)."""
    return f"replicas/{role_id(holder)}/{block_key}"


def block_resource_name(compat_id: str, scope_id: str, block_key: str) -> bytes:
    """The name a stored segment is bound to (associated data of encryption at rest)."""
    return block_path(compat_id, scope_id, block_key).encode("ascii")


def parse_layers(value: str) -> tuple[int, int]:
    """Parse the ``layers=a-b`` query value: an inclusive range with a <= b (BL2)."""
    match = _LAYERS.fullmatch(value)
    if match is None:
        raise BadRequest(f"layers={value!r}: expected two decimal integers 'a-b'")
    first, last = int(match[1]), int(match[2])
    if first > last or last >= 2**32:
        raise BadRequest(f"layers={value}: first layer must not exceed last, both < 2^32")
    return first, last


#: A key or ID: a hex string, or its octets (what BlockKeyChain and compat_id give).
Hex = str | bytes


def hex_id(value: str | bytes | bytearray | memoryview, octets: int, what: str) -> str:
    """A key or ID as a resource path writes it: octets (as
    ``BlockKeyChain.extend`` and ``compat_id`` return them) in hex, or a hex
    string, lowercased. ``ValueError`` for a wrong length or a non-hex
    string, ``TypeError`` for anything else (never a path that routes nowhere)."""
    if isinstance(value, str):
        text = value.lower()
        if len(text) == 2 * octets and all(c in "0123456789abcdef" for c in text):
            return text
        raise ValueError(f"{what}: {2 * octets} hex digits, got {value!r}")
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if len(raw) == octets:
            return raw.hex()
        raise ValueError(f"{what}: {octets} octets, got {len(raw)}")
    raise TypeError(f"{what}: bytes or a hex string, not {type(value).__name__}")


def format_layers(first: int, last: int) -> str:
    return f"{first}-{last}"


def repr_digest(*chunks: BytesLike) -> str:
    """The ``Repr-Digest`` field value for a representation made of ``chunks`` (BL4)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return "sha-256=:" + base64.b64encode(h.digest()).decode("ascii") + ":"


def parse_repr_digest(value: str) -> bytes:
    """The SHA-256 in a ``Repr-Digest`` field; other algorithms in the list are ignored."""
    for member in value.split(","):
        match = _REPR_DIGEST.fullmatch(member)
        if match:
            try:
                digest = base64.b64decode(match[1], validate=True)
            except binascii.Error:
                continue
            if len(digest) == 32:
                return digest
    raise DigestMismatch(f"Repr-Digest {value!r} carries no sha-256 value")


def block_cache_control(remaining_ttl_ms: int) -> str:
    """BL5: private, immutable, and never cached beyond the replica's remaining TTL."""
    return f"private, immutable, max-age={max(0, remaining_ttl_ms // 1000)}"
