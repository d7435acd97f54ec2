"""Compatibility Descriptor and Compatibility ID (C1-C4).

Two KV caches may be substituted only when everything that shaped their
tensors is identical; the descriptor lists those things and the Compatibility
ID is its digest::

    compat_id = SHA-256( "KVSP-COMPAT-1" || 0x00 || JCS(descriptor) )

Parsing is strict: a descriptor is the identity of a cache, so a value that
could be spelled two ways (``rope;theta=010000``) would make two IDs for one
configuration. Members this module does not know are kept and hashed with the
rest: an extension member is, by definition, something that affects the cache.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import rfc8785

from .problems import Incompatible, InvalidDescriptor

COMPAT_LABEL = b"KVSP-COMPAT-1\x00"
LAYOUT_1 = "kvsp-layout-1"

# "KVSP Element Types" registry -> octets per element.
ELEMENT_SIZES: dict[str, int] = {
    "bf16": 2,
    "fp16": 2,
    "fp32": 4,
    "fp8-e4m3": 1,
    "fp8-e5m2": 1,
}

# "KVSP Positional Encodings" registry: "none", or "rope" with the optional
# parameter syntax ";theta=<decimal integer>" and then ",scaling=<name>".
_POSITIONAL = re.compile(
    r"none|rope(?:;theta=(?P<theta>[1-9][0-9]*)(?:,scaling=(?P<scaling>[a-z0-9][a-z0-9_.-]*))?)?"
)
_DIGEST = re.compile(r"sha-256:[0-9a-f]{64}")

_MEMBERS = (
    "model",
    "model_digest",
    "tokenizer_digest",
    "adapters",
    "layers",
    "kv_heads",
    "head_dim",
    "kv_dtype",
    "positional",
    "block_tokens",
    "layout",
)


@dataclass(frozen=True, slots=True)
class CompatibilityDescriptor:
    """A validated Compatibility Descriptor (C1). Build it with :func:`parse_descriptor`."""

    model: str
    model_digest: str
    tokenizer_digest: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    positional: str
    block_tokens: int
    layout: str = LAYOUT_1
    adapters: tuple[str, ...] | None = None
    # Members outside the draft's list, kept verbatim (see module docstring).
    extensions: Mapping[str, Any] = field(default_factory=dict)

    @property
    def element_size(self) -> int:
        """Octets per element of ``kv_dtype``."""
        return ELEMENT_SIZES[self.kv_dtype]

    def section_length(self, token_count: int) -> int:
        """Octets of one K or V section of codec raw for ``token_count`` tokens (B2)."""
        return token_count * self.kv_heads * self.head_dim * self.element_size

    @property
    def block_octets(self) -> int:
        """Octets of the data (not the header) of a full raw block, all layers."""
        return 2 * self.layers * self.section_length(self.block_tokens)

    def to_json(self) -> dict[str, Any]:
        """The descriptor as a JSON object (the input of JCS)."""
        obj: dict[str, Any] = dict(self.extensions)
        obj.update(
            model=self.model,
            model_digest=self.model_digest,
            tokenizer_digest=self.tokenizer_digest,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            kv_dtype=self.kv_dtype,
            positional=self.positional,
            block_tokens=self.block_tokens,
            layout=self.layout,
        )
        # C1: absent when no adapter is applied, never an empty array.
        if self.adapters is not None:
            obj["adapters"] = list(self.adapters)
        return obj

    def canonical(self) -> bytes:
        """JCS (RFC 8785) serialization of the descriptor."""
        return bytes(rfc8785.dumps(self.to_json()))

    @property
    def compat_id(self) -> bytes:
        """The 32-octet Compatibility ID (C2)."""
        return hashlib.sha256(COMPAT_LABEL + self.canonical()).digest()

    @property
    def compat_id_hex(self) -> str:
        return self.compat_id.hex()


def _fail(member: str, reason: str) -> InvalidDescriptor:
    return InvalidDescriptor(f"descriptor.{member}: {reason}", member=member)


def _string(obj: Mapping[str, Any], member: str) -> str:
    if member not in obj:
        raise _fail(member, "required member is missing")
    value = obj[member]
    if not isinstance(value, str) or not value:
        raise _fail(member, "must be a non-empty string")
    return value


def _digest(obj: Mapping[str, Any], member: str) -> str:
    value = _string(obj, member)
    if not _DIGEST.fullmatch(value):
        raise _fail(member, 'must be "sha-256:" followed by 64 lowercase hex digits')
    return value


def _positive(obj: Mapping[str, Any], member: str) -> int:
    if member not in obj:
        raise _fail(member, "required member is missing")
    value = obj[member]
    # bool is an int in Python but true is not a layer count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(member, "must be an integer")
    if not 1 <= value < 2**32:
        raise _fail(member, "must be between 1 and 2^32-1")
    return value


def parse_descriptor(obj: Any) -> CompatibilityDescriptor:
    """Validate a JSON object as a Compatibility Descriptor (C1).

    Raises :class:`InvalidDescriptor` naming the first wrong member and why.
    """
    if not isinstance(obj, Mapping):
        raise InvalidDescriptor("descriptor: must be a JSON object")
    model = _string(obj, "model")
    model_digest = _digest(obj, "model_digest")
    tokenizer_digest = _digest(obj, "tokenizer_digest")
    adapters: tuple[str, ...] | None = None
    if "adapters" in obj:
        raw = obj["adapters"]
        if not isinstance(raw, list):
            raise _fail("adapters", "must be an array of digests")
        if not raw:
            raise _fail("adapters", "must be absent, not empty, when no adapter is applied")
        for index, item in enumerate(raw):
            if not isinstance(item, str) or not _DIGEST.fullmatch(item):
                raise _fail(
                    f"adapters[{index}]", 'must be "sha-256:" followed by 64 lowercase hex digits'
                )
        adapters = tuple(raw)
    kv_dtype = _string(obj, "kv_dtype")
    if kv_dtype not in ELEMENT_SIZES:
        raise _fail("kv_dtype", f"{kv_dtype!r} is not in the registry {sorted(ELEMENT_SIZES)}")
    positional = _string(obj, "positional")
    if not _POSITIONAL.fullmatch(positional):
        raise _fail(
            "positional",
            f"{positional!r} is not 'none', 'rope', 'rope;theta=<int>' "
            "or 'rope;theta=<int>,scaling=<name>'",
        )
    layout = _string(obj, "layout")
    if layout != LAYOUT_1:
        raise _fail("layout", f"{layout!r} is unknown; this implementation knows {LAYOUT_1!r}")
    extensions = {k: v for k, v in obj.items() if k not in _MEMBERS}
    try:
        # JCS refuses values it cannot canonicalize (NaN, huge ints, non-str keys).
        rfc8785.dumps(extensions)
    except Exception as exc:
        raise InvalidDescriptor(
            f"descriptor: extension members cannot be canonicalized: {exc}"
        ) from exc
    return CompatibilityDescriptor(
        model=model,
        model_digest=model_digest,
        tokenizer_digest=tokenizer_digest,
        adapters=adapters,
        layers=_positive(obj, "layers"),
        kv_heads=_positive(obj, "kv_heads"),
        head_dim=_positive(obj, "head_dim"),
        kv_dtype=kv_dtype,
        positional=positional,
        block_tokens=_positive(obj, "block_tokens"),
        layout=layout,
        extensions=extensions,
    )


def compat_id(descriptor: CompatibilityDescriptor | Mapping[str, Any]) -> bytes:
    """The Compatibility ID of a descriptor, validating it first when given as JSON (C2, C4)."""
    if not isinstance(descriptor, CompatibilityDescriptor):
        descriptor = parse_descriptor(descriptor)
    return descriptor.compat_id


def check_compatible(expected: bytes | str, actual: bytes | str) -> None:
    """C3: raise :class:`~kvstore.protocol.problems.Incompatible` unless the IDs are equal."""
    want = expected.hex() if isinstance(expected, bytes) else expected
    got = actual.hex() if isinstance(actual, bytes) else actual
    if want != got:
        raise Incompatible(f"compat_id {got} does not match {want}")
