"""vLLM's KV cache events, as its ``ZmqEventPublisher`` sends them.

A message is three ZMQ frames: ``[topic, sequence (8 octets, big-endian,
signed), payload]``; the payload is msgpack of ``[ts, [events], dp_rank]``.
Each event is, since vLLM 0.26, a map tagged by ``"type"`` (msgspec's
``tag=True`` structs); before, a positional array whose first item is the
tag. Both are read here into the same records; a malformed event is a
:class:`MalformedEvent` (the bridge counts and skips it), a malformed
batch raises for the whole message.

The replay socket (a ROUTER) answers a start sequence (8 octets) with the
buffered messages from it, each ``[b"", topic, sequence, payload]`` after
the routing frames, then a sequence of -1 and an empty payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

#: A vLLM block hash as published: the low 64 bits of SHA-256 as an integer
#: (its default), or the whole digest as bytes.
VllmHash = int | bytes

#: The sequence the replay socket sends after the last buffered message.
END_OF_REPLAY = -1


class MalformedEvent(ValueError):
    """An event or a batch that does not decode as vLLM's."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: blocks the engine cached, a chain from ``parent``."""

    block_hashes: list[VllmHash]
    parent: VllmHash | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_name: str | None = None
    #: One entry per block (or None): LoRA name, (mm id, offset) pairs, the
    #: cache salt, prompt-embeds digests, untagged as vLLM publishes them.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    #: vLLM 0.33: tokens decoded speculatively past the block's own.
    lookahead: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: blocks the engine dropped from ``medium``."""

    block_hashes: list[VllmHash]
    medium: str
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the engine's cache was reset."""


Event = Stored | Removed | Cleared | MalformedEvent


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedEvent(f"a sequence frame is 8 octets, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> Batch:
    """One message's payload; each event decoded on its own (a malformed one
    is a :class:`MalformedEvent` in ``events``)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedEvent(f"the payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedEvent("a batch is [ts, [events], dp_rank]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float):
        raise MalformedEvent("a batch's ts is a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return Batch(float(ts), [_event(e) for e in events], rank)


# Positional fields after the tag, in vLLM's declaration order (pre-0.26).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(raw: Any) -> Event:
    try:
        if isinstance(raw, dict):
            tag, fields = raw.get("type"), raw
        elif isinstance(raw, list) and raw and isinstance(raw[0], str):
            tag = raw[0]
            names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
            fields = dict(zip(names, raw[1:], strict=False))
        else:
            return MalformedEvent("an event is a map tagged 'type' or an array")
        if tag == "BlockStored":
            return _stored(fields)
        if tag == "BlockRemoved":
            return Removed(_hashes(fields["block_hashes"]), _medium(fields), _int(fields))
        if tag == "AllBlocksCleared":
            return Cleared()
        return MalformedEvent(f"unknown event type {str(tag)[:40]!r}")
    except (KeyError, TypeError, ValueError) as exc:
        return MalformedEvent(f"event fields: {exc}")


def _stored(fields: dict[str, Any]) -> Stored:
    tokens = fields["token_ids"]
    size = fields["block_size"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("token_ids must be integers")
    if type(size) is not int or size <= 0:
        raise ValueError("block_size must be a positive integer")
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    lookahead = fields.get("lookahead_token_ids")
    return Stored(
        _hashes(fields["block_hashes"]),
        None if parent is None else _hash(parent),
        tokens,
        size,
        _medium(fields),
        fields.get("lora_name") if isinstance(fields.get("lora_name"), str) else None,
        extra if isinstance(extra, list) else None,
        _int(fields),
        fields.get("kv_cache_spec_kind")
        if isinstance(fields.get("kv_cache_spec_kind"), str)
        else None,
        lookahead if isinstance(lookahead, list) else None,
    )


def _hashes(raw: Any) -> list[VllmHash]:
    if not isinstance(raw, list):
        raise ValueError("block_hashes must be an array")
    return [_hash(h) for h in raw]


def _hash(raw: Any) -> VllmHash:
    if type(raw) is int or isinstance(raw, bytes):
        return raw
    raise ValueError("a block hash is an integer or octets")


def _medium(fields: dict[str, Any]) -> str:
    medium = fields.get("medium")
    return medium if isinstance(medium, str) and medium else "GPU"


def _int(fields: dict[str, Any]) -> int | None:
    value = fields.get("group_idx")
    return value if type(value) is int else None
