"""Index state in Redis, for several IS processes behind one name (OPS3).

Per Block Key three keys, in one Redis Cluster slot through the
``{block key}`` hash tag, so the index partitions by block key:

* ``<prefix>{<key>}:z`` sorted set: holder id -> expiry (ms, Redis clock);
* ``<prefix>{<key>}:v`` hash: holder id -> scope id + compat id + the
  replica's shape JSON + ``\n`` + record JSON (JSON text holds no raw
  newline);
* ``<prefix>{<key>}:g`` hash: the live records joined as a lookup answers
  them (``r``), their shapes (``s``), their scope + compat ID (``k``) and
  the first expiry among them (``e``), rebuilt by every write of the key.

(An earlier layout kept ``:r`` hashes without shapes; they are ignored and
expire on their own.) Small Lua scripts keep each operation atomic on its
slot. All keys expire with their last record (PEXPIREAT), so abandoned
entries need no sweeper. A lookup is one round trip per batch of keys and
stops at the first miss (L1): on a single node one script walks the batch,
answering each key with its joined group (Lua would take longer to join a
whole batch than Python takes to receive it in pieces); with
``cluster=True`` (Redis Cluster: scripts may not span slots, and redis-py's
cluster pipelines take no scripts) the groups are read with a pipeline of
GETs and the scripts sent one per key, in parallel.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from redis import exceptions as redis_errors

from ..protocol.records import ReplicaRecord
from ..protocol.wire import role_id
from ..redis_client import ERRORS, connect
from ..storage.errors import TierUnavailable
from .state import Hits, IndexFull, record_octets

#: Lookup scripts sent at once on a cluster (one per block key).
CLUSTER_SCRIPTS_AT_ONCE = 64

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "

# Lua helpers. The group keys of a block key are named from KEYS[1]'s hash
# tag and the records' kind (scope id + compat id), so they are in the slot
# of the declared keys.
_GROUPS = """
local base = string.sub(KEYS[1], 1, -3)
local function kind_of(v) return v and string.sub(v, 1, 96) end

-- HMGET / HDEL of any number of fields (unpack() stops near 8000 values).
local function each_part(fields, fn)
  for i = 1, #fields, 1000 do fn(unpack(fields, i, math.min(i + 999, #fields))) end
end
local function hmget(key, fields)
  local out = {}
  each_part(fields, function(...)
    for _, v in ipairs(redis.call('HMGET', key, ...)) do out[#out + 1] = v end
  end)
  return out
end

-- The live records of one kind joined as "[s1,s2]\\n[r1,r2]" (false if none),
-- and the first expiry among them.
local function joined(zkey, vkey, kind)
  local live = redis.call('ZRANGEBYSCORE', zkey, '(' .. now, '+inf', 'WITHSCORES')
  if #live == 0 then return false end
  local holders, expiry = {}, {}
  for i = 1, #live, 2 do
    holders[#holders + 1] = live[i]
    expiry[live[i]] = tonumber(live[i + 1])
  end
  local values = hmget(vkey, holders)
  local records, shapes, first = {}, {}, nil
  for i, v in ipairs(values) do
    if v and string.sub(v, 1, 96) == kind then
      local nl = string.find(v, '\\n', 97, true)
      shapes[#shapes + 1] = string.sub(v, 97, nl - 1)
      records[#records + 1] = string.sub(v, nl + 1)
      local e = expiry[holders[i]]
      if first == nil or e < first then first = e end
    end
  end
  if #records == 0 then return false end
  return '[' .. table.concat(shapes, ',') .. ']\\n[' .. table.concat(records, ',') .. ']', first
end

-- After a write: rebuild the group of one kind, to vanish with its first
-- record. A record is live while its expiry > now, and Redis keeps a key
-- while now <= its PXAT: the group's PXAT is one millisecond earlier.
local function regroup(kind)
  local gkey = base .. ':g:' .. kind
  local value, first = joined(KEYS[1], KEYS[2], kind)
  if value then
    redis.call('SET', gkey, value, 'PXAT', first - 1)
  else
    redis.call('DEL', gkey)
  end
end
"""

_PUT = (
    _NOW
    + _GROUPS
    + """
local old = kind_of(redis.call('HGET', KEYS[2], ARGV[1]))
local expiry = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  -- (their groups expired with them)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  each_part(dead, function(...) redis.call('HDEL', KEYS[2], ...) end)
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
if last then
  redis.call('PEXPIREAT', KEYS[1], last)
  redis.call('PEXPIREAT', KEYS[2], last)
end
local new = kind_of(ARGV[3])
regroup(new)
if old and old ~= new then regroup(old) end
return 1
"""
)

# One block key (cluster mode) or a run of them (KEYS in pairs, one node):
# each key's group of kind ARGV[1], joined here when a record has expired
# since the last write; stops at the first key without one (L1).
_LOOKUP = (
    _NOW
    + _GROUPS
    + """
local out = {}
for i = 1, #KEYS, 2 do
  local value = redis.call('GET', string.sub(KEYS[i], 1, -3) .. ':g:' .. ARGV[1])
  if not value then
    value = joined(KEYS[i], KEYS[i + 1], ARGV[1])
    if not value then break end
  end
  out[#out + 1] = value
end
return out
"""
)

_DELETE = (
    _NOW
    + _GROUPS
    + """
local old = kind_of(redis.call('HGET', KEYS[2], ARGV[1]))
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if old then regroup(old) end
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
        self._client: Any = connect(url, cluster=cluster, timeout_s=timeout_s)
        self._put = self._client.register_script(_PUT)
        self._lookup = self._client.register_script(_LOOKUP)
        self._delete = self._client.register_script(_DELETE)
        self._count = self._client.register_script(_COUNT)
        self._scope = self._client.register_script(_SCOPE)

    def _keys(self, block_key: str) -> list[str]:
        base = f"{self.prefix}{{{block_key}}}"
        return [base + ":z", base + ":v"]

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except redis_errors.ResponseError as exc:
            if str(exc).startswith("OOM"):
                raise IndexFull(f"index Redis is out of memory: {exc}") from exc
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc
        except ERRORS as exc:
            raise TierUnavailable(f"index Redis at {self.url}: {exc}") from exc

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> None:
        raw, shape = record_octets(record)
        value = b"".join((record.scope_id.encode(), record.compat_id.encode(), shape, b"\n", raw))
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
        self,
        scope_id: str,
        compat_id: str,
        block_keys: Sequence[str],
        shapes: bool = False,
        records: bool = True,
    ) -> Hits:
        hits = Hits(shapes=[] if shapes else None)
        kind = scope_id + compat_id
        for start in range(0, len(block_keys), self.batch):
            chunk = block_keys[start : start + self.batch]
            # The joined groups the last writes left, straight from Redis.
            names = [f"{self.prefix}{{{block_key}}}:g:{kind}" for block_key in chunk]
            if self.cluster:
                async with self._client.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.get(name)
                    values = await self._call(pipe.execute())
            else:
                values = await self._call(self._client.mget(names))
            found = next((i for i, v in enumerate(values) if v is None), len(values))
            self._take(hits, values[:found], records)
            if found == len(chunk):
                continue
            # No group: no record, or one expired since the last write of the
            # key; the script joins what is left, stopping at the first miss.
            rest = chunk[found:]
            if self.cluster:
                answers = await self._call(self._lookup_each(rest, kind))
                values = [a[0] for a in itertools.takewhile(bool, answers)]
            else:
                keys = [k for block_key in rest for k in self._keys(block_key)]
                values = await self._call(self._lookup(keys=keys, args=[kind]))
            self._take(hits, values, records)
            if len(values) < len(rest):
                break  # L1: stop at the first key without a replica
        return hits

    async def _lookup_each(self, block_keys: Sequence[str], kind: str) -> list[Any]:
        """The lookup script per key, in parallel over the cluster's nodes
        (redis-py's cluster pipelines refuse scripts), at most
        :data:`CLUSTER_SCRIPTS_AT_ONCE` at a time. A master promoted since
        the script was loaded answers NOSCRIPT: the script object loads it
        there again and retries."""
        out: list[Any] = []
        for start in range(0, len(block_keys), CLUSTER_SCRIPTS_AT_ONCE):
            part = block_keys[start : start + CLUSTER_SCRIPTS_AT_ONCE]
            out += await asyncio.gather(
                *(self._lookup(keys=self._keys(k), args=[kind]) for k in part)
            )
            if not all(out):
                break  # L1: nothing after the first miss is needed
        return out

    @staticmethod
    def _take(hits: Hits, values: Sequence[bytes], records: bool) -> None:
        for value in values:
            newline = value.index(b"\n")
            if hits.shapes is not None:
                hits.shapes.append(value[:newline])
            if records:
                hits.chunks.append(memoryview(value)[newline + 1 :])
        hits.matched += len(values)

    async def count(self) -> int:
        total = 0
        async for key in self._client.scan_iter(match=self.prefix + "{*}:z", count=1000):
            base = key.decode()[:-2]
            total += int(await self._call(self._count(keys=[base + ":z"])))
        return total

    async def close(self) -> None:
        await self._client.aclose()
