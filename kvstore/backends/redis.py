"""``remote-memory`` tier: Redis through redis-py's asyncio client, or with
``cluster = true`` its Redis Cluster client (:mod:`kvstore.redis_client`).

With ``replica_reads = true`` (a cluster only) reads go to the masters'
replicas, and a segment a replica does not have is read again at its master:
replication is asynchronous, so a replica can lag a write the store has
acknowledged, and a miss there must not be taken for a lost segment (the
store would drop the block, LE4). A lagging replica cannot answer other
octets: a key is written once, with the same block's layers.

Keys are ``{prefix}{<block key>}/<rest>``: the Block Key in braces is a Redis
Cluster hash tag, so every segment of a block lives in one slot and a
pipeline over them stays on one node. ``rediss://`` URLs give TLS.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, cast

from redis import exceptions as redis_errors

from kvstore.protocol._bytes import BytesLike
from kvstore.redis_client import ERRORS, connect
from kvstore.storage.errors import TierFull, TierUnavailable
from kvstore.storage.owner import stale
from kvstore.storage.tier import StorageInUse, Tier

_PREFIX = re.compile(r"[A-Za-z0-9:_.-]*")

# One owner per prefix: taken if free, kept if ours (its TTL renewed), or
# taken over from ARGV[2], a stale owner's record (kvstore.storage.owner.stale)
# if it is still that one; else the owner's name comes back. One script, so
# no other holder comes between the read and the write.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] or held == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return ARGV[1]
end
return held
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    # STYLE 6: redis-py's exceptions stop here.
    try:
        yield
    except redis_errors.ResponseError as exc:
        if str(exc).startswith("OOM"):
            raise TierFull(f"Redis at {url} is out of memory: {exc}") from exc
        raise TierUnavailable(f"Redis at {url}: {exc}", tier="remote-memory") from exc
    except ERRORS as exc:
        raise TierUnavailable(f"Redis at {url}: {exc}", tier="remote-memory") from exc


class RedisTier(Tier):
    kind = "remote-memory"
    persistent = True
    deadline_s = 2.0  # remote memory: well over a round trip and a 64 MiB value

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvstore:",
        read_mbit_per_s: float | None = None,
        timeout_s: float = 5.0,
        cluster: bool = False,
        replica_reads: bool = False,
        **options: Any,
    ) -> None:
        if not _PREFIX.fullmatch(prefix):
            raise ValueError("Redis key prefix may hold only letters, digits and ':_.-'")
        if not isinstance(replica_reads, bool):
            raise ValueError("replica_reads: true or false")
        if replica_reads and not cluster:
            raise ValueError("replica_reads: a Redis Cluster's option (cluster = true)")
        self.url = url
        self.prefix = prefix
        self.read_mbit_per_s = read_mbit_per_s
        self.cluster = cluster
        self._client: Any = connect(url, cluster=cluster, timeout_s=timeout_s, **options)
        #: Where GETs go first: the same client, or one that reads replicas.
        self._reader: Any = self._client
        if replica_reads:
            from redis.cluster import LoadBalancingStrategy

            # A slot without a replica is read at its master.
            self._reader = connect(
                url,
                cluster=True,
                timeout_s=timeout_s,
                load_balancing_strategy=LoadBalancingStrategy.RANDOM_REPLICA,
                **options,
            )

    def _key(self, key: str) -> str:
        return f"{self.prefix}{{{key[:64]}}}{key[64:]}"

    def _unkey(self, stored: bytes) -> str:
        text = stored.decode()[len(self.prefix) :]
        return text[1:65] + text[66:]

    async def claim(self, owner: str, ttl_s: float) -> None:
        """``<prefix>owner``, set if absent with a TTL this holder renews, so
        that a crashed owner's prefix frees itself after ``ttl_s``."""
        held = await self._claim(owner, "", ttl_s)
        if held != owner and stale(held):
            held = await self._claim(owner, held, ttl_s)  # a crashed holder of this host
        if held != owner:
            raise StorageInUse(
                f"{self.url} prefix {self.prefix!r} is in use by {held} "
                f"(free {ttl_s:g} s after that holder stops)"
            )

    async def _claim(self, owner: str, stale_owner: str, ttl_s: float) -> str:
        with _translated(self.url):
            held = await self._client.eval(
                _CLAIM, 1, self.prefix + "owner", owner, stale_owner, max(1, int(ttl_s * 1000))
            )
        return held.decode(errors="replace") if isinstance(held, bytes) else str(held)

    async def release(self, owner: str) -> None:
        with _translated(self.url):
            await self._client.eval(_RELEASE, 1, self.prefix + "owner", owner)

    async def get(self, key: str) -> BytesLike | None:
        with _translated(self.url):
            value: Any = await self._reader.get(self._key(key))
            if value is None and self._reader is not self._client:
                value = await self._client.get(self._key(key))  # a lagging replica
            return cast(bytes | None, value)

    async def put(self, key: str, value: BytesLike) -> None:
        with _translated(self.url):
            await self._client.set(self._key(key), bytes(value))

    async def delete(self, key: str) -> None:
        with _translated(self.url):
            await self._client.delete(self._key(key))

    async def keys(self) -> AsyncIterator[str]:
        with _translated(self.url):
            async for stored in self._client.scan_iter(match=self.prefix + "{*", count=1000):
                yield self._unkey(stored)

    async def sized_keys(self) -> AsyncIterator[tuple[str, int | None]]:
        batch: list[str] = []
        async for key in self.keys():
            batch.append(key)
            if len(batch) == 1000:
                for pair in await self._sizes(batch):
                    yield pair
                batch = []
        if batch:
            for pair in await self._sizes(batch):
                yield pair

    async def _sizes(self, keys: list[str]) -> list[tuple[str, int | None]]:
        """STRLEN of ``keys`` in one pipeline; a key gone meanwhile (0): None."""
        with _translated(self.url):
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.strlen(self._key(key))
                sizes = await pipe.execute()
        return [(key, int(size) or None) for key, size in zip(keys, sizes, strict=True)]

    async def get_many(self, keys: Sequence[str]) -> list[BytesLike | None]:
        with _translated(self.url):
            values = await self._get_all(self._reader, keys)
            if self._reader is not self._client and None in values:
                # What lagging replicas did not have, from the masters.
                missing = [i for i, v in enumerate(values) if v is None]
                again = await self._get_all(self._client, [keys[i] for i in missing])
                for i, value in zip(missing, again, strict=True):
                    values[i] = value
            return values

    async def _get_all(self, client: Any, keys: Sequence[str]) -> list[BytesLike | None]:
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(self._key(key))
            values: list[BytesLike | None] = await pipe.execute()
            return values

    async def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> None:
        with _translated(self.url):
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in items:
                    pipe.set(self._key(key), bytes(value))
                await pipe.execute()

    async def delete_many(self, keys: Iterable[str]) -> None:
        with _translated(self.url):
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.delete(self._key(key))
                await pipe.execute()

    async def close(self) -> None:
        if self._reader is not self._client:
            await self._reader.aclose()
        await self._client.aclose()
