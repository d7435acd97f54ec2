"""The reference engine: a small Llama-architecture model under HF
``transformers`` (the optional ``engine`` extra), made from a fixed seed.

No hub, no download: on first use the weights are drawn from ``seed`` and
saved as ``model.safetensors`` in the data directory, beside a byte-level
tokenizer definition (``tokenizer.json``: the 256 byte values, then BOS,
EOS and PAD). The Compatibility Descriptor is computed from those files
(C5), so two instances made from the same seed share caches and any other
model does not (C3). Four layers, GQA (4 query heads over 2 KV heads),
RoPE; fp32, on CPU here and on ``cuda`` when asked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..digests import model_digest, tokenizer_digest
from ..protocol.compat import CompatibilityDescriptor, parse_descriptor
from .engine import Generation, KVLayers

MODEL = "kvstore-reference-llama-tiny"
BOS, EOS, PAD = 256, 257, 258
CONFIG: dict[str, Any] = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}
TOKENIZER = {
    "kvstore_tokenizer": "bytes-1",
    "byte_tokens": 256,
    "specials": {"bos": BOS, "eos": EOS, "pad": PAD},
}


def encode_text(text: str) -> list[int]:
    """The tokenizer: BOS, then the UTF-8 octets."""
    return [BOS, *text.encode()]


def decode_tokens(tokens: Sequence[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode(errors="replace")


class ReferenceEngine:
    """The :class:`~.engine.Engine` interface over ``LlamaForCausalLM``."""

    def __init__(
        self, directory: str | Path, *, block_tokens: int = 16, seed: int = 0, device: str = "cpu"
    ) -> None:
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import LlamaConfig, LlamaForCausalLM

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self.config = LlamaConfig(**CONFIG)
        weights, tokenizer = root / "model.safetensors", root / "tokenizer.json"
        if not weights.exists():
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                fresh = LlamaForCausalLM(self.config)
            state = {k: v.contiguous() for k, v in fresh.state_dict().items()}
            save_file(state, str(weights.with_suffix(".tmp")), metadata={"seed": str(seed)})
            weights.with_suffix(".tmp").replace(weights)
        if not tokenizer.exists():
            tokenizer.write_text(json.dumps(TOKENIZER, sort_keys=True) + "\n")
        self.model = LlamaForCausalLM(self.config)
        self.model.load_state_dict(load_file(str(weights)))
        self.model.to(device).eval()  # type: ignore[arg-type]
        self.device = device
        self.descriptor: CompatibilityDescriptor = parse_descriptor(
            {
                "model": MODEL,
                "model_digest": model_digest(root, ["*.safetensors"]),
                "tokenizer_digest": tokenizer_digest(tokenizer),
                "layers": CONFIG["num_hidden_layers"],
                "kv_heads": CONFIG["num_key_value_heads"],
                "head_dim": CONFIG["head_dim"],
                "kv_dtype": "fp32",
                "positional": f"rope;theta={int(CONFIG['rope_theta'])}",
                "block_tokens": block_tokens,
                "layout": "kvsp-layout-1",
            }
        )

    def _forward(self, tokens: Sequence[int], cache: Any) -> Any:
        import torch

        ids = torch.tensor([list(tokens)], device=self.device)
        with torch.no_grad():
            return self.model(input_ids=ids, cache=cache, use_cache=True)

    def prefill(self, tokens: Sequence[int], loaded: KVLayers | None = None) -> Generation:
        from transformers import DynamicCache

        tokens = list(tokens)
        cache = DynamicCache(config=self.config)
        start = 0
        if loaded:
            start = int(loaded[0][0].shape[0])
            if not 0 < start <= len(tokens) or len(loaded) != self.config.num_hidden_layers:
                raise ValueError("loaded KV must cover a prefix of the tokens, every layer")
            if start == len(tokens):
                start -= 1  # the last token's logits are still needed: recompute it
            for layer, (k, v) in enumerate(loaded):
                # [tokens, kv_heads, head_dim] -> [1, kv_heads, tokens, head_dim]
                keys = k[:start].to(self.device).permute(1, 0, 2).unsqueeze(0)
                values = v[:start].to(self.device).permute(1, 0, 2).unsqueeze(0)
                cache.update(keys, values, layer)
        out = self._forward(tokens[start:], cache)
        return Generation(tokens, out.logits[0, -1].float().cpu(), len(tokens) - start, cache)

    def extend(self, generation: Generation, token: int) -> None:
        out = self._forward([token], generation.cache)
        generation.tokens.append(token)
        generation.computed += 1
        generation.logits = out.logits[0, -1].float().cpu()

    def kv(self, generation: Generation, start: int, end: int) -> KVLayers:
        return [
            (
                layer.keys[0, :, start:end].permute(1, 0, 2).contiguous().cpu(),
                layer.values[0, :, start:end].permute(1, 0, 2).contiguous().cpu(),
            )
            for layer in generation.cache.layers
        ]
