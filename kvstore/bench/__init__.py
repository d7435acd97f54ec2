"""Benchmarks behind ``kvstore bench``.

A row is one of two kinds (STYLE: speed is shown, not asserted):

* a comparison: the value beside a baseline measured in the same run on the
  same work, as a ratio; its goal, if any, is a ratio;
* a plain figure: the value alone, when nothing measured in the run does the
  same work (a publish rate, a p99 latency); its goal, if any, is absolute,
  in the row's unit.

Each row knows which way is better (lower for latencies, higher for rates),
and ``LOW`` means exactly one thing: short of the row's stated goal. A row
without a goal is never judged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: Units where less is better unless a row says otherwise.
LOWER_IS_BETTER_UNITS = frozenset({"s", "ms", "us", "µs", "ns"})


@dataclass(frozen=True, slots=True)
class Result:
    """One measurement: beside a same-run baseline, or a plain figure.

    ``baseline_name`` and ``baseline`` come together (a comparison) or not at
    all (a plain figure); a baseline must be a positive, finite measurement,
    never a stand-in such as 0 or a goal. ``goal`` is a ratio for a comparison
    and an absolute figure, in ``unit``, for a plain one. ``direction`` says
    which way is better; by default lower for time units, higher otherwise.
    """

    name: str
    unit: str
    value: float
    baseline_name: str | None = None
    baseline: float | None = None
    goal: float | None = None
    direction: Literal["higher", "lower"] | None = None

    def __post_init__(self) -> None:
        if (self.baseline_name is None) != (self.baseline is None):
            raise ValueError(f"{self.name}: a baseline needs both its name and its figure")
        if self.baseline is not None and not (math.isfinite(self.baseline) and self.baseline > 0):
            raise ValueError(
                f"{self.name}: baseline {self.baseline_name!r} measured {self.baseline!r}; "
                "a baseline must be a positive measurement (else report a plain figure)"
            )
        if self.goal is not None and not math.isfinite(self.goal):
            raise ValueError(f"{self.name}: goal {self.goal!r} is not a number")

    @property
    def plain(self) -> bool:
        """True for a plain figure (no baseline)."""
        return self.baseline is None

    @property
    def lower_is_better(self) -> bool:
        if self.direction is not None:
            return self.direction == "lower"
        return self.unit in LOWER_IS_BETTER_UNITS

    @property
    def ratio(self) -> float | None:
        """value / baseline; None for a plain figure."""
        return None if self.baseline is None else self.value / self.baseline

    @property
    def met(self) -> bool | None:
        """Whether the goal is reached (the ratio's, or the plain value's); None without one."""
        if self.goal is None:
            return None
        figure = self.value if self.ratio is None else self.ratio
        return figure <= self.goal if self.lower_is_better else figure >= self.goal

    @property
    def goal_text(self) -> str:
        """The goal as stated: ``>= 0.8`` (a ratio), ``<= 10 ms`` (a plain figure)."""
        if self.goal is None:
            return ""
        text = f"{'<=' if self.lower_is_better else '>='} {self.goal:,g}"
        return text if self.ratio is not None else f"{text} {self.unit}"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "unit": self.unit,
            "value": self.value,
            "kind": "plain" if self.plain else "ratio",
            "baseline_name": self.baseline_name,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "goal": self.goal,
            "goal_of": None if self.goal is None else ("value" if self.plain else "ratio"),
            "lower_is_better": self.lower_is_better,
            "met": self.met,
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
    """The results as a table: a plain figure shows ``-`` for baseline and ratio."""
    width = max([len("benchmark"), *(len(r.name) for r in results)])
    goal_width = max([len("goal"), *(len(r.goal_text) for r in results)])
    lines = [
        f"{'benchmark':<{width}} {'value':>14} {'baseline':>14} {'ratio':>7}  "
        f"{'goal':<{goal_width}} {'':<3}  baseline is (unit)"
    ]
    for r in results:
        mark = {None: "", True: "ok", False: "LOW"}[r.met]
        better = ", lower is better" if r.lower_is_better else ""
        if r.baseline is None or r.ratio is None:
            baseline, ratio, what = "-", "-", f"plain figure ({r.unit}{better})"
        else:
            baseline, ratio = f"{r.baseline:,.3f}", f"{r.ratio:.2f}"
            what = f"{r.baseline_name} ({r.unit}{better})"
        lines.append(
            f"{r.name:<{width}} {r.value:>14,.3f} {baseline:>14} {ratio:>7}  "
            f"{r.goal_text:<{goal_width}} {mark:<3}  {what}"
        )
    return "\n".join(lines)
