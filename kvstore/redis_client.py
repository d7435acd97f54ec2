"""How every Redis user here connects: the remote-memory tier
(``kvstore/backends/redis.py``), the IS state (``index/redis_state.py``) and the PC
state (``controller/redis_state.py``).

``cluster=False``: one node, redis-py's asyncio client (``redis://``,
``rediss://`` for TLS). ``cluster=True``: Redis Cluster through redis-py's
cluster client. The URL names any one node; the client reads the slot map
from it, follows MOVED and ASK redirections, and reloads the map when a node
stops answering, so a replica promoted after a master fails is found
without a restart. Every key layout here puts what one operation touches in
one slot (hash tags), so no command or script spans nodes.

What a failover can lose is in docs/storage.md ("Redis Cluster"): Redis
replicates asynchronously, so writes acknowledged by a master just before
it died may be missing on the replica that takes over.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisClusterException, RedisError

#: What a call into redis-py raises when Redis cannot answer: the cluster
#: client's own errors (a slot no master serves) are not RedisErrors.
ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)

#: Attempts of one command against a cluster whose map is changing (a
#: failover): each one after a map reload and a short backoff.
CLUSTER_RETRIES = 3


def connect(url: str, *, cluster: bool = False, timeout_s: float = 5.0, **options: Any) -> Any:
    """A redis-py asyncio client for ``url``: a single node's, or with
    ``cluster`` a Redis Cluster's. ``options`` go to redis-py."""
    if not isinstance(cluster, bool):
        raise ValueError("cluster: true or false")
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not cluster:
        import redis.asyncio as aioredis

        return aioredis.Redis.from_url(url, **common, **options)
    from urllib.parse import urlsplit

    from redis.asyncio.cluster import RedisCluster
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    if urlsplit(url).path not in ("", "/", "/0"):
        raise ValueError(f"{url}: a Redis Cluster has database 0 only")
    return RedisCluster.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), CLUSTER_RETRIES),
        # Serve the slots that have a master while another's failover runs.
        require_full_coverage=False,
        **common,
        **options,
    )


async def server_time(client: Any, key: str, *, cluster: bool) -> float:
    """The clock (``TIME``, in seconds) of the node that serves ``key``: on
    one node its own; on a cluster the master of the key's slot (TIME names
    no key, and cluster pipelines refuse it). Redis errors pass through."""
    if cluster:
        await client.initialize()  # the slot map, once
        node = client.get_node_from_key(key)
        seconds, micros = await client.execute_command("TIME", target_nodes=node)
    else:
        seconds, micros = await client.time()
    return int(seconds) + int(micros) / 1e6
