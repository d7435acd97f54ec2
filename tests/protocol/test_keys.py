"""Scopes and Block Keys (K1, K2)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.protocol.keys import BlockKeyChain, PackedKeys, block_keys, pack_tokens, scope_id

from .vectors import COMPAT_ID, K0, K1, SCOPE_ID, SCOPE_KEY, TOKENS

CID = bytes.fromhex(COMPAT_ID)


def reference_keys(key: bytes, cid: bytes, tokens: list[int], b: int) -> list[bytes]:
    """K2 written out literally, one token at a time, as an independent oracle."""
    prev = bytes(32)
    out = []
    for i in range(len(tokens) // b):
        msg = b"KVSP-BLOCK-1" + b"\x00" + cid + prev
        for t in tokens[i * b : (i + 1) * b]:
            msg += struct.pack(">I", t)
        prev = hmac.new(key, msg, hashlib.sha256).digest()
        out.append(prev)
    return out


def test_appendix_scope_id() -> None:
    # K1
    assert scope_id(SCOPE_KEY).hex() == SCOPE_ID


def test_appendix_block_keys() -> None:
    # K2: the two blocks of four tokens of the appendix.
    assert [k.hex() for k in block_keys(SCOPE_KEY, CID, TOKENS, 4)] == [K0, K1]


def test_only_complete_blocks_have_keys() -> None:
    # K2: the 3 tokens after the last complete block get no key.
    chain = BlockKeyChain(SCOPE_KEY, CID, 4)
    assert [k.hex() for k in chain.extend([*TOKENS, 1, 2, 3])] == [K0, K1]
    assert chain.pending_tokens == 3
    assert block_keys(SCOPE_KEY, CID, TOKENS[:3], 4) == []


def test_incremental_extension_token_by_token() -> None:
    chain = BlockKeyChain(SCOPE_KEY, CID, 4)
    got = []
    for token in TOKENS:
        got += chain.extend([token])
    assert [k.hex() for k in got] == [K0, K1]
    assert chain.keys == got
    assert chain.last_key.hex() == K1


def test_chain_resumes_from_a_known_key() -> None:
    # A chain can continue from K[0] without the first block's tokens.
    chain = BlockKeyChain(SCOPE_KEY, CID, 4, last_key=bytes.fromhex(K0))
    assert [k.hex() for k in chain.extend(TOKENS[4:])] == [K1]


def test_key_binds_the_prefix() -> None:
    # The same second block after a different first block has a different key.
    other = [1, 2, 3, 4, *TOKENS[4:]]
    assert block_keys(SCOPE_KEY, CID, other, 4)[1].hex() != K1


def test_scopes_are_unrelated() -> None:
    # K3: another scope key gives unrelated keys for the same tokens.
    other = bytes(range(1, 33))
    assert block_keys(other, CID, TOKENS, 4)[0].hex() != K0
    assert scope_id(other).hex() != SCOPE_ID


@pytest.mark.parametrize("key", [b"", bytes(31)])
def test_short_scope_key_is_refused(key: bytes) -> None:
    # K1: at least 32 octets.
    with pytest.raises(ValueError, match="at least 32"):
        scope_id(key)
    with pytest.raises(ValueError):
        BlockKeyChain(key, CID, 4)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], ["1"]])
def test_tokens_must_be_uint32(tokens: list[object]) -> None:
    with pytest.raises(ValueError):
        pack_tokens(tokens)  # type: ignore[arg-type]


def test_chain_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        BlockKeyChain(SCOPE_KEY, CID[:16], 4)
    with pytest.raises(ValueError):
        BlockKeyChain(SCOPE_KEY, CID, 0)
    with pytest.raises(ValueError):
        BlockKeyChain(SCOPE_KEY, CID, 4, last_key=b"x")


def test_pack_tokens_is_network_order() -> None:
    assert pack_tokens([1, 0x01020304]) == b"\x00\x00\x00\x01\x01\x02\x03\x04"


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block=st.integers(1, 17),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_chain_extension_equals_one_shot(tokens: list[int], block: int, cuts: list[int]) -> None:
    # Extending in arbitrary pieces equals one-shot computation equals the literal oracle.
    one_shot = block_keys(SCOPE_KEY, CID, tokens, block)
    assert one_shot == reference_keys(SCOPE_KEY, CID, tokens, block)
    chain = BlockKeyChain(SCOPE_KEY, CID, block)
    pieces = []
    start = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        pieces += chain.extend(tokens[start:cut])
        start = cut
    assert pieces == one_shot


def test_packed_keys_read_as_their_hex() -> None:
    octets = bytes(range(96))
    names = [octets[i : i + 32].hex() for i in (0, 32, 64)]
    keys = PackedKeys(octets)
    assert len(keys) == 3 and list(keys) == names
    assert keys[0] == names[0] and keys[-1] == names[2]
    assert list(keys[1:]) == names[1:] and list(keys[::2]) == names[::2]
    assert isinstance(keys[1:], PackedKeys) and list(keys[5:]) == []
    assert keys == tuple(names) and tuple(names) == keys and keys == names
    assert keys == PackedKeys(octets) and keys != PackedKeys(octets[:64])
    assert hash(keys) == hash(tuple(names))
    for index in (3, -4):
        with pytest.raises(IndexError):
            keys[index]
    for bad in (b"x", bytes(33)):
        with pytest.raises(ValueError, match="32-octet"):
            PackedKeys(bad)
