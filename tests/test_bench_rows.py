"""``kvstore bench`` rows: every row is a comparison with a positive same-run
baseline or a plain figure; LOW means short of a stated goal, judged in the
row's direction. No servers; nothing here asserts on speed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstore.bench import Result, format_table
from kvstore.bench import controller as bench_controller
from kvstore.bench import index as bench_index
from kvstore.bench import soak as bench_soak


def _line(result: Result) -> str:
    return format_table([result]).splitlines()[1]


def _cells(result: Result) -> list[str]:
    """The cells after the name: value, baseline, ratio, then the rest."""
    return _line(result)[len(result.name) :].split()


def test_plain_figure_prints_no_ratio_and_judges_its_goal() -> None:
    slow = Result("lookup 8k keys, p99", "ms", 39.2, goal=10.0)
    assert slow.plain and slow.ratio is None and slow.lower_is_better
    cells = _cells(slow)
    assert cells[:3] == ["39.200", "-", "-"]
    assert "<= 10 ms LOW" in _line(slow)
    fast = Result("lookup 8k keys, p99", "ms", 4.5, goal=10.0)
    assert fast.met is True and "<= 10 ms ok" in _line(fast)
    rate = Result("placements", "placements/s", 94.4, goal=1000.0)
    assert not rate.lower_is_better and rate.met is False
    assert ">= 1,000 placements/s LOW" in _line(rate)
    assert "0.00" not in _line(rate)


def test_zero_or_missing_baseline_is_refused() -> None:
    for baseline in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive measurement"):
            Result("host put", "GB/s", 1.0, "dict put", baseline, 0.7)
    with pytest.raises(ValueError, match="both"):
        Result("publish", "records/s", 1.0, "(none)")
    with pytest.raises(ValueError, match="both"):
        Result("publish", "records/s", 1.0, baseline=3.0)


def test_low_only_with_a_goal() -> None:
    rows = [
        Result("status updates", "updates/s", 128_283.7),
        Result("placements, 1 at once", "placements/s", 102.1, "bare IS lookup", 153.0),
        Result("lookup p50", "ms", 55.7, "redis-py EXISTS pipeline p50", 46.1),
    ]
    for row in rows:
        assert row.met is None
        assert not {"ok", "LOW"} & set(_cells(row))
    table = format_table(rows)
    assert "LOW" not in table and " ok " not in table


def test_comparison_goal_is_a_ratio_in_the_rows_direction() -> None:
    higher = Result("host put", "GB/s", 0.3, "one sha256 pass", 0.5, goal=0.8)
    assert higher.ratio == pytest.approx(0.6) and higher.met is False
    assert _cells(higher)[:5] == ["0.300", "0.500", "0.60", ">=", "0.8"]
    assert "LOW" in _line(higher)
    # A latency ratio is better when small: 0.5 of the baseline's time meets 0.8.
    latency = Result("lookup p50", "ms", 10.0, "raw pipeline p50", 20.0, goal=0.8)
    assert latency.lower_is_better and latency.met is True
    assert "<= 0.8 ok" in _line(latency)
    assert Result("x", "ms", 30.0, "raw pipeline p50", 20.0, goal=0.8).met is False
    # A count (errors) is lower-is-better when the row says so.
    errors = Result("soak: errors", "count", 0.0, goal=0, direction="lower")
    assert errors.met is True and "<= 0 count ok" in _line(errors)
    assert Result("soak: errors", "count", 2.0, goal=0, direction="lower").met is False


def test_json_carries_the_kind_direction_and_judgement() -> None:
    plain = json.loads(json.dumps(Result("p99", "ms", 39.2, goal=10.0).to_json()))
    assert plain == {
        "name": "p99",
        "unit": "ms",
        "value": 39.2,
        "kind": "plain",
        "baseline_name": None,
        "baseline": None,
        "ratio": None,
        "goal": 10.0,
        "goal_of": "value",
        "lower_is_better": True,
        "met": False,
    }
    compared = Result("host put", "GB/s", 0.3, "one sha256 pass", 0.5, goal=0.8).to_json()
    assert compared["kind"] == "ratio" and compared["goal_of"] == "ratio"
    assert compared["ratio"] == pytest.approx(0.6) and compared["met"] is False
    bare = Result("status updates", "updates/s", 5.0).to_json()
    assert bare["goal_of"] is None and bare["met"] is None


def test_positional_comparison_still_builds() -> None:
    # The engines suite (its own virtualenv) builds rows positionally.
    row = Result("LMCache plug-in put", "MiB/s", 80.0, "kvstore.client put_block", 100.0)
    assert row.ratio == pytest.approx(0.8) and not row.plain and row.met is None


def _assert_rows_sound(rows: list[Result]) -> None:
    for row in rows:
        assert row.baseline is None or row.baseline > 0, row
        assert row.baseline_name not in ("(none)", "goal", "goal (ms)"), row
        if row.plain:
            assert row.ratio is None
    # Every row renders; none shows a ratio of 0.00.
    for line in format_table(rows).splitlines()[1:]:
        assert " 0.00 " not in line, line


def test_percentile_is_nearest_rank() -> None:
    assert bench_index.percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert bench_index.percentile([float(n) for n in range(1, 31)], 0.99) == 30.0
    assert bench_index.percentile([float(n) for n in range(1, 201)], 0.99) == 198.0
    assert bench_index.percentile([5.0], 0.5) == 5.0


def test_index_lookup_rows() -> None:
    latencies = [0.020, 0.030, 0.040]
    rows = bench_index.lookup_rows(
        "lookup 8k keys x3, redis",
        8192,
        latencies,
        {"redis-py EXISTS pipeline p50": 25.0, "raw HVALS pipeline, same records": 60.0},
        bench_index.SHARED_P99_GOAL_MS,
    )
    _assert_rows_sound(rows)
    by_name: dict[str, list[Result]] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    p50s = by_name["lookup 8k keys x3, redis, p50"]
    assert [r.baseline for r in p50s] == [25.0, 60.0]
    assert all(r.lower_is_better and r.goal is None for r in p50s)
    (p99,) = by_name["lookup 8k keys x3, redis, p99"]
    assert p99.plain and p99.value == pytest.approx(40.0) and p99.goal == 10.0
    assert p99.met is False
    (throughput,) = by_name["lookup 8k keys x3, redis, throughput"]
    assert throughput.plain and throughput.goal is None and not throughput.lower_is_better
    # No goal is stated for 1k keys; without Redis, p50 is a plain figure too.
    small = bench_index.lookup_rows("lookup 1k keys x3, memory", 1024, latencies, {})
    _assert_rows_sound(small)
    assert all(r.plain and r.goal is None for r in small)
    # In memory the goal is tighter (issue 20): 5 ms, where shared state has 10.
    memory = bench_index.lookup_rows("lookup 8k keys x3, memory", 8192, latencies, {})
    assert [r.goal for r in memory if r.name.endswith("p99")] == [5.0]


async def test_index_memory_state_rows_in_process() -> None:
    from kvstore.index.state import MemoryState

    rows = await bench_index._bench_state("memory", MemoryState(), None, [1024], 2)
    _assert_rows_sound(rows)
    assert [r.name for r in rows] == [
        "publish, memory state, 16 at once",
        "lookup 1k keys x3, memory, the first after publishing",
        "lookup 1k keys x3, memory, p50",
        "lookup 1k keys x3, memory, p99",
        "lookup 1k keys x3, memory, throughput",
        "lookup 1k keys x3, memory, shapes only, p50",
        "lookup 1k keys x3, memory, shapes only, p99",
        "lookup 1k keys x3, memory, shapes only, throughput",
    ]
    assert all(r.plain for r in rows)


def test_controller_placement_rows() -> None:
    rows = bench_controller.placement_rows(512, 150.0, {1: 100.0, 4: 90.0})
    _assert_rows_sound(rows)
    compared = [r for r in rows if not r.plain]
    assert [r.value for r in compared] == [100.0, 90.0]
    assert all(r.baseline == 150.0 and r.goal is None for r in compared)
    (goal,) = [r for r in rows if r.plain]
    assert goal.name == "placements, 512-key prompts, 64 instances, 4 at once"
    assert goal.value == 90.0 and goal.goal == 1000.0 and goal.met is False


def _report(**fields: Any) -> bench_soak.SoakReport:
    report = bench_soak.SoakReport(seconds=10.0, clients=8, **fields)
    report.latencies = {"put": [0.010, 0.020, 0.030], "get": [0.001, 0.002]}
    return report


def test_soak_rows() -> None:
    report = _report(
        operations=1000,
        first_tenth_ops=100,
        acknowledged=300,
        lost=["7: altered"],
        rss=[(0.0, 50 << 20), (1.0, 60 << 20)],
    )
    rows = bench_soak.report_rows(report, 10.0, 8)
    _assert_rows_sound(rows)
    named = {r.name: r for r in rows}
    assert named["soak: operations/s, 8 clients, 10 s"].ratio == pytest.approx(1.0)
    assert named["soak: errors"].met is True
    assert named["soak: acknowledged blocks lost, of 300"].met is False
    rss = named["soak: peak holder RssAnon (goal: host tier + overhead)"]
    assert rss.plain and rss.value == 60 and rss.goal == report.bound_octets / 2**20
    assert rss.met is True
    assert named["soak: put p99"].baseline_name == "put p50"
    assert "soak: lease p99" not in named  # none done: no row
    # Nothing done in the first tenth: the rate stands alone.
    idle = bench_soak.report_rows(_report(operations=10), 10.0, 8)
    assert idle[0].plain and idle[0].goal is None


async def test_store_host_rows_compare_work_that_moves_the_octets() -> None:
    from kvstore.bench import store as bench_store

    rows = await bench_store.bench_host(bench_store._blocks(2, 64 << 10), 1)
    _assert_rows_sound(rows)
    assert [(r.name, r.baseline_name) for r in rows] == [
        ("host put", "one sha256 pass"),
        ("host get", "dict get, same copy out"),
    ]


async def test_store_lmdb_rows_separate_tier_movement_from_a_puts_obligations() -> None:
    from kvstore.bench import store as bench_store

    rows = await bench_store.bench_lmdb(bench_store._blocks(2, 64 << 10), 1)
    _assert_rows_sound(rows)
    names = {r.name: r.baseline_name for r in rows}
    # Tier movement (a demotion's write, a read back through the loader)
    # against the raw client, beside the store's own put and get.
    assert names["local-storage (LMDB) demotion"] == "raw lmdb put"
    assert names["local-storage (LMDB) read back"] == "raw lmdb get"
    assert names["local-storage (LMDB) put"] == "raw lmdb put"


def test_load_rows_compare_each_chain_with_host_only_at_the_same_c() -> None:
    from kvstore.bench.load import CHAINS, Run, _rows

    runs = {}
    for chain, rate in zip(CHAINS, (100.0, 85.0, 70.0, 40.0), strict=True):
        for clients, factor in ((1, 0.5), (16, 1.0)):
            run = Run(chain, clients, 10.0, operations=int(rate * factor * 10))
            run.latencies = {"put": [0.02, 0.03 * factor], "hot-get": [0.01, 0.01 * factor]}
            runs[(chain, clients)] = run
    runs[("host+lmdb+s3", 16)].errors.append("get 3: 500")
    for clients, cpu in ((1, 1.0), (16, 4.0)):
        runs[("host", clients)].cpu_s = cpu
        runs[("bare", clients)] = Run("bare", clients, 10.0, operations=1000, cpu_s=1.0)
    rows = {r.name: r for r in _rows(runs, (1, 16))}
    cpu = rows["host, C=16: holder CPU per op"]  # 4 s / 1,000 ops against 1 s / 1,000
    assert cpu.baseline_name == "bare uvicorn, same traffic" and cpu.lower_is_better
    assert cpu.ratio == pytest.approx(4.0) and cpu.goal == 1.5 and cpu.met is False
    assert rows["host, C=1: holder CPU per op"].goal is None
    assert rows["host, C=16: ops/s"].plain  # the baseline itself
    lmdb = rows["host+lmdb, C=16: ops/s"]
    assert lmdb.baseline == 100.0 and lmdb.goal == 0.8 and lmdb.met is True
    s3 = rows["host+lmdb+s3, C=16: ops/s"]
    assert s3.goal == 0.5 and s3.met is False  # 0.4 of host only
    assert rows["host+lmdb+s3, C=16: errors"].met is False  # errors are reported, judged
    assert rows["host+lmdb, C=1: ops/s"].goal is None  # goals are for C=16
    hot = rows["host+lmdb, C=16: hot-get p99"]
    assert hot.lower_is_better and hot.goal == 2.0 and hot.met is True
    assert rows["host+lmdb: C=16 ops/s"].ratio == 2.0 and rows["host+lmdb: C=16 ops/s"].goal == 1.5
    assert all(r.plain or r.baseline for r in rows.values())
