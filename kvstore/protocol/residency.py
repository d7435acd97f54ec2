"""Instance residency (a kvstore extension, not KVSP): "block K is resident
on instance X in medium M", told to the Index Service by the bridge beside
an engine that does not speak KVSP (``kvstore events``, docs/events.md).

A residency record is not a Replica Record: it is never a source to fetch
from (an engine's GPU memory serves no GET), so a lookup answers it apart,
as ``resident``: each instance holding a prefix of the keys looked up, with
how many leading blocks it holds. The Placement Controller counts those as
neither fetched nor recomputed at that instance (the draft's ``fetch_us``
for blocks already resident at i).

``POST {is}residency/{instance-id}`` (the instance ID of H6, from its URI)
carries a :class:`ResidencyUpdate`: additions and removals by scope,
compatibility ID and medium, ``clear`` to void what this instance told
before, and the TTL of all of this instance's records, which every update
(an empty one too: a heartbeat) starts again. The answer says how many
records the IS holds for the instance and whether it knew the instance
before this update (``known``: an IS that restarted, or whose records
expired, did not; the bridge then sends everything again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._json import Obj, fail, hex32_list

#: The media vLLM names (KV events' ``medium``); others are refused.
MEDIA = frozenset({"GPU", "CPU", "STORAGE"})


@dataclass(frozen=True, slots=True)
class ResidencyGroup:
    scope_id: str
    compat_id: str
    medium: str
    block_keys: tuple[str, ...]

    @classmethod
    def from_json(cls, value: Any, path: str, max_keys: int) -> ResidencyGroup:
        obj = Obj(value, path)
        medium = obj.text("medium", max_len=16)
        if medium not in MEDIA:
            fail(f"{path}.medium", f"{medium!r} is not one of {sorted(MEDIA)}")
        return cls(
            obj.hex16("scope_id"),
            obj.hex32("compat_id"),
            medium,
            hex32_list(obj, "block_keys", max_items=max_keys),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "scope_id": self.scope_id,
            "compat_id": self.compat_id,
            "medium": self.medium,
            "block_keys": list(self.block_keys),
        }


@dataclass(frozen=True, slots=True)
class ResidencyUpdate:
    """The body of ``POST residency/{instance-id}`` (see the module)."""

    instance: str
    ttl_ms: int
    clear: bool = False
    add: tuple[ResidencyGroup, ...] = ()
    remove: tuple[ResidencyGroup, ...] = ()

    @classmethod
    def from_json(cls, value: Any, max_keys: int = 1 << 16) -> ResidencyUpdate:
        obj = Obj(value, "residency")
        groups: dict[str, tuple[ResidencyGroup, ...]] = {}
        left = max_keys
        for name in ("add", "remove"):
            found = []
            for item, path in obj.items(name, default=[], max_items=max_keys):
                group = ResidencyGroup.from_json(item, path, max(left, 0))
                left -= len(group.block_keys)
                if left < 0:
                    fail("residency", f"names more than {max_keys} block keys")
                found.append(group)
            groups[name] = tuple(found)
        return cls(
            obj.uri("instance"),
            obj.integer("ttl_ms", lo=1),
            obj.flag("clear", False),
            groups["add"],
            groups["remove"],
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"instance": self.instance, "ttl_ms": self.ttl_ms}
        if self.clear:
            out["clear"] = True
        if self.add:
            out["add"] = [g.to_json() for g in self.add]
        if self.remove:
            out["remove"] = [g.to_json() for g in self.remove]
        return out


@dataclass(frozen=True, slots=True)
class Resident:
    """In a lookup answer's ``resident``: an instance holding the first
    ``prefix_blocks`` keys looked up, and in which media."""

    instance: str
    prefix_blocks: int
    media: tuple[str, ...]

    @classmethod
    def from_json(cls, value: Any, path: str) -> Resident:
        obj = Obj(value, path)
        raw = obj.array("media", default=[], max_items=8)
        media = tuple(m for m in raw if isinstance(m, str) and m in MEDIA)
        return cls(obj.uri("instance"), obj.integer("prefix_blocks", lo=1), media)

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "prefix_blocks": self.prefix_blocks,
            "media": list(self.media),
        }


@dataclass(frozen=True, slots=True)
class ResidencyAnswer:
    """The IS's answer to an update: the TTL granted, whether it knew the
    instance before (False: send everything again), its records there."""

    ttl_ms: int
    known: bool
    records: int

    @classmethod
    def from_json(cls, value: Any) -> ResidencyAnswer:
        obj = Obj(value, "residency_answer")
        return cls(obj.integer("ttl_ms", lo=1), obj.flag("known"), obj.integer("records"))

    def to_json(self) -> dict[str, Any]:
        return {"ttl_ms": self.ttl_ms, "known": self.known, "records": self.records}
