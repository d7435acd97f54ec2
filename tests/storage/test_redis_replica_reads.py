"""The remote-memory tier reading a Redis Cluster's replicas (issue 20):
reads reach the replicas, and what a replica lacks is read at its master,
so a lagging replica is never taken for a lost segment (LE4)."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from typing import Any

import pytest

from kvstore.backends.redis import RedisTier
from kvstore.bench.redis_cluster import RedisCluster
from kvstore.redis_client import connect

from ..conftest import RedisServer


def _replica_gets(cluster: RedisCluster) -> int:
    """GETs served so far by the nodes that are replicas now."""
    total = 0
    for port in cluster.live():
        if "role:slave" not in cluster.cli(port, "INFO", "replication"):
            continue
        for line in cluster.cli(port, "INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_get:"):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


async def _replicas_listed(cluster: RedisCluster, tier: RedisTier) -> None:
    """Until every master has written something, Redis leaves its replica
    out of CLUSTER SLOTS (a replica at offset 0 is not available), and a
    client's map, read at its first command, names masters only."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        await tier.put(os.urandom(32).hex() + "/0-0", b"warm")
        slots = cluster.cli(cluster.live()[0], "CLUSTER", "SLOTS")
        if len(re.findall(r"^[0-9a-f]{40}$", slots, re.M)) == 6:
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the replicas never appeared in CLUSTER SLOTS")


async def test_reads_go_to_replicas_and_never_miss_what_was_written(
    redis_cluster: RedisCluster,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    writer = RedisTier(url=redis_cluster.url, prefix=prefix, cluster=True)
    await _replicas_listed(redis_cluster, writer)
    await writer.close()
    tier = RedisTier(url=redis_cluster.url, prefix=prefix, cluster=True, replica_reads=True)
    values = {os.urandom(32).hex() + "/0-3": os.urandom(1000) for _ in range(150)}
    try:
        before = _replica_gets(redis_cluster)
        for key, value in values.items():
            # Read at once after the write: a replica may not have it yet.
            await tier.put(key, value)
            assert await tier.get(key) == value
        assert await tier.get_many(list(values)) == list(values.values())
        assert await tier.get(os.urandom(32).hex() + "/0-3") is None
        assert _replica_gets(redis_cluster) > before  # the replicas served reads
    finally:
        async for key in tier.keys():
            await tier.delete(key)
        await tier.close()


async def test_what_a_lagging_replica_lacks_is_read_at_the_master(
    redis_cluster: RedisCluster, redis_server: RedisServer
) -> None:
    # The replica reads of this tier go to a Redis that has none of its
    # keys (a replica that lags every write); every read still finds them.
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    tier = RedisTier(url=redis_cluster.url, prefix=prefix, cluster=True, replica_reads=True)
    await tier._reader.aclose()
    lagging: Any = connect(redis_server.url)
    tier._reader = lagging
    try:
        keys = [os.urandom(32).hex() + "/0-31" for _ in range(20)]
        for n, key in enumerate(keys):
            await tier.put(key, b"v%d" % n)
        assert await tier.get(keys[3]) == b"v3"
        got = await tier.get_many([keys[0], "f" * 64 + "/0-31", keys[7]])
        assert got == [b"v0", None, b"v7"]
        assert await lagging.keys(prefix + "*") == []  # it was asked, and had none of them
    finally:
        for key in keys:
            await tier.delete(key)
        await tier.close()


def test_replica_reads_need_a_cluster() -> None:
    with pytest.raises(ValueError, match="cluster"):
        RedisTier(replica_reads=True)
    with pytest.raises(ValueError, match="true or false"):
        RedisTier(cluster=True, replica_reads="yes")  # type: ignore[arg-type]
