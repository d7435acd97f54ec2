"""The Engine interface: what an inference engine implements to plug into
kvstore (the integration point for real engines; docs/engine.md).

An engine computes; kvstore moves blocks. The engine prefills a prompt,
optionally starting from the KV of its first whole blocks loaded from
holders, extends a generation one token at a time, and hands out the KV of
any token range, layer by layer, as ``[tokens, kv_heads, head_dim]``
tensors in the descriptor's element type: exactly kvsp-layout-1's sections
(B2), so a block container is built without reshaping (:func:`block_container`)
and a loaded one feeds the engine without copies (:func:`load_blocks`).

Sampling is kvstore's, not the engine's: :func:`sample` draws token ``step``
of a session from ``(seed, step)`` alone, so an instance that resumes a
session with the checkpoint's sampler (method, params, seed, step) draws
what the failed instance would have (CK6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..protocol.compat import CompatibilityDescriptor
from ..protocol.container import decode, encode
from ..protocol.control import Sampler

if TYPE_CHECKING:
    import torch

#: Per layer, the (K, V) of a token range: ``[tokens, kv_heads, head_dim]``.
KVLayers = list[tuple["torch.Tensor", "torch.Tensor"]]


@dataclass
class Generation:
    """One sequence inside an engine: its tokens, the logits after the last,
    and the engine's own cache of their KV."""

    tokens: list[int]
    logits: torch.Tensor
    #: Tokens whose KV the engine computed (the rest was loaded).
    computed: int
    cache: Any = field(repr=False, default=None)


class Engine(Protocol):
    """What kvstore needs of an inference engine."""

    descriptor: CompatibilityDescriptor

    def prefill(self, tokens: Sequence[int], loaded: KVLayers | None = None) -> Generation:
        """Process ``tokens``. ``loaded``: the KV of their first tokens (whole
        blocks, every layer), which the engine uses instead of computing it.
        The ids of tokens covered by ``loaded`` are unspecified (a resumed
        session knows its prompt blocks only by key and KV): an engine must
        not use them (for example to key a cache of its own)."""
        ...

    def extend(self, generation: Generation, token: int) -> None:
        """Append ``token`` to the generation and compute the logits after it."""
        ...

    def kv(self, generation: Generation, start: int, end: int) -> KVLayers:
        """The KV of tokens ``[start, end)``, every layer."""
        ...


def block_container(engine: Engine, generation: Generation, block: int) -> bytearray:
    """Block ``block`` of a generation as a raw KV Block Container (B1, B2)."""
    from ..protocol.tensors import tensor_to_section

    size = engine.descriptor.block_tokens
    start = block * size
    if start + size > len(generation.tokens):
        raise ValueError(f"block {block} is not complete ({len(generation.tokens)} tokens)")
    layers = engine.kv(generation, start, start + size)
    sections = [(tensor_to_section(k), tensor_to_section(v)) for k, v in layers]
    return encode(sections, token_count=size)


def load_blocks(
    containers: Sequence[bytes | bytearray], descriptor: CompatibilityDescriptor
) -> KVLayers:
    """The KV of consecutive whole blocks, from their containers, per layer."""
    import torch

    from ..protocol.tensors import container_tensors

    per_block = [
        container_tensors(decode(c, descriptor=descriptor), descriptor) for c in containers
    ]
    if not per_block:
        return []
    return [
        (torch.cat([b[layer][0] for b in per_block]), torch.cat([b[layer][1] for b in per_block]))
        for layer in range(descriptor.layers)
    ]


def sample(logits: torch.Tensor, sampler: Sampler, step: int) -> int:
    """Token ``step`` of a session by ``sampler``: ``greedy``, or ``top-p``
    (params ``p``, ``temperature``) drawn from a generator seeded by
    ``(seed, step)`` only, so that it can be drawn again anywhere (CK6)."""
    import torch

    if sampler.method == "greedy":
        return int(torch.argmax(logits).item())
    if sampler.method != "top-p":
        raise ValueError(f"sampler method {sampler.method!r}: greedy or top-p")
    p = float(sampler.params.get("p", 1.0))
    temperature = float(sampler.params.get("temperature", 1.0))
    probs = torch.softmax(logits.double() / max(temperature, 1e-6), dim=-1)
    ordered, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(ordered, dim=0) - ordered < p  # the smallest set reaching p
    kept = ordered * keep
    generator = torch.Generator().manual_seed((sampler.seed * 1_000_003 + step) % (2**63))
    pick = torch.multinomial(kept / kept.sum(), 1, generator=generator)
    return int(order[pick].item())
