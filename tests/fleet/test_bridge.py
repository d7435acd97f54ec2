"""vLLM's KV events, hand-made in both encodings, to KVSP residency
(kvstore.fleet): Block Keys as ``kvstore keys`` computes them, scopes by
cache salt, what KVSP cannot name skipped by reason."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from kvstore.fleet.bridge import Bridge
from kvstore.fleet.vllm_events import (
    Cleared,
    MalformedEvent,
    Removed,
    Stored,
    decode_batch,
    decode_sequence,
)
from kvstore.protocol.keys import block_keys, scope_id

COMPAT = hashlib.sha256(b"compat").hexdigest()
DEFAULT_KEY = bytes(range(32))
TENANT_KEY = bytes(range(32, 64))
B = 16


def kvsp_keys(tokens: list[int], key: bytes = DEFAULT_KEY) -> list[str]:
    return [k.hex() for k in block_keys(key, bytes.fromhex(COMPAT), tokens, B)]


def stored_map(hashes: list[int], parent: int | None, tokens: list[int], **more: object) -> dict:
    """A BlockStored as vLLM >= 0.26 sends it: a map tagged "type"."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **more,
    }


def payload(*events: object, ts: float = 1.5) -> bytes:
    return msgpack.packb([ts, list(events), 0])


def bridge() -> Bridge:
    return Bridge({"": DEFAULT_KEY, "tenant-a": TENANT_KEY}, COMPAT, B)


PROMPT = list(range(1000, 1000 + 3 * B))


def test_both_encodings_decode_to_the_same_events() -> None:
    tagged = decode_batch(payload(stored_map([11, 12], None, PROMPT[: 2 * B])))
    positional = decode_batch(
        payload(["BlockStored", [11, 12], None, PROMPT[: 2 * B], B, None, "GPU"])
    )
    assert tagged.events == positional.events
    assert tagged.ts == 1.5 and tagged.dp_rank == 0
    [event] = tagged.events
    assert isinstance(event, Stored) and event.block_hashes == [11, 12]
    removed = decode_batch(
        payload(
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
            ["BlockRemoved", [11], "CPU"],
        )
    )
    assert removed.events == [Removed([12], "GPU"), Removed([11], "CPU")]
    assert decode_batch(payload({"type": "AllBlocksCleared"}, ["AllBlocksCleared"])).events == [
        Cleared(),
        Cleared(),
    ]
    assert decode_sequence((7).to_bytes(8, "big")) == 7
    assert decode_sequence((-1).to_bytes(8, "big", signed=True)) == -1


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "BlockStored", "block_hashes": [1]},  # fields missing
        {"type": "Teleported"},
        stored_map([1], None, ["x"] * B),
        stored_map([1.5], None, list(range(B))),  # type: ignore[list-item]
        "a string",
    ],
)
def test_a_malformed_event_is_skipped_alone(bad: object) -> None:
    batch = decode_batch(payload(bad, stored_map([1], None, PROMPT[:B])))
    assert isinstance(batch.events[0], MalformedEvent)
    changes = (b := bridge()).apply(batch.events)
    assert b.counters.skipped["malformed"] == 1
    assert changes.added == {(scope_id(DEFAULT_KEY).hex(), "GPU"): kvsp_keys(PROMPT[:B])}


@pytest.mark.parametrize("broken", [b"\xc1", b"", msgpack.packb({"ts": 1}), msgpack.packb([1, 2])])
def test_a_malformed_batch_raises(broken: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_batch(broken)


def test_block_keys_chain_on_their_parents_across_events() -> None:
    b = bridge()
    first = b.apply(decode_batch(payload(stored_map([1, 2], None, PROMPT[: 2 * B]))).events)
    # The third block arrives later, chained on the second by vLLM's hash.
    later = b.apply(decode_batch(payload(stored_map([3], 2, PROMPT[2 * B :]))).events)
    default = scope_id(DEFAULT_KEY).hex()
    expected = kvsp_keys(PROMPT)
    assert first.added == {(default, "GPU"): expected[:2]}
    assert later.added == {(default, "GPU"): expected[2:]}
    # Removal names the block by its Block Key; a second removal is unknown.
    gone = b.apply([Removed([2], "GPU"), Removed([2], "GPU")])
    assert gone.removed == {(default, "GPU"): [expected[1]]}
    assert b.counters.skipped["unknown_block"] == 1
    # Stored again (offloaded to CPU, then back on GPU): told again.
    back = b.apply([Stored([2], 1, PROMPT[B : 2 * B], B, "CPU")])
    assert back.added == {(default, "CPU"): [expected[1]]}


def test_salts_choose_scopes_and_never_mix() -> None:
    b = bridge()
    tenant = b.apply(
        [Stored([21, 22], None, PROMPT[: 2 * B], B, "GPU", extra_keys=[["tenant-a"], None])]
    )
    plain = b.apply([Stored([31, 32], None, PROMPT[: 2 * B], B, "GPU")])
    unknown = b.apply([Stored([41], None, PROMPT[:B], B, "GPU", extra_keys=[["tenant-b"]])])
    a_scope, default = scope_id(TENANT_KEY).hex(), scope_id(DEFAULT_KEY).hex()
    assert tenant.added == {(a_scope, "GPU"): kvsp_keys(PROMPT[: 2 * B], TENANT_KEY)}
    assert plain.added == {(default, "GPU"): kvsp_keys(PROMPT[: 2 * B])}
    assert tenant.added[a_scope, "GPU"][0] != plain.added[default, "GPU"][0]
    assert not unknown and b.counters.skipped["unknown_salt"] == 1
    # A child of the tenant's chain stays in the tenant's scope (its salt is
    # only on the first block, as vLLM sends it).
    child = b.apply([Stored([23], 22, PROMPT[2 * B :], B, "GPU")])
    assert child.added == {(a_scope, "GPU"): kvsp_keys(PROMPT, TENANT_KEY)[2:]}
    # A child of a chain never published (an unknown salt) is not either.
    assert not b.apply([Stored([42], 41, PROMPT[B : 2 * B], B, "GPU")])
    assert b.counters.skipped["unknown_parent"] == 1


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (Stored([1], None, PROMPT[:B], B, "GPU", lora_name="sql-adapter"), "lora"),
        (Stored([1], None, PROMPT[:B], B, "GPU", extra_keys=[[["img-1", 0]]]), "multimodal"),
        (Stored([1], None, PROMPT[:B], B, "GPU", extra_keys=[[b"\x01" * 32]]), "prompt_embeds"),
        (Stored([1], None, PROMPT[:B], B, "GPU", spec_kind="sliding_window"), "attention_group"),
        (Stored([1], None, PROMPT[:B], B, "GPU", lookahead=[5, 6]), "lookahead"),
        (Stored([1, 2], None, PROMPT[: 2 * 8], 8, "GPU"), "block_size"),
        (Stored([1], 99, PROMPT[:B], B, "GPU"), "unknown_parent"),
    ],
)
def test_what_kvsp_cannot_name_is_skipped_by_reason(event: Stored, reason: str) -> None:
    b = bridge()
    assert not b.apply([event])
    assert b.counters.skipped[reason] == len(event.block_hashes)
    assert sum(b.counters.skipped.values()) == len(event.block_hashes)


def test_a_clear_voids_everything_and_a_full_resend_names_what_is_resident() -> None:
    b = bridge()
    b.apply(
        [
            Stored([1, 2], None, PROMPT[: 2 * B], B, "GPU"),
            Stored([2], 1, PROMPT[B : 2 * B], B, "CPU"),
        ]
    )
    everything = b.resident()
    default = scope_id(DEFAULT_KEY).hex()
    keys = kvsp_keys(PROMPT[: 2 * B])
    assert everything.clear
    assert everything.added == {(default, "GPU"): keys, (default, "CPU"): [keys[1]]}
    cleared = b.apply([Cleared()])
    assert cleared.clear and not cleared.added and not b.known
    # The chain starts again: a child of a forgotten parent is not named.
    assert not b.apply([Stored([3], 2, PROMPT[2 * B :], B, "GPU")])


def test_the_map_is_bounded_and_what_leaves_it_is_withdrawn() -> None:
    b = Bridge({"": DEFAULT_KEY}, COMPAT, B, max_blocks=2)
    changes = b.apply([Stored([1, 2, 3], None, PROMPT, B, "GPU")])
    default = scope_id(DEFAULT_KEY).hex()
    keys = kvsp_keys(PROMPT)
    # The oldest left the map: withdrawn (its later removal could not be
    # named); told and withdrawn within one update, it is only withdrawn.
    assert changes.added == {(default, "GPU"): keys[1:]}
    assert changes.removed == {(default, "GPU"): keys[:1]}
    assert list(b.known) == [2, 3]
