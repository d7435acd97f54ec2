"""Records of the control plane (R3, R4, RS1, RS2): status, sessions, shards.

Same conventions as :mod:`kvstore.protocol.records`: frozen dataclasses,
``from_json`` validates (unknown members ignored), ``to_json`` serializes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._json import (
    UINT32_MAX,
    Obj,
    check_range,
    check_uri,
    fail,
    hex32_list,
    token_list,
)
from .lifecycle import InstanceState

# R5: "KVSP Instance States" registry, as the wire spells its names (the
# states and their transitions: :mod:`.lifecycle`).
INSTANCE_STATES = frozenset(state.value for state in InstanceState)
MAX_LINKS = 1024
MAX_SHARDS = 4096


class Link(NamedTuple):
    """An instance's measured path to a holder.

    A named tuple, not a dataclass: placement groups instances by their
    links (equal links, one fetch plan), and a tuple's hash and equality run
    in C, a dataclass's in Python (~1 us per instance and placement)."""

    holder: str
    mbit_per_s: float
    rtt_us: float

    @classmethod
    def from_json(cls, value: Any, path: str) -> Link:
        obj = Obj(value, path)
        return cls(obj.uri("holder"), obj.number("mbit_per_s", lo=1e-6), obj.number("rtt_us"))

    def to_json(self) -> dict[str, Any]:
        return {"holder": self.holder, "mbit_per_s": self.mbit_per_s, "rtt_us": self.rtt_us}


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """Instance Status Record (R3), sent with ``PUT instances/{id}/status``."""

    instance: str
    epoch: int
    state: str
    running: int
    queued: int
    batch_size: int
    kv_utilization: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ttl_ms: int
    links: tuple[Link, ...] = ()
    requested_state: str | None = None
    #: Ours (``kvstore_accepts_directives``, absent: true): false for an
    #: engine bridged by ``kvstore events``, which has no prefetch API.
    accepts_directives: bool = True

    @classmethod
    def from_json(cls, value: Any) -> InstanceStatus:
        obj = Obj(value, "status")
        return cls(
            instance=obj.uri("instance"),
            epoch=obj.integer("epoch"),
            state=obj.name("state", INSTANCE_STATES),
            running=obj.integer("running", hi=UINT32_MAX),
            queued=obj.integer("queued", hi=UINT32_MAX),
            batch_size=obj.integer("batch_size", hi=UINT32_MAX),
            kv_utilization=obj.number("kv_utilization", hi=1.0),
            prefill_tokens_per_s=obj.number("prefill_tokens_per_s"),
            decode_tokens_per_s=obj.number("decode_tokens_per_s"),
            links=tuple(
                Link.from_json(item, path)
                for item, path in obj.items("links", default=[], max_items=MAX_LINKS)
            ),
            requested_state=obj.name("requested_state", INSTANCE_STATES, default=None),
            ttl_ms=obj.integer("ttl_ms", lo=1, hi=UINT32_MAX),
            accepts_directives=obj.flag("kvstore_accepts_directives", True),
        )

    def link_to(self, holder: str) -> Link | None:
        for link in self.links:
            if link.holder == holder:
                return link
        return None

    def to_json(self) -> dict[str, Any]:
        out = {
            "instance": self.instance,
            "epoch": self.epoch,
            "state": self.state,
            "running": self.running,
            "queued": self.queued,
            "batch_size": self.batch_size,
            "kv_utilization": self.kv_utilization,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "links": [link.to_json() for link in self.links],
            "requested_state": self.requested_state,
            "ttl_ms": self.ttl_ms,
        }
        if not self.accepts_directives:
            out["kvstore_accepts_directives"] = False
        return out


@dataclass(frozen=True, slots=True)
class StateChange:
    """``{"state": ...}``: the PC's answer to a status PUT (S3) and the body of ``PUT state``."""

    state: str

    @classmethod
    def from_json(cls, value: Any) -> StateChange:
        return cls(Obj(value, "state_change").name("state", INSTANCE_STATES))

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state}


@dataclass(frozen=True, slots=True)
class Sampler:
    method: str
    seed: int
    step: int
    deterministic: bool
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, value: Any, path: str) -> Sampler:
        obj = Obj(value, path)
        params = obj.value.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            fail(f"{path}.params", "must be a JSON object")
        return cls(
            method=obj.text("method", max_len=64),
            params=dict(params),
            seed=obj.integer("seed", lo=-(2**63), hi=2**64 - 1),
            step=obj.integer("step"),
            deterministic=obj.flag("deterministic"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "params": dict(self.params),
            "seed": self.seed,
            "step": self.step,
            "deterministic": self.deterministic,
        }


MAX_STOP_TOKENS = 64


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    """Ours, carried in a checkpoint as the member ``kvstore_limits`` (other
    implementations ignore it, R4): where the session's output ends, so
    that a resumed session ends where the first instance would have."""

    max_tokens: int
    stop_tokens: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, value: Any, path: str) -> GenerationLimits:
        obj = Obj(value, path)
        return cls(
            max_tokens=obj.integer("max_tokens", lo=1, hi=UINT32_MAX),
            stop_tokens=token_list(obj, "stop_tokens", default=[], max_items=MAX_STOP_TOKENS),
        )

    def to_json(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "stop_tokens": list(self.stop_tokens)}


@dataclass(frozen=True, slots=True)
class SessionCheckpoint:
    """Session Checkpoint (R4), sent with ``PUT sessions/{session}/checkpoint``."""

    session: str
    epoch: int
    compat_id: str
    scope_id: str
    prompt_blocks: tuple[str, ...]
    prompt_tail: tuple[int, ...]
    generated: tuple[int, ...]
    output_offset: int
    sampler: Sampler
    limits: GenerationLimits | None = None

    @classmethod
    def from_json(cls, value: Any) -> SessionCheckpoint:
        obj = Obj(value, "checkpoint")
        checkpoint = cls(
            session=obj.uuid("session"),
            epoch=obj.integer("epoch"),
            compat_id=obj.hex32("compat_id"),
            scope_id=obj.hex16("scope_id"),
            prompt_blocks=hex32_list(obj, "prompt_blocks"),
            prompt_tail=token_list(obj, "prompt_tail"),
            generated=token_list(obj, "generated"),
            output_offset=obj.integer("output_offset"),
            sampler=Sampler.from_json(obj.value.get("sampler"), "checkpoint.sampler"),
            limits=(
                None
                if obj.value.get("kvstore_limits") is None
                else GenerationLimits.from_json(
                    obj.value["kvstore_limits"], "checkpoint.kvstore_limits"
                )
            ),
        )
        # output_offset counts the output tokens the checkpoint covers; it
        # cannot cover fewer tokens than it lists.
        if checkpoint.output_offset < len(checkpoint.generated):
            fail("checkpoint.output_offset", "is smaller than the number of generated tokens")
        return checkpoint

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "epoch": self.epoch,
            "compat_id": self.compat_id,
            "scope_id": self.scope_id,
            "prompt_blocks": list(self.prompt_blocks),
            "prompt_tail": list(self.prompt_tail),
            "generated": list(self.generated),
            "output_offset": self.output_offset,
            "sampler": self.sampler.to_json(),
            **({} if self.limits is None else {"kvstore_limits": self.limits.to_json()}),
        }


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """``POST sessions/{session}/resume`` body (CK5): the latest checkpoint and
    the session's new epoch. (The draft names both and no layout: this is
    ours; the checkpoint keeps the epoch it was written in.)"""

    epoch: int
    checkpoint: SessionCheckpoint

    @classmethod
    def from_json(cls, value: Any) -> ResumeRequest:
        obj = Obj(value, "resume")
        request = cls(
            epoch=obj.integer("epoch", lo=1),
            checkpoint=SessionCheckpoint.from_json(obj.value.get("checkpoint")),
        )
        if request.epoch <= request.checkpoint.epoch:
            fail("resume.epoch", "must be higher than the checkpoint's epoch")
        return request

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "checkpoint": self.checkpoint.to_json()}


@dataclass(frozen=True, slots=True)
class Shard:
    """Tokens ``[start, end)`` of a context held by ``instance``."""

    start: int
    end: int
    instance: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens": [self.start, self.end], "instance": self.instance}


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Shard Map (RS1): half-open, contiguous, non-overlapping token ranges."""

    map: str
    version: int
    shards: tuple[Shard, ...]

    @classmethod
    def from_json(cls, value: Any) -> ShardMap:
        obj = Obj(value, "shard_map")
        shards: list[Shard] = []
        for item, path in obj.items("shards", max_items=MAX_SHARDS):
            shard = Obj(item, path)
            start, end = check_range(shard.value.get("tokens"), f"{path}.tokens", half_open=True)
            if shards and start != shards[-1].end:
                fail(
                    f"{path}.tokens", f"starts at {start}, previous shard ends at {shards[-1].end}"
                )
            shards.append(Shard(start, end, shard.uri("instance")))
        if not shards:
            fail("shard_map.shards", "must list at least one shard")
        return cls(obj.text("map", max_len=256), obj.integer("version"), tuple(shards))

    def ranges_of(self, instance: str) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.shards if s.instance == instance]

    def to_json(self) -> dict[str, Any]:
        return {
            "map": self.map,
            "version": self.version,
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(frozen=True, slots=True)
class RangeFetch:
    start: int
    end: int
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens": [self.start, self.end], "from": self.source}


def _ranges(obj: Obj, name: str) -> tuple[tuple[int, int], ...]:
    return tuple(
        check_range(item, path, half_open=True)
        for item, path in obj.items(name, default=[], max_items=MAX_SHARDS)
    )


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """``POST reshard`` plan from version ``from_version`` to ``to_version`` (RS2)."""

    map: str
    from_version: int
    to_version: int
    deadline_ms: int
    retain: tuple[tuple[int, int], ...] = ()
    fetch: tuple[RangeFetch, ...] = ()
    release: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "map": self.map,
            "from": self.from_version,
            "to": self.to_version,
            "deadline_ms": self.deadline_ms,
            "retain": [list(r) for r in self.retain],
            "fetch": [f.to_json() for f in self.fetch],
            "release": [list(r) for r in self.release],
        }


@dataclass(frozen=True, slots=True)
class ReshardCommit:
    """``{"map": ..., "commit": v+1}`` (RS5)."""

    map: str
    version: int

    def to_json(self) -> dict[str, Any]:
        return {"map": self.map, "commit": self.version}


@dataclass(frozen=True, slots=True)
class ReshardAbort:
    """``{"map": ..., "abort": v+1}`` (RS6)."""

    map: str
    version: int

    def to_json(self) -> dict[str, Any]:
        return {"map": self.map, "abort": self.version}


ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort


def parse_reshard(value: Any) -> ReshardMessage:
    """Parse a ``POST reshard`` body: a plan, a commit or an abort, by its members."""
    obj = Obj(value, "reshard")
    map_id = obj.text("map", max_len=256)
    kinds = [name for name in ("commit", "abort", "to") if name in obj]
    if len(kinds) != 1:
        fail("reshard", "must be exactly one of a plan (from/to), a commit or an abort")
    if kinds[0] == "commit":
        return ReshardCommit(map_id, obj.integer("commit"))
    if kinds[0] == "abort":
        return ReshardAbort(map_id, obj.integer("abort"))
    from_version = obj.integer("from")
    to_version = obj.integer("to")
    if to_version != from_version + 1:
        fail("reshard.to", f"must be from + 1 ({from_version + 1}), got {to_version}")
    fetch = []
    for item, path in obj.items("fetch", default=[], max_items=MAX_SHARDS):
        entry = Obj(item, path)
        start, end = check_range(entry.value.get("tokens"), f"{path}.tokens", half_open=True)
        source = entry.text("from")
        fetch.append(RangeFetch(start, end, check_uri(source, f"{path}.from")))
    return ReshardPlan(
        map=map_id,
        from_version=from_version,
        to_version=to_version,
        deadline_ms=obj.integer("deadline_ms", hi=UINT32_MAX),
        retain=_ranges(obj, "retain"),
        fetch=tuple(fetch),
        release=_ranges(obj, "release"),
    )
