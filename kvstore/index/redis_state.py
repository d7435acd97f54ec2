"""Index state in Redis, for several IS processes behind one name (OPS3).

Per Block Key two keys, in one Redis Cluster slot through the ``{block key}``
hash tag, so the index partitions by block key:

* ``<prefix>{<key>}:z`` sorted set: holder id -> expiry (ms, Redis clock);
* ``<prefix>{<key>}:r`` hash: holder id -> scope id + compat id + record JSON.

Small Lua scripts keep each operation atomic on its slot. Both keys expire
with their last record (PEXPIREAT), so abandoned entries need no sweeper.
A lookup is one round trip per batch of keys and stops at the first miss
(L1): on a single node one script walks the batch; with ``cluster=True``
(scripts may not span slots) one script per key is pipelined.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from ..protocol.problems import TierUnavailable
from ..protocol.records import ReplicaRecord
from ..protocol.wire import role_id
from .state import IndexFull

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "

_PUT = (
    _NOW
    + """
local expiry = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(dead))
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
if last then
  redis.call('PEXPIREAT', KEYS[1], last)
  redis.call('PEXPIREAT', KEYS[2], last)
end
return 1
"""
)

_LOOKUP = (
    _NOW
    + """
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #live == 0 then return {} end
local values = redis.call('HMGET', KEYS[2], unpack(live))
local out = {}
for _, v in ipairs(values) do
  if v and string.sub(v, 1, 96) == ARGV[1] then out[#out + 1] = string.sub(v, 97) end
end
return out
"""
)

# Single-node Redis: a whole batch in one script, stopping at the first miss
# inside Redis. (Redis Cluster refuses scripts over keys of several slots,
# so cluster mode pipelines _LOOKUP per key instead.)
_LOOKUP_BATCH = (
    _NOW
    + """
local out = {}
for i = 1, #KEYS, 2 do
  local live = redis.call('ZRANGEBYSCORE', KEYS[i], '(' .. now, '+inf')
  if #live == 0 then return out end
  local values = redis.call('HMGET', KEYS[i + 1], unpack(live))
  local group = {}
  for _, v in ipairs(values) do
    if v and string.sub(v, 1, 96) == ARGV[1] then group[#group + 1] = string.sub(v, 97) end
  end
  if #group == 0 then return out end
  out[#out + 1] = group
end
return out
"""
)

_DELETE = (
    _NOW
    + """
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if expiry and tonumber(expiry) > now then return 1 end
return 0
"""
)

_SCOPE = (
    _NOW
    + """
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then return false end
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v then return false end
return string.sub(v, 1, 32)
"""
)

_COUNT = _NOW + "return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')"


class RedisState:
    """The IndexState contract on Redis (or Redis Cluster key layout)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvsp-index:",
        batch: int = 512,
        timeout_s: float = 5.0,
        cluster: bool = False,
    ) -> None:
        self.url = url
        self.cluster = cluster
        self.prefix = prefix
        self.batch = batch
        self._client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._put = self._client.register_script(_PUT)
        self._lookup = self._client.register_script(_LOOKUP)
        self._lookup_batch = self._client.register_script(_LOOKUP_BATCH)
        self._delete = self._client.register_script(_DELETE)
        self._count = self._client.register_script(_COUNT)
        self._scope = self._client.register_script(_SCOPE)

    def _keys(self, block_key: str) -> list[str]:
        base = f"{self.prefix}{{{block_key}}}"
        return [base + ":z", base + ":r"]

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except redis_errors.ResponseError as exc:
            if str(exc).startswith("OOM"):
                raise IndexFull(f"index Redis is out of memory: {exc}") from exc
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        except (redis_errors.RedisError, OSError) as exc:
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        value = (
            record.scope_id + record.compat_id + json.dumps(record.to_json(), separators=(",", ":"))
        )
        await self._call(
            self._put(
                keys=self._keys(record.block_key), args=[role_id(record.holder), ttl_ms, value]
            )
        )

    async def scope_of(self, holder_id: str, block_key: str) -> str | None:
        found = await self._call(self._scope(keys=self._keys(block_key), args=[holder_id]))
        return None if found is None else bytes(found).decode()

    async def delete(self, holder_id: str, block_key: str) -> bool:
        removed = await self._call(self._delete(keys=self._keys(block_key), args=[holder_id]))
        return bool(removed)

    async def lookup(
        self, scope_id: str, compat_id: str, block_keys: Sequence[str]
    ) -> list[list[bytes]]:
        matched: list[list[bytes]] = []
        wanted = scope_id + compat_id
        if not self.cluster:
            for start in range(0, len(block_keys), self.batch):
                chunk = block_keys[start : start + self.batch]
                keys = [k for block_key in chunk for k in self._keys(block_key)]
                found = await self._call(self._lookup_batch(keys=keys, args=[wanted]))
                matched.extend(list(group) for group in found)
                if len(found) < len(chunk):
                    break  # L1: the script stopped at the first miss
            return matched
        for start in range(0, len(block_keys), self.batch):
            async with self._client.pipeline(transaction=False) as pipe:
                for block_key in block_keys[start : start + self.batch]:
                    await self._lookup(keys=self._keys(block_key), args=[wanted], client=pipe)
                results = await self._call(pipe.execute())
            for found in results:
                if not found:
                    return matched  # L1: stop at the first key without a replica
                matched.append(list(found))
        return matched

    async def count(self) -> int:
        total = 0
        async for key in self._client.scan_iter(match=self.prefix + "{*}:z", count=1000):
            base = key.decode()[:-2]
            total += int(await self._call(self._count(keys=[base + ":z", base + ":r"])))
        return total

    async def close(self) -> None:
        await self._client.aclose()
