"""The Index Service's instance residency (kvstore.protocol.residency): what
engines hold in their own memory, as their bridges tell it.

Kept in this process's memory, apart from the replica records (a lookup
answers them as ``resident``, never as sources). Every record of an
instance lives as long as the instance's last update's TTL: a bridge that
stops (its pod gone) stops refreshing, and its records expire together;
expired instances are swept on the next update or lookup after a second.
An IS restart forgets everything: the next update of each bridge is
answered ``known: false`` and the bridge sends its whole residency again.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.problems import InsufficientStorage
from ..protocol.residency import ResidencyUpdate, Resident

#: (scope_id, compat_id): the space a Block Key is looked up in.
Space = tuple[str, str]


@dataclass(slots=True)
class _Instance:
    uri: str
    expires: float
    #: Its bit in the keys' holder masks.
    bit: int
    #: (space, block key) -> the media it is resident in.
    records: dict[tuple[Space, str], set[str]] = field(default_factory=dict)


@dataclass(slots=True)
class ResidencyCounters:
    residency_updates: int = 0
    residency_added: int = 0
    residency_removed: int = 0
    residency_cleared: int = 0
    residency_expired: int = 0


class ResidencyBook:
    """Residency by instance, and by space and key for lookups; at most
    ``max_records`` (an update that would pass it is refused whole, 507)."""

    SWEEP_S = 1.0

    def __init__(
        self,
        max_records: int = 4_000_000,
        max_ttl_ms: int = 600_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_records, self.max_ttl_ms, self.clock = max_records, max_ttl_ms, clock
        self._instances: dict[str, _Instance] = {}
        #: space -> block key -> the holders' bits (an 8k-key walk is then
        #: one AND a key, whatever the number of instances).
        self._keys: dict[Space, dict[str, int]] = {}
        #: Bits of instances gone, given to the next new ones.
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.records = 0
        self.counters = ResidencyCounters()
        self._swept = 0.0

    def apply(self, instance_id: str, update: ResidencyUpdate) -> tuple[int, bool, int]:
        """Apply ``update`` for ``instance_id`` (the caller authorized it);
        (the TTL granted, whether the instance was known, its records)."""
        self._sweep()
        ttl_ms = min(update.ttl_ms, self.max_ttl_ms)
        now = self.clock()
        entry = self._instances.get(instance_id)
        known = entry is not None and entry.expires > now
        if entry is not None and not known:
            self._drop(instance_id, entry)
            entry = None
        if entry is None:
            bit = self._free_bits.pop() if self._free_bits else self._take_bit()
            entry = self._instances[instance_id] = _Instance(update.instance, 0.0, 1 << bit)
        entry.uri = update.instance
        if update.clear:
            self._clear(instance_id, entry)
            self.counters.residency_cleared += 1
        self.check_room(sum(len(g.block_keys) for g in update.add))
        for group in update.remove:
            space = (group.scope_id, group.compat_id)
            for key in group.block_keys:
                self._remove(instance_id, entry, space, key, group.medium)
        for group in update.add:
            space = (group.scope_id, group.compat_id)
            keys = self._keys.setdefault(space, {})
            for key in group.block_keys:
                media = entry.records.get((space, key))
                if media is None:
                    media = entry.records[(space, key)] = set()
                    keys[key] = keys.get(key, 0) | entry.bit
                    self.records += 1
                if group.medium not in media:
                    media.add(group.medium)
                    self.counters.residency_added += 1
        entry.expires = now + ttl_ms / 1000
        self.counters.residency_updates += 1
        return ttl_ms, known, len(entry.records)

    async def tell(self, instance_id: str, update: ResidencyUpdate) -> tuple[int, bool, int]:
        """:meth:`apply` (the interface a shared book has too)."""
        return self.apply(instance_id, update)

    async def start(self) -> None:
        """Nothing to load (a shared book loads Redis's)."""

    async def close(self) -> None:
        """Nothing to release (a shared book closes its Redis clients)."""

    def check_room(self, adding: int) -> None:
        """InsufficientStorage (507) if ``adding`` more records would pass the cap."""
        if self.records + adding > self.max_records:
            raise InsufficientStorage(
                f"the index holds {self.records} residency records of its "
                f"{self.max_records}; this update adds up to {adding}"
            )

    def lookup(self, scope_id: str, compat_id: str, keys: Sequence[str]) -> list[Resident]:
        """Each live instance holding a prefix of ``keys``, longest first."""
        self._sweep()
        table = self._keys.get((scope_id, compat_id))
        if not table or not keys:
            return []
        now = self.clock()
        live = {e.bit: e for e in self._instances.values() if e.expires > now}
        running = table.get(keys[0], 0) & sum(live)
        if not running:
            return []
        first = running
        prefix: dict[int, int] = {}
        # Walk the keys while any instance still holds every one so far.
        length = 1
        get = table.get
        for key in itertools.islice(keys, 1, None):
            held = get(key, 0)
            if running & held != running:
                for bit in _bits(running & ~held):
                    prefix[bit] = length
                running &= held
                if not running:
                    break
            length += 1
        for bit in _bits(running):
            prefix[bit] = length
        out = []
        space = (scope_id, compat_id)
        for bit in _bits(first):
            entry = live[bit]
            media = entry.records.get((space, keys[0]), set())
            out.append(Resident(entry.uri, prefix[bit], tuple(sorted(media))))
        out.sort(key=lambda r: (-r.prefix_blocks, r.instance))
        return out

    def _take_bit(self) -> int:
        bit, self._next_bit = self._next_bit, self._next_bit + 1
        return bit

    def _remove(
        self, instance_id: str, entry: _Instance, space: Space, key: str, medium: str
    ) -> None:
        media = entry.records.get((space, key))
        if media is None or medium not in media:
            return
        media.discard(medium)
        self.counters.residency_removed += 1
        if not media:
            del entry.records[(space, key)]
            self._unindex(entry, space, key)

    def _unindex(self, entry: _Instance, space: Space, key: str) -> None:
        table = self._keys[space]
        holders = table[key] & ~entry.bit
        if holders:
            table[key] = holders
        else:
            del table[key]
            if not table:
                del self._keys[space]
        self.records -= 1

    def _clear(self, instance_id: str, entry: _Instance) -> None:
        for space, key in entry.records:
            self._unindex(entry, space, key)
        entry.records.clear()

    def _drop(self, instance_id: str, entry: _Instance) -> None:
        self._clear(instance_id, entry)
        del self._instances[instance_id]
        self._free_bits.append(entry.bit.bit_length() - 1)

    def _sweep(self) -> None:
        now = self.clock()
        if now - self._swept < self.SWEEP_S:
            return
        self._swept = now
        for instance_id, entry in list(self._instances.items()):
            if entry.expires <= now:
                self.counters.residency_expired += len(entry.records)
                self._drop(instance_id, entry)


def _bits(mask: int) -> list[int]:
    """The set bits of ``mask``, each as its own mask."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out
