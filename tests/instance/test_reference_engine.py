"""The Engine interface on the reference engine (a small real transformer):
descriptor from the files (C5), prefix reuse from loaded blocks (B2), and a
restorable sampler (CK6)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvstore.instance.engine import block_container, load_blocks, sample
from kvstore.instance.reference import EOS, ReferenceEngine, decode_tokens, encode_text
from kvstore.protocol.container import decode
from kvstore.protocol.control import Sampler

PROMPT = encode_text("The KV cache of a shared prefix is loaded, not recomputed. " * 2)
GREEDY = Sampler("greedy", seed=0, step=0, deterministic=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ReferenceEngine:
    return ReferenceEngine(tmp_path_factory.mktemp("ref"), block_tokens=16)


def generate(
    engine: ReferenceEngine,
    tokens: list[int],
    n: int,
    sampler: Sampler,
    loaded: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[int]:
    run = engine.prefill(tokens, loaded)
    out = []
    for step in range(n):
        token = sample(run.logits, sampler, sampler.step + step)
        out.append(token)
        engine.extend(run, token)
    return out


def test_descriptor_comes_from_the_files(engine: ReferenceEngine, tmp_path: Path) -> None:
    # C5: the same seed makes the same files, hence the same compat ID; another
    # seed is another model (C3: never substituted).
    again = ReferenceEngine(tmp_path / "again", block_tokens=16)
    assert again.descriptor.compat_id_hex == engine.descriptor.compat_id_hex
    other = ReferenceEngine(tmp_path / "other", block_tokens=16, seed=1)
    assert other.descriptor.compat_id_hex != engine.descriptor.compat_id_hex
    d = engine.descriptor
    assert (d.layers, d.kv_heads, d.head_dim, d.kv_dtype) == (4, 2, 16, "fp32")
    assert d.kv_heads < 4  # GQA: fewer KV heads than query heads
    assert (tmp_path / "again" / "model.safetensors").is_file()


def test_loaded_blocks_give_what_a_full_prefill_gives(engine: ReferenceEngine) -> None:
    # B2: a block's container holds kvsp-layout-1 sections; loading the blocks
    # of a prefix and computing the rest gives the same logits (fp32, CPU:
    # within 1e-4) and the same greedy tokens as computing everything.
    full = engine.prefill(PROMPT)
    blocks = [block_container(engine, full, b) for b in range(len(PROMPT) // 16)]
    container = decode(bytes(blocks[0]), descriptor=engine.descriptor)
    assert len(container) == 4 and container.token_count == 16
    # tokens x kv_heads x head_dim x fp32 octets
    assert len(next(iter(container)).k) == 16 * 2 * 16 * 4
    loaded = load_blocks(blocks, engine.descriptor)
    reused = engine.prefill(PROMPT, loaded)
    assert reused.computed == len(PROMPT) - 16 * len(blocks) < full.computed == len(PROMPT)
    assert torch.allclose(reused.logits, full.logits, atol=1e-4)
    assert generate(engine, PROMPT, 12, GREEDY, loaded) == generate(engine, PROMPT, 12, GREEDY)
    # A prompt that is whole blocks recomputes only its last token.
    exact = PROMPT[: 16 * len(blocks)]
    assert engine.prefill(exact, loaded).computed == 1


def test_a_wrong_prefix_is_refused(engine: ReferenceEngine) -> None:
    full = engine.prefill(PROMPT)
    loaded = load_blocks([block_container(engine, full, 0)], engine.descriptor)
    with pytest.raises(ValueError):
        engine.prefill(PROMPT[:8], loaded)  # more loaded than the prompt has
    with pytest.raises(ValueError):
        block_container(engine, engine.prefill(PROMPT[:20]), 1)  # block 1 is not complete


def test_top_p_resumes_exactly_from_a_checkpointed_step(engine: ReferenceEngine) -> None:
    # CK6: token `step` depends on (seed, step) only: an instance restoring the
    # sampler at step k draws what the first one drew from k on.
    sampler = Sampler("top-p", seed=7, step=0, deterministic=False, params={"p": 0.9})
    first = generate(engine, PROMPT, 10, sampler)
    resumed = generate(engine, PROMPT + first[:4], 6, dataclasses.replace(sampler, step=4))
    assert resumed == first[4:]
    other_seed = generate(engine, PROMPT, 10, dataclasses.replace(sampler, seed=8))
    assert other_seed != first
    assert all(0 <= t <= EOS for t in first)
    assert isinstance(decode_tokens(first), str)
    with pytest.raises(ValueError):
        sample(torch.zeros(259), dataclasses.replace(sampler, method="beam"), 0)
