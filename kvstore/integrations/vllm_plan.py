"""The scheduler's half of kvstore's vLLM connector, without vLLM (issue 34).

vLLM's scheduler sees every request's token ids, so blocks are named by
KVSP itself: the Block Key chain (K2) of the prompt under the scope key
and the Compatibility ID of the descriptor (:class:`BlockKeyChain`). A
block vLLM stores is then an ordinary KVSP block, found by the same key
by kvstore's instance role, by ``kvstore keys`` and by any KVSP client.

Per request the planner:

* finds, at the holders, the longest run of whole prompt blocks stored
  after what vLLM has locally, and leases them (LE1) in the same call
  (``POST leases``, one per holder: the grant lists the blocks held), so
  they are not evicted before the worker reads them; at least one prompt
  token is always left to compute;
* tells the worker which pages to fill from which holder (loads) and which
  pages of complete prompt blocks to store (saves), step by step, so
  chunked prefill stores each block once it is computed and a request
  preempted and resumed loads again;
* releases the leases once the load's step has run (two steps later, so a
  step scheduled ahead of the one that loads does not release them early),
  and at the latest when the request finishes.

``cache_salt`` selects the scope: no salt, the default scope; a salt of
``salt_scopes``, that scope; any other salt, no external cache at all
(never another tenant's blocks). Requests with a LoRA adapter or
multimodal inputs are not cached externally: their KV depends on more
than the tokens, and the descriptor does not name it.

With tensor parallelism each rank stores its own heads under its own
descriptor (:func:`rank_descriptor`): the planner computes every rank's
chain and sends each rank its keys; it looks blocks up under rank 0's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..logs import describe
from ..protocol.compat import CompatibilityDescriptor, parse_descriptor
from ..protocol.keys import BlockKeyChain
from .chunks import ChunkStore, Pin

log = logging.getLogger("kvstore.integrations.vllm")
T = TypeVar("T")

#: Steps after the one that carries a load before its leases are released.
RELEASE_AFTER_STEPS = 2


def rank_descriptor(
    descriptor: CompatibilityDescriptor, rank: int, size: int, total_heads: int
) -> CompatibilityDescriptor:
    """The descriptor of tensor-parallel ``rank`` of ``size``: the base
    descriptor (``kv_heads`` already one rank's) with the extension member
    ``kv_head_range``, the rank's ``[first, end)`` of the model's KV heads.
    Ranks that replicate a head (more ranks than KV heads) name the same
    blocks; one rank alone is the descriptor unchanged."""
    if size <= 1:
        return descriptor
    heads = descriptor.kv_heads
    first = rank * heads if size <= total_heads else rank * total_heads // size
    obj = descriptor.to_json()
    obj["kv_head_range"] = [first, first + heads]
    return parse_descriptor(obj)


class KeyedStore(ChunkStore):
    """A :class:`ChunkStore` whose names are Block Keys in hex (the KVSP
    chain), not an engine's keys: the same holders, leases, rendezvous
    order and failure handling."""

    def block_key(self, name: str) -> str:
        return name


@dataclass(slots=True)
class BlockLoad:
    """Pages of one request to fill from the holders in one step."""

    req_id: str
    scope: str
    block_ids: list[int]
    #: Per tensor-parallel rank, the Block Keys (hex) of those pages.
    keys: list[list[str]]
    #: Rank 0's pins (where the scheduler found each block, under its lease).
    holders: list[str]
    leases: list[str | None]


@dataclass(slots=True)
class BlockSave:
    """Pages of one request to store once this step has computed them."""

    req_id: str
    scope: str
    block_ids: list[int]
    keys: list[list[str]]


@dataclass(slots=True)
class StepPlan:
    """What the worker does in one step (vLLM's connector metadata holds it)."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    scope: str
    chains: list[BlockKeyChain]
    prompt: Sequence[int]
    #: Whole prompt blocks (each is stored or loaded once).
    prompt_blocks: int
    block_ids: list[int] = field(default_factory=list)
    #: Blocks known stored from the first on (saved, loaded, found).
    saved: int = 0
    pins: list[Pin | None] = field(default_factory=list)
    #: The blocks to load in the next step: [first, end).
    load: tuple[int, int] | None = None
    #: The tokens vLLM had locally at the last lookup.
    computed: int = 0

    def keys(self, end: int) -> list[list[str]]:
        """Every rank's keys of blocks [0, end), computed once."""
        for chain in self.chains:
            if len(chain.keys) < end:
                chain.extend(
                    self.prompt[len(chain.keys) * chain.block_tokens : end * chain.block_tokens]
                )
        return [[k.hex() for k in chain.keys[:end]] for chain in self.chains]


class Planner:
    """The scheduler side; see the module. ``run`` runs a coroutine on the
    stores' event loop and returns its result (or raises on a timeout)."""

    def __init__(
        self,
        stores: dict[str, KeyedStore],
        scope_keys: dict[str, bytes],
        descriptors: Sequence[CompatibilityDescriptor],
        run: Callable[[Coroutine[Any, Any, Any]], Any],
    ) -> None:
        self.stores = stores
        self.scope_keys = scope_keys
        self.descriptors = list(descriptors)
        self.block_tokens = descriptors[0].block_tokens
        #: The salts with a scope of their own (a store each, by salt).
        self.salts = frozenset(s for s in stores if s)
        self._run = run
        self._requests: dict[str, _Request] = {}
        self._release_queue: deque[list[list[Pin | None]]] = deque([[]] * RELEASE_AFTER_STEPS)
        self._warned: set[str] = set()
        self.stats = dict.fromkeys(
            (
                "lookups",
                "blocks_found",
                "blocks_loaded",
                "blocks_saved",
                "uncached_requests",
                "lookup_failures",
            ),
            0,
        )

    # --- which requests, under which scope ----------------------------

    def scope_of(self, request: Any) -> str | None:
        """The scope a request's blocks live in, or None: not cached."""
        salt = getattr(request, "cache_salt", None)
        if getattr(request, "lora_request", None) is not None:
            self._uncached(
                "lora",
                "kvstore: requests with a LoRA adapter are not cached "
                "externally (the descriptor does not name the adapter)",
            )
            return None
        if getattr(request, "mm_features", None):
            self._uncached(
                "mm",
                "kvstore: multimodal requests are not cached externally "
                "(their KV depends on more than the token ids)",
            )
            return None
        if not salt:
            return ""
        if salt in self.salts:
            return str(salt)
        self._uncached(
            f"salt:{salt}",
            "kvstore: cache_salt %r is not in salt_scopes: no external cache for it",
            salt,
        )
        return None

    def _uncached(self, what: str, message: str, *args: object) -> None:
        self.stats["uncached_requests"] += 1
        if what not in self._warned:
            self._warned.add(what)
            log.info(message, *args)

    def _state(self, request: Any) -> _Request | None:
        found = self._requests.get(request.request_id)
        if found is not None:
            return found
        scope = self.scope_of(request)
        prompt = request.prompt_token_ids
        if scope is None or not prompt:
            return None
        key = self.scope_keys[scope]
        chains = [BlockKeyChain(key, d.compat_id, self.block_tokens) for d in self.descriptors]
        state = _Request(scope, chains, prompt, len(prompt) // self.block_tokens)
        self._requests[request.request_id] = state
        return state

    # --- vLLM's scheduler-side calls ----------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that the holders have, in
        whole blocks, leased (vLLM's ``get_num_new_matched_tokens``)."""
        state = self._state(request)
        if state is None:
            return 0
        self._release(state)
        bt = self.block_tokens
        first = num_computed_tokens // bt
        end = (len(state.prompt) - 1) // bt  # at least one token is computed
        state.saved = max(state.saved, first)  # vLLM has these locally
        state.computed = num_computed_tokens
        if end <= first:
            return 0
        keys = state.keys(end)[0][first:end]
        self.stats["lookups"] += 1
        try:
            pins: list[Pin | None] = self._run(self.stores[state.scope].pin_many(keys))
        except Exception as exc:  # a miss, never the engine's error
            self.stats["lookup_failures"] += 1
            log.warning("kvstore: lookup failed (%s); computing the request", describe(exc))
            return 0
        count = next((i for i, pin in enumerate(pins) if pin is None), len(pins))
        state.pins = pins
        self.stats["blocks_found"] += count
        if count == 0:
            self._release(state)
            return 0
        state.load = (first, first + count)
        return (first + count) * bt - num_computed_tokens

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the load is on, or off."""
        state = self._requests.get(request.request_id)
        if state is None or state.load is None:
            return
        if num_external_tokens <= 0:
            state.load = None
            self._release(state)
            return
        first, _ = state.load
        end = (state.computed + num_external_tokens) // self.block_tokens
        state.load = (first, end)
        state.saved = max(state.saved, end)  # held already: not stored again

    def plan(self, output: Any) -> StepPlan:
        """The worker's plan for this step (vLLM's ``build_connector_meta``)."""
        plan = StepPlan()
        loaded: list[list[Pin | None]] = []
        for req in output.scheduled_new_reqs:
            state = self._requests.get(req.req_id)
            if state is not None:
                state.block_ids = list(req.block_ids[0])
                self._step(
                    plan,
                    loaded,
                    req.req_id,
                    state,
                    req.num_computed_tokens,
                    output.num_scheduled_tokens.get(req.req_id, 0),
                )
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._step(
                plan,
                loaded,
                req_id,
                state,
                cached.num_computed_tokens[i],
                output.num_scheduled_tokens.get(req_id, 0),
            )
        for req_id in getattr(output, "preempted_req_ids", None) or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids = []
                state.load = None
        self._release_queue.append(loaded)
        for pins in self._release_queue.popleft():
            self._release_pins(pins)
        return plan

    def _step(
        self,
        plan: StepPlan,
        loaded: list[list[Pin | None]],
        req_id: str,
        state: _Request,
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        bt = self.block_tokens
        if state.load is not None:
            first, end = state.load
            state.load = None
            if end > first and len(state.block_ids) >= end:
                keys = state.keys(end)
                pins = state.pins[: end - first]
                plan.loads.append(
                    BlockLoad(
                        req_id,
                        state.scope,
                        state.block_ids[first:end],
                        [k[first:end] for k in keys],
                        [p.holder if p else "" for p in pins],
                        [p.lease if p else None for p in pins],
                    )
                )
                self.stats["blocks_loaded"] += end - first
            loaded.append(state.pins)  # released two steps on
            state.pins = []
        done = min(num_computed + num_scheduled, len(state.prompt)) // bt
        done = min(done, state.prompt_blocks, len(state.block_ids))
        if done > state.saved:
            keys = state.keys(done)
            plan.saves.append(
                BlockSave(
                    req_id,
                    state.scope,
                    state.block_ids[state.saved : done],
                    [k[state.saved : done] for k in keys],
                )
            )
            self.stats["blocks_saved"] += done - state.saved
            state.saved = done

    def finished(self, request: Any) -> None:
        """vLLM's ``request_finished``: its leases go."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._release(state)

    # --- leases ---------------------------------------------------------

    def _release(self, state: _Request) -> None:
        pins, state.pins, state.load = state.pins, [], None
        self._release_pins(pins)

    def _release_pins(self, pins: Sequence[Pin | None]) -> None:
        leases = {(p.holder, p.lease): p for p in pins if p is not None and p.lease is not None}
        if not leases:
            return
        store = next(iter(self.stores.values()))
        try:
            self._run(_release_all(store, list(leases.values())))
        except Exception as exc:  # they expire by themselves
            log.info("kvstore: leases not released (%s); they expire by themselves", describe(exc))

    def close(self) -> None:
        for state in list(self._requests.values()):
            self._release(state)
        self._requests.clear()
        while self._release_queue:
            self._release_pins([p for pins in self._release_queue.popleft() for p in pins])


async def _release_all(store: ChunkStore, pins: list[Pin]) -> None:
    import asyncio

    await asyncio.gather(*(store.release(p) for p in pins))
