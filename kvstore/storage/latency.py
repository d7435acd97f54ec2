"""How long a tier's calls take, by operation (read, write, delete): a
histogram kept without a metrics library (the store is one too), read by
``/metrics`` as ``kvstore_tier_operation_duration_seconds``.

Recording is two clock reads, a bisect and two additions: it is on every
tier call, GETs from host memory included."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: Upper bounds, seconds: from a host-memory read (microseconds) to an S3
#: call past its retries.
BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

OPERATIONS = ("read", "write", "delete")


@dataclass(slots=True)
class Latency:
    """One operation's calls: how many fell in each bucket (the last: above
    every bound), and their total time."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total_s += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, calls at or below it), ``+Inf`` last."""
        out, running = [], 0
        for bound, count in zip([*map(repr, BUCKETS), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


def latencies() -> dict[str, Latency]:
    return {op: Latency() for op in OPERATIONS}
