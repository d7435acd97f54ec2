"""The bounded soak (issue 9): 30 s of mixed PUT/GET/lease traffic from 8
clients against a holder process whose host tier overflows into LMDB all
along: zero errors, zero acknowledged blocks lost, and the holder's
resident memory within its host tier plus a fixed overhead, growing in
the last third only by the metadata of the blocks added."""

from __future__ import annotations

import pytest

from kvstore.bench.soak import BLOCK_SECTION, HOST_OCTETS, soak

pytestmark = pytest.mark.timeout(180)


async def test_thirty_seconds_of_mixed_traffic_lose_nothing() -> None:
    report = await soak(seconds=30, clients=8)
    assert report.errors == [], report.errors[:5]
    assert report.lost == [], report.lost[:5]
    written = report.acknowledged * 16 * BLOCK_SECTION
    assert written > 4 * HOST_OCTETS, "too little traffic to evict under pressure"
    assert len(report.rss) >= 30 and 0 < report.peak_rss <= report.bound_octets, (
        report.peak_rss,
        report.bound_octets,
    )
    assert {"put", "get", "lease"} <= set(report.latencies)
    # No leak: what grows in the last third of the run is only the index
    # of the blocks still being added (every acknowledged block is kept, in
    # LMDB; about 4 KiB of metadata each, measured over 150 s: 6,857 blocks,
    # +26 MiB). Medians of each third, so that a burst of allocations in
    # flight is not read as growth: at most 8 KiB a block added on top of
    # the middle third's, plus 8 MiB of allocator slack.
    import statistics

    third = len(report.rss) // 3
    middle = statistics.median(r for _, r in report.rss[third : 2 * third])
    last = statistics.median(r for _, r in report.rss[2 * third :])
    assert last <= middle + (8 << 20) + 8192 * report.acknowledged // 3, (middle, last)
