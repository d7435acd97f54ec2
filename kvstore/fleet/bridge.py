"""From vLLM's KV events to KVSP residency: which Block Keys an engine holds.

The bridge runs beside one engine and holds its scope keys (the IS never
has them, K3). A ``BlockStored`` event names each block by vLLM's own hash,
chained on its parent's; the bridge names it by its KVSP Block Key, the
keyed chain over the same tokens (K2), computed from the block's
``token_ids`` and its parent's Block Key, which it remembers by vLLM hash
(a bounded map). The scope is chosen once per chain, by the first block's
``cache_salt`` as kvstore's vLLM connector chooses it: no salt, the
default scope; a salt of ``salt_scopes``, that scope; any other salt, no
residency at all (never published, never guessed).

What KVSP cannot name is skipped, counted by reason: LoRA and multimodal or
prompt-embeds extra keys (the tokens alone do not name such a block), a
group other than full attention, lookahead tokens, a block size other
than the descriptor's ``block_tokens``, a parent the bridge does not know.

The bridge's own state is :class:`Residency` (what it has told, or will
tell, the IS); :meth:`Bridge.apply` turns events into :class:`Changes`.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..protocol.keys import BLOCK_LABEL, ZERO_KEY, pack_tokens, scope_id
from .vllm_events import Cleared, Event, MalformedEvent, Removed, Stored, VllmHash

#: The kinds of attention group a Block Key names (vLLM's KVCacheSpecKind).
FULL_ATTENTION = frozenset({"full_attention", "mla_attention"})

#: Why an event's blocks were not made residency (the ``reason`` label).
SKIP_REASONS = (
    "malformed",
    "unknown_salt",
    "lora",
    "multimodal",
    "prompt_embeds",
    "attention_group",
    "lookahead",
    "block_size",
    "unknown_parent",
    "unknown_block",
)


@dataclass(slots=True)
class Changes:
    """What to tell the IS: blocks that became resident in a medium, blocks
    that left one (the last change of a block wins: one added then removed
    within an update is a removal), and whether everything this instance
    told before is void (``clear``: a restart, a cleared cache, events lost)."""

    clear: bool = False
    #: (scope_id, medium, Block Key hex) -> added (True) or removed (False).
    ops: dict[tuple[str, str, str], bool] = field(default_factory=dict)

    def add(self, scope: str, medium: str, key: str) -> None:
        self._set((scope, medium, key), True)

    def remove(self, scope: str, medium: str, key: str) -> None:
        self._set((scope, medium, key), False)

    def _set(self, what: tuple[str, str, str], added: bool) -> None:
        self.ops.pop(what, None)
        self.ops[what] = added

    def merge(self, later: Changes) -> None:
        """``later``'s changes after these (a clear drops what came before)."""
        if later.clear:
            self.clear, self.ops = True, {}
        for what, added in later.ops.items():
            self._set(what, added)

    @property
    def added(self) -> dict[tuple[str, str], list[str]]:
        """(scope_id, medium) -> the Block Keys added, in order."""
        return self._by(True)

    @property
    def removed(self) -> dict[tuple[str, str], list[str]]:
        return self._by(False)

    def _by(self, added: bool) -> dict[tuple[str, str], list[str]]:
        out: dict[tuple[str, str], list[str]] = {}
        for (scope, medium, key), op in self.ops.items():
            if op is added:
                out.setdefault((scope, medium), []).append(key)
        return out

    def __bool__(self) -> bool:
        return self.clear or bool(self.ops)

    def count(self) -> int:
        return len(self.ops)


@dataclass(slots=True)
class Known:
    """One block the bridge can name: its scope (hex ID), its Block Key
    (octets, the parent of what follows it) and the media it is resident in."""

    scope: str
    key: bytes
    media: set[str] = field(default_factory=set)


@dataclass(slots=True)
class BridgeCounters:
    """What ``/metrics`` shows of a bridge (``kvstore_events_*``)."""

    received: int = 0
    applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    gaps_replayed: int = 0
    gaps_lost: int = 0
    restarts: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))


class Bridge:
    """Events of one engine to residency changes (see the module).

    ``scope_keys``: scope key by cache salt, ``""`` the default scope (no
    salt); ``compat_id`` (hex) and ``block_tokens``: the descriptor the
    engine's blocks are named under; ``max_blocks``: how many vLLM hashes
    are remembered (the oldest go first; one still resident is withdrawn
    as it goes, since its removal could no longer be named)."""

    def __init__(
        self,
        scope_keys: Mapping[str, bytes],
        compat_id: str,
        block_tokens: int,
        max_blocks: int = 1 << 18,
    ) -> None:
        self.scopes = {salt: (key, scope_id(key).hex()) for salt, key in scope_keys.items()}
        self.keys = {sid: key for key, sid in self.scopes.values()}
        self.compat_octets = bytes.fromhex(compat_id)
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.known: OrderedDict[VllmHash, Known] = OrderedDict()
        self.counters = BridgeCounters()

    # --- events ------------------------------------------------------------

    def apply(self, events: Iterable[Event]) -> Changes:
        changes = Changes()
        for event in events:
            self.counters.received += 1
            if isinstance(event, Stored):
                self._stored(event, changes)
            elif isinstance(event, Removed):
                self._removed(event, changes)
            elif isinstance(event, Cleared):
                self.counters.cleared += 1
                changes.merge(self.forget())
            elif isinstance(event, MalformedEvent):
                self._skip("malformed")
                continue
            self.counters.applied += 1
        return changes

    def forget(self) -> Changes:
        """Everything void: the engine restarted, cleared its cache, or events
        were lost that no replay could give back. The IS is told to drop this
        instance's residency; the chain starts again from the next events."""
        self.known.clear()
        return Changes(clear=True)

    def resident(self) -> Changes:
        """Every block resident now, as additions (to tell an IS that lost
        this instance's records, e.g. after its own restart)."""
        changes = Changes(clear=True)
        for block in self.known.values():
            for medium in block.media:
                changes.add(block.scope, medium, block.key.hex())
        return changes

    def _skip(self, reason: str, blocks: int = 1) -> None:
        self.counters.skipped[reason] += blocks

    def _stored(self, event: Stored, changes: Changes) -> None:
        count = len(event.block_hashes)
        reason = self._unnameable(event)
        if reason is not None:
            self._skip(reason, count)
            return
        parent_key, scope = ZERO_KEY, None
        if event.parent is not None:
            parent = self.known.get(event.parent)
            if parent is None:
                self._skip("unknown_parent", count)
                return
            parent_key, scope = parent.key, parent.scope
        size = self.block_tokens
        if len(event.token_ids) != count * size:
            self._skip("block_size", count)
            return
        packed = pack_tokens(event.token_ids)
        for i, vllm_hash in enumerate(event.block_hashes):
            if scope is None:  # the first block of a chain: its salt
                found = self._scope_of(event.extra_keys[0] if event.extra_keys else None)
                if found is None:
                    self._skip("unknown_salt", count - i)
                    return
                key_octets, scope = found
            else:
                key_octets = self.keys[scope]
            key = hmac.digest(
                key_octets,
                BLOCK_LABEL
                + self.compat_octets
                + parent_key
                + packed[4 * i * size : 4 * (i + 1) * size],
                "sha256",
            )
            block = self.known.get(vllm_hash)
            if block is None or block.key != key:
                block = self.known[vllm_hash] = Known(scope, key)
            else:
                self.known.move_to_end(vllm_hash)
            if event.medium not in block.media:
                block.media.add(event.medium)
                changes.add(scope, event.medium, key.hex())
            parent_key = key
            self.counters.blocks_stored += 1
        while len(self.known) > self.max_blocks:
            _, old = self.known.popitem(last=False)
            for medium in old.media:  # its removal could not be named later
                changes.remove(old.scope, medium, old.key.hex())

    def _unnameable(self, event: Stored) -> str | None:
        if event.lora_name is not None:
            return "lora"
        if event.spec_kind is not None and event.spec_kind not in FULL_ATTENTION:
            return "attention_group"
        if event.lookahead:
            return "lookahead"
        if event.block_size != self.block_tokens:
            return "block_size"
        for extra in event.extra_keys or ():
            for item in extra or ():
                if isinstance(item, list | tuple):
                    return "multimodal"
                if isinstance(item, bytes):
                    return "prompt_embeds"
        return None

    def _scope_of(self, extra: object) -> tuple[bytes, str] | None:
        """The scope of a chain's first block, by its cache salt (the one
        string among its extra keys; no salt: the default scope)."""
        salts = [x for x in (extra or ()) if isinstance(x, str)]  # type: ignore[attr-defined]
        if len(salts) > 1:
            return None
        return self.scopes.get(salts[0] if salts else "")

    def _removed(self, event: Removed, changes: Changes) -> None:
        for vllm_hash in event.block_hashes:
            block = self.known.get(vllm_hash)
            if block is None or event.medium not in block.media:
                self._skip("unknown_block")
                continue
            block.media.discard(event.medium)
            changes.remove(block.scope, event.medium, block.key.hex())
            self.counters.blocks_removed += 1
