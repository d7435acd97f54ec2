"""Benchmarks behind ``kvstore bench``: each result is printed beside a baseline
measured in the same run, as a ratio (STYLE: speed is shown, not asserted)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Result:
    """One measurement and the baseline it is compared with."""

    name: str
    unit: str
    value: float
    baseline_name: str
    baseline: float
    goal: float | None = None

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "unit": self.unit,
            "value": self.value,
            "baseline_name": self.baseline_name,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "goal": self.goal,
        }


def best_seconds(fn: Callable[[], object], *, repeat: int, number: int = 1) -> float:
    """Fastest of ``repeat`` runs of ``number`` calls, per call (timeit's rule: the
    minimum is the run least disturbed by the rest of the machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def format_table(results: list[Result]) -> str:
    lines = [
        f"{'benchmark':<44} {'value':>12} {'baseline':>12}  {'ratio':>6}  goal  baseline is",
    ]
    for r in results:
        goal = f">={r.goal:.1f}" if r.goal is not None else ""
        mark = "" if r.goal is None else (" ok" if r.ratio >= r.goal else " LOW")
        lines.append(
            f"{r.name:<44} {r.value:>12,.3f} {r.baseline:>12,.3f}  {r.ratio:>6.2f}  "
            f"{goal:<5}{mark}  {r.baseline_name} ({r.unit})"
        )
    return "\n".join(lines)
