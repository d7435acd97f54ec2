"""``kvstore bench engines --quick`` runs (issue 10): every plug-in round
trip comes back equal (the benchmark asserts it) and each result has its
same-run baseline. Speed itself is reported, not asserted."""

from __future__ import annotations

from kvstore.bench import engines


def test_the_engines_benchmark_runs_against_its_baseline() -> None:
    results = engines.run(quick=True)
    assert [r.name.split(",")[0] for r in results] == [
        "LMCache plug-in put",
        "LMCache plug-in get",
        "LMCache MP L2 adapter store",
        "LMCache MP L2 adapter lookup+lock",
        "SGLang batch_set_v1",
        "SGLang batch_get_v1",
    ]
    for result in results:
        assert result.value > 0 and result.baseline > 0 and result.unit == "MiB/s"
        assert result.baseline_name.startswith("kvstore.client")
