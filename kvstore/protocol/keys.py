"""Scopes and Block Keys (K1-K3).

A Block Key names a block *together with its whole prefix*: it is a keyed hash
chain over the tokens, with ``K[-1]`` = 32 zero octets and::

    K[i] = HMAC-SHA-256( scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id
                         || K[i-1] || uint32be(t[i*B]) || ... || uint32be(t[i*B+B-1]) )

Only complete blocks have keys. :class:`BlockKeyChain` keeps the last key and
the tokens of the incomplete block, so a session can extend its chain as
tokens are generated without rehashing the prefix.

Speed: tokens are packed a whole batch at a time (``array('I')`` plus one
byteswap, both C loops); the only per-block Python work is one concatenation
and one ``hmac.digest`` call.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from ..native import hex_keys

SCOPE_LABEL = b"KVSP-SCOPE-1\x00"
BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
ZERO_KEY = bytes(32)
MIN_SCOPE_KEY_OCTETS = 32

assert array("I").itemsize == 4, "array('I') must be 32 bits for token packing"


def _check_scope_key(scope_key: bytes) -> None:
    if not isinstance(scope_key, bytes | bytearray | memoryview):
        raise TypeError("scope_key must be bytes")
    if len(scope_key) < MIN_SCOPE_KEY_OCTETS:
        # K1: at least 32 random octets; a short key is a configuration error.
        raise ValueError(f"scope key must be at least {MIN_SCOPE_KEY_OCTETS} octets")


def scope_id(scope_key: bytes) -> bytes:
    """The 16-octet Scope ID of a Scope Key (K1). Safe to disclose; the key is not (K3)."""
    _check_scope_key(scope_key)
    return hashlib.sha256(SCOPE_LABEL + bytes(scope_key)).digest()[:16]


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Tokens as consecutive uint32 in network byte order."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError("tokens must be integers in [0, 2^32)") from exc
    except TypeError as exc:
        raise ValueError(f"tokens must be integers: {exc}") from exc
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


class BlockKeyChain:
    """The Block Key chain of one token sequence, extended incrementally (K2).

    >>> chain = BlockKeyChain(scope_key, compat_id, block_tokens=16)
    >>> keys = chain.extend(prompt_tokens)      # keys of the complete blocks
    >>> more = chain.extend(generated_tokens)   # only the newly completed ones
    """

    __slots__ = ("_key", "_last", "_pending", "_prefix", "_step", "block_tokens", "keys")

    def __init__(
        self, scope_key: bytes, compat_id: bytes, block_tokens: int, last_key: bytes = ZERO_KEY
    ) -> None:
        _check_scope_key(scope_key)
        if len(compat_id) != 32:
            raise ValueError("compat_id must be the 32 raw octets of the Compatibility ID")
        if block_tokens < 1:
            raise ValueError("block_tokens must be positive")
        if len(last_key) != 32:
            raise ValueError("last_key must be 32 octets")
        self._key = bytes(scope_key)
        self._prefix = BLOCK_LABEL + bytes(compat_id)
        self._step = 4 * block_tokens
        self._last = bytes(last_key)
        self._pending = b""
        self.block_tokens = block_tokens
        #: Every key computed so far, in block order.
        self.keys: list[bytes] = []

    @property
    def last_key(self) -> bytes:
        """``K[i]`` of the last complete block, or 32 zero octets before the first."""
        return self._last

    @property
    def pending_tokens(self) -> int:
        """Tokens after the last complete block (they have no key yet)."""
        return len(self._pending) // 4

    def extend(self, tokens: Sequence[int] | Iterable[int]) -> list[bytes]:
        """Append tokens; return the keys of the blocks this completed, in order."""
        data = self._pending + pack_tokens(tokens)
        step = self._step
        complete = len(data) - len(data) % step
        new: list[bytes] = []
        append = new.append
        prefix, key, prev = self._prefix, self._key, self._last
        digest = hmac.digest
        for start in range(0, complete, step):
            prev = digest(key, prefix + prev + data[start : start + step], "sha256")
            append(prev)
        self._last = prev
        self._pending = data[complete:]
        self.keys.extend(new)
        return new


def block_keys(
    scope_key: bytes, compat_id: bytes, tokens: Sequence[int] | Iterable[int], block_tokens: int
) -> list[bytes]:
    """The Block Keys of every complete block of ``tokens`` (K2)."""
    return BlockKeyChain(scope_key, compat_id, block_tokens).extend(tokens)


class PackedKeys(Sequence[str]):
    """Block Keys as they arrive packed (32 octets each, concatenated: ours,
    the octet-stream ``POST place``), seen as the sequence of their hex
    strings (the form KVSP carries them in).

    The strings are made only when asked for: an index in this process walks
    the octets themselves (:func:`kvstore.native.walk`), so an 8k-key
    placement makes no string per key unless it sends a prefetch directive.
    """

    __slots__ = ("octets",)

    def __init__(self, octets: bytes) -> None:
        if len(octets) % 32:
            raise ValueError("packed block keys: not a whole number of 32-octet keys")
        self.octets = bytes(octets)

    def __len__(self) -> int:
        return len(self.octets) // 32

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return PackedKeys(self.octets[32 * start : 32 * max(start, stop)])
            return tuple(self[i] for i in range(start, stop, step))
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("packed block keys: index out of range")
        return self.octets[32 * index : 32 * index + 32].hex()

    def __iter__(self) -> Iterator[str]:
        return iter(hex_keys(self.octets))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedKeys):
            return self.octets == other.octets
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PackedKeys({len(self)} keys)"
