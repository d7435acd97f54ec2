"""Sequence-sharded contexts on the instance: holding token ranges and
carrying out reshard plans (RS2-RS6).

A context is the KV of one long token sequence, split by token range across
instances (a shard map, RS1). The instance knows a context from our
``PUT contexts/{map}`` (the PC's identity only): its scope, compat ID and
block keys, the map version, and the ranges this instance holds in it,
which it then makes resident (from any replica the IS lists). Ranges are
whole blocks: the KV of a range is the blocks it covers, in the tiers.

``POST reshard`` (from the PC only, SEC1):

- a plan from version v (the one held here, else 409 ``kvsp-plan-conflict``,
  RS7) to v+1: ``retain`` ranges stay where they are and are never
  transferred (RS3); each ``fetch`` range is loaded from its current owner,
  over the owner's block resources (its holder role, found in the policy),
  leased, verified and placed; the answer is 200 only once every fetch range
  is loaded (RS4), and an error otherwise (the PC then aborts);
- ``{"map", "commit": v+1}``: v+1 is held, and the plan's ``release``
  ranges are dropped (RS5);
- ``{"map", "abort": v+1}``: what was fetched for v+1 is dropped, v stays
  (RS6).

Octets moved are counted per context (``GET contexts/{map}``), so that a
test or an operator sees that retained ranges cost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from ..protocol._json import Obj, check_range, hex32_list
from ..protocol.control import (
    MAX_SHARDS,
    ReshardAbort,
    ReshardCommit,
    ReshardMessage,
    ReshardPlan,
)
from ..protocol.problems import (
    BadGateway,
    BadRequest,
    KvspError,
    NotFound,
    PlanConflict,
    UnknownResource,
)
from ..protocol.records import LookupRequest
from ..security import Policy
from ..storage import BlockRef, TieredStore
from .prefetch import Prefetcher

log = logging.getLogger("kvstore.instance")

Range = tuple[int, int]
MAX_CONTEXTS = 1024


@dataclass(frozen=True, slots=True)
class ContextDefinition:
    """Body of our ``PUT contexts/{map}``."""

    scope_id: str
    compat_id: str
    block_keys: tuple[str, ...]
    version: int
    ranges: tuple[Range, ...]

    @classmethod
    def from_json(cls, value: Any, max_blocks: int = 1 << 16) -> ContextDefinition:
        obj = Obj(value, "context")
        keys = hex32_list(obj, "block_keys")
        if len(keys) > max_blocks:
            raise BadRequest(f"context.block_keys: at most {max_blocks}")
        ranges = tuple(
            check_range(item, path, half_open=True)
            for item, path in obj.items("ranges", default=[], max_items=MAX_SHARDS)
        )
        return cls(
            obj.hex16("scope_id"), obj.hex32("compat_id"), keys, obj.integer("version"), ranges
        )


@dataclass
class Context:
    map: str
    scope_id: str
    compat_id: str
    keys: tuple[str, ...]
    version: int
    #: Blocks (indexes) this instance holds for ``version``.
    held: set[int] = field(default_factory=set)
    #: A plan in progress: its target version, the blocks it fetched (not
    #: held before) and the plan itself (its release ranges, RS5).
    pending: ReshardPlan | None = None
    fetched: set[int] = field(default_factory=set)
    octets_fetched: int = 0
    blocks_fetched: int = 0
    blocks_released: int = 0

    def ranges(self, blocks: set[int], size: int) -> list[list[int]]:
        out: list[list[int]] = []
        for index in sorted(blocks):
            if out and out[-1][1] == index * size:
                out[-1][1] = (index + 1) * size
            else:
                out.append([index * size, (index + 1) * size])
        return out


class Shards:
    def __init__(
        self,
        store: TieredStore,
        prefetcher: Prefetcher,
        policy: Policy,
        block_tokens: int,
        *,
        lease_ms: int = 5000,
    ) -> None:
        self.store, self.prefetcher, self.policy = store, prefetcher, policy
        self.block_tokens, self.lease_ms = block_tokens, lease_ms
        self.contexts: dict[str, Context] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # An owner named in a plan is an instance; its blocks are served by
        # the holder role of the same principal (H6, SEC1).
        self.holder_of = {
            g.instance: g.holder
            for g in policy.principals.values()
            if g.instance is not None and g.holder is not None
        }

    def _blocks(self, ranges: tuple[Range, ...] | list[Range], context: Context) -> set[int]:
        size = self.block_tokens
        out: set[int] = set()
        for start, end in ranges:
            if start % size or end % size:
                raise BadRequest(f"range [{start}, {end}): ranges are whole blocks of {size}")
            if end // size > len(context.keys):
                raise BadRequest(f"range [{start}, {end}) is past the context's blocks")
            out.update(range(start // size, end // size))
        return out

    def get(self, map_id: str) -> Context:
        context = self.contexts.get(map_id)
        if context is None:
            raise UnknownResource(f"unknown context {map_id}")
        return context

    def _ref(self, context: Context, index: int) -> BlockRef:
        return BlockRef(context.compat_id, context.scope_id, context.keys[index])

    async def define(
        self, map_id: str, definition: ContextDefinition, deadline_s: float
    ) -> Context:
        """Know a context and hold its ranges of ``definition.version``."""
        if map_id not in self.contexts and len(self.contexts) >= MAX_CONTEXTS:
            raise BadRequest(f"at most {MAX_CONTEXTS} contexts")
        context = Context(
            map_id,
            definition.scope_id,
            definition.compat_id,
            definition.block_keys,
            definition.version,
        )
        wanted = self._blocks(definition.ranges, context)
        async with self._lock(map_id):
            known = self.contexts.get(map_id)
            if known is not None and known.keys != context.keys:
                raise BadRequest("the context exists with other blocks")
            loaded = await self._load_any(context, sorted(wanted), deadline_s)
            if loaded != wanted:
                raise BadGateway(
                    f"{len(wanted - loaded)} blocks of the context could not be loaded"
                )
            context.held = wanted
            self.contexts[map_id] = context
        return context

    def _lock(self, map_id: str) -> asyncio.Lock:
        return self._locks.setdefault(map_id, asyncio.Lock())

    async def _load_any(self, context: Context, blocks: list[int], deadline_s: float) -> set[int]:
        """Blocks held already or fetched from any replica the IS lists."""
        done = {i for i in blocks if self._ref(context, i) in self.store}
        rest = [i for i in blocks if i not in done]
        if not rest:
            return done
        if self.prefetcher.index is None:
            return done
        async with asyncio.timeout(deadline_s):
            for index in rest:  # one key per lookup: the IS matches prefixes
                key = context.keys[index]
                answer = await self.prefetcher.index.lookup(
                    LookupRequest(context.scope_id, context.compat_id, (key,))
                )
                if not answer.matched:
                    continue
                records = {(r.block_key, r.holder): r for r in answer.replicas[0]}
                loaded: list[str] = []
                await self.prefetcher._fetch(
                    self._ref(context, index),
                    tuple(h for _, h in records),
                    records,
                    self.lease_ms,
                    loaded,
                )
                if loaded:
                    done.add(index)
        return done

    async def reshard(self, message: ReshardMessage) -> dict[str, Any]:
        if message.map not in self.contexts:
            # RS7: a plan for a map of which this instance holds no version
            # does not match its current version (there is none).
            raise PlanConflict(f"this instance holds no version of map {message.map} (RS7)")
        context = self.get(message.map)
        async with self._lock(message.map):
            if isinstance(message, ReshardPlan):
                return await self._plan(context, message)
            if isinstance(message, ReshardCommit):
                return await self._commit(context, message)
            assert isinstance(message, ReshardAbort)
            return await self._abort(context, message)

    async def _plan(self, context: Context, plan: ReshardPlan) -> dict[str, Any]:
        if plan.from_version != context.version:
            raise PlanConflict(f"this instance holds version {context.version} (RS7)")
        retain = self._blocks(plan.retain, context)
        if not retain <= context.held:
            raise PlanConflict("the plan retains ranges this instance does not hold")
        self._blocks(plan.release, context)  # checked now, applied at the commit
        if context.pending is not None and context.pending.to_version == plan.to_version:
            if context.pending == plan:
                return self._answer(context)  # a repeat: already loaded
            raise PlanConflict(f"another plan to version {plan.to_version} is in progress")
        context.pending, context.fetched = plan, set()
        try:
            async with asyncio.timeout(plan.deadline_ms / 1000):
                for fetch in plan.fetch:
                    # RS3: nothing retained is fetched; RS4: every fetch range.
                    blocks = self._blocks([(fetch.start, fetch.end)], context) - retain
                    await self._fetch_range(context, sorted(blocks), fetch.source)
        except TimeoutError:
            raise BadGateway("the fetch ranges were not loaded by the plan's deadline") from None
        return self._answer(context)

    async def _fetch_range(self, context: Context, blocks: list[int], owner: str) -> None:
        holder = self.holder_of.get(owner)
        if holder is None:
            raise BadGateway(f"{owner} has no holder resources this instance knows (policy)")
        records: dict[Any, Any] = {}
        if self.prefetcher.index is not None and blocks:
            # Records that let every layer be verified (BL6), the owner's.
            for index in blocks:
                key = context.keys[index]
                answer = await self.prefetcher.index.lookup(
                    LookupRequest(context.scope_id, context.compat_id, (key,))
                )
                for group in answer.replicas:
                    records.update({(r.block_key, r.holder): r for r in group})
        for index in blocks:
            ref = self._ref(context, index)
            if ref in self.store:
                if index not in context.held:
                    context.fetched.add(index)  # here already: nothing moves
                continue
            loaded: list[str] = []
            await self.prefetcher._fetch(ref, (holder,), records, self.lease_ms, loaded)
            if not loaded:
                raise BadGateway(f"block {index} of the range could not be fetched from {owner}")
            context.fetched.add(index)
            context.blocks_fetched += 1
            with contextlib.suppress(KvspError):
                context.octets_fetched += self.store.info(ref).size

    async def _commit(self, context: Context, commit: ReshardCommit) -> dict[str, Any]:
        plan = context.pending
        if context.version == commit.version:
            return self._answer(context)  # a repeated commit
        if plan is None or plan.to_version != commit.version:
            raise PlanConflict(f"no plan to version {commit.version} here")
        released = self._blocks(plan.release, context)
        context.held = (context.held | context.fetched) - released
        context.version = commit.version
        context.pending, context.fetched = None, set()
        for index in sorted(released):  # RS5: released after the commit
            await self._drop(context, index)
        return self._answer(context)

    async def _abort(self, context: Context, abort: ReshardAbort) -> dict[str, Any]:
        plan = context.pending
        if plan is not None and plan.to_version == abort.version:
            # RS6: what was fetched for v+1 goes; v stays.
            for index in sorted(context.fetched - context.held):
                await self._drop(context, index)
            context.pending, context.fetched = None, set()
        return self._answer(context)

    async def _drop(self, context: Context, index: int) -> None:
        ref = self._ref(context, index)
        try:
            await self.store.delete(ref)  # withdrawn from the IS by the holder's hook
            context.blocks_released += 1
        except NotFound:
            pass
        except KvspError as exc:
            log.warning("context %s: block %d not dropped: %s", context.map, index, exc.detail)

    def _answer(self, context: Context) -> dict[str, Any]:
        size = self.block_tokens
        return {
            "map": context.map,
            "version": context.version,
            "held": context.ranges(context.held, size),
            "resharding_to": None if context.pending is None else context.pending.to_version,
            "fetched": context.ranges(context.fetched, size),
            "blocks_fetched": context.blocks_fetched,
            "octets_fetched": context.octets_fetched,
            "blocks_released": context.blocks_released,
        }

    def answer(self, map_id: str) -> dict[str, Any]:
        return self._answer(self.get(map_id))
