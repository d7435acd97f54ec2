"""Controller state in Redis: a restarted or second PC continues, and an
Index Service in another process reads the instances' status (L2, PL1).

Keys, all in one Redis Cluster slot (the ``{pc}`` hash tag: the PC's state
is small, and one slot keeps every change a single-slot script):

* ``<prefix>{pc}:instances`` hash: instance URI -> entry JSON (status
  record, expiry, highest epoch, lifecycle state, idle since);
* ``<prefix>{pc}:sessions`` hash: session id -> entry JSON (epoch, owner,
  latest checkpoint);
* ``<prefix>{pc}:owner:<instance id>`` set: the sessions an instance owns;
* ``<prefix>{pc}:ended:<session>``: a session that ended, kept ``ended_ttl_s``
  (Redis expiry) so that its old owner cannot start it again;
* ``<prefix>{pc}:maps`` hash: map id -> shard map and reshard in progress.

Times are the Redis server's clock (``TIME``), the one clock every PC and
IS process sharing the state agrees on. Each change reads the entry, applies
the rule in Python (:mod:`.rules`, the same code as the memory state) and
writes it back with a compare-and-set script, retried when another process
changed the entry in between.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ..protocol.wire import role_id
from ..redis_client import ERRORS, connect, server_time
from ..storage.errors import TierUnavailable
from .rules import InstanceEntry, MapEntry, SessionEntry
from .state import ControllerState, InstanceChange, MapChange, SessionChange

# KEYS[1] hash; ARGV: field, expected value ("" for none), new value.
_SWAP = """
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# KEYS: sessions hash, old owner's set, new owner's set, the session's
# tombstone; ARGV: session, expected ("" for none), new value, max sessions,
# max per owner. -> 1 done, 0 changed meanwhile, -1 too many sessions, -2
# owner at its maximum, -3 the session ended.
_SWAP_SESSION = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if current ~= ARGV[2] then return 0 end
if current == '' and redis.call('EXISTS', KEYS[4]) == 1 then return -3 end
if current == '' and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then return -1 end
if current == '' or KEYS[2] ~= KEYS[3] then
  if redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[5]) then return -2 end
  if current ~= '' then redis.call('SREM', KEYS[2], ARGV[1]) end
  redis.call('SADD', KEYS[3], ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


# KEYS: sessions hash, the owner's set, the session's tombstone; ARGV:
# session, expected value, how long the tombstone stays (ms).
_DROP_SESSION = """
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
return 1
"""


def _dump(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class RedisControllerState(ControllerState):
    """The controller state on a Redis shared by PC and IS processes."""

    #: Attempts of one change against concurrent writers before giving up.
    retries = 32

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvsp-pc:",
        timeout_s: float = 5.0,
        clock: Callable[[], float] | None = None,
        cluster: bool = False,
        **rules: Any,
    ) -> None:
        """``clock``: tests only, instead of the Redis server's clock.
        ``cluster``: Redis Cluster (every key in the ``{pc}`` slot)."""
        super().__init__(**rules)
        self.url = url
        self._clock = clock
        tag = f"{prefix}{{pc}}:"
        self._instances_key = tag + "instances"
        self._sessions_key = tag + "sessions"
        self._maps_key = tag + "maps"
        self._owner_prefix = tag + "owner:"
        self._ended_prefix = tag + "ended:"
        self._client: Any = connect(url, cluster=cluster, timeout_s=timeout_s)
        self._cluster = cluster
        self._swap = self._client.register_script(_SWAP)
        self._swap_session = self._client.register_script(_SWAP_SESSION)
        self._drop = self._client.register_script(_DROP_SESSION)
        #: Parsed entries by their JSON: placements between two reports of an
        #: instance read its entry without validating the record again.
        self._parsed: dict[bytes, InstanceEntry] = {}

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except ERRORS as exc:
            raise TierUnavailable(f"controller Redis at {self.url}: {exc}") from exc

    def _now(self, time_reply: Any) -> float:
        if self._clock is not None:
            return self._clock()
        seconds, micros = time_reply
        return int(seconds) + int(micros) / 1e6

    def _entry(self, raw: bytes | None) -> InstanceEntry | None:
        if raw is None:
            return None
        entry = self._parsed.get(raw)
        if entry is None:
            if len(self._parsed) > 4096:
                self._parsed.clear()  # bounded: entries change with every report
            entry = self._parsed[raw] = InstanceEntry.from_json(json.loads(raw))
        return entry

    async def now(self) -> float:
        return self._now(None if self._clock is not None else await self._call(self._client.time()))

    async def _with_time(self, command: str, *args: Any) -> tuple[Any, float]:
        """``command`` on the state's keys and the clock, in one round trip:
        a pipeline on one node; on a cluster (whose pipelines refuse TIME)
        the two at once, TIME from the master of the ``{pc}`` slot."""
        if self._cluster:
            got, seconds = await self._call(
                asyncio.gather(
                    self._client.execute_command(command, *args),
                    server_time(self._client, self._instances_key, cluster=True),
                )
            )
            return got, self._clock() if self._clock is not None else seconds
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.execute_command(command, *args)
            pipe.time()
            got, now = await self._call(pipe.execute())
        return got, self._now(now)

    async def _read(self, key: str, field: str) -> tuple[bytes | None, float]:
        """A hash field and the clock, in one round trip."""
        raw, now = await self._with_time("HGET", key, field)
        return raw, now

    async def _instance(self, instance: str) -> tuple[InstanceEntry | None, float]:
        raw, now = await self._read(self._instances_key, instance)
        return self._entry(raw), now

    async def _instances(self) -> tuple[list[InstanceEntry], float]:
        values, now = await self._with_time("HVALS", self._instances_key)
        entries = [self._entry(raw) for raw in values]
        return [e for e in entries if e is not None], now

    async def _change_instance(self, instance: str, change: InstanceChange) -> InstanceEntry:
        for _ in range(self.retries):
            raw, now = await self._read(self._instances_key, instance)
            entry = change(self._entry(raw), now)
            swap: list[bytes | str] = [instance, raw or b"", _dump(entry.to_json())]
            if await self._call(self._swap(keys=[self._instances_key], args=swap)):
                return entry
        raise TierUnavailable("controller Redis: the instance entry kept changing")

    async def _session(self, session: str) -> SessionEntry | None:
        raw = await self._call(self._client.hget(self._sessions_key, session))
        return None if raw is None else SessionEntry.from_json(json.loads(raw))

    async def _change_session(self, session: str, change: SessionChange) -> SessionEntry:
        for _ in range(self.retries):
            raw, now = await self._read(self._sessions_key, session)
            old = None if raw is None else SessionEntry.from_json(json.loads(raw))
            new = change(old, now)
            keys = [
                self._sessions_key,
                self._owner_prefix + role_id(old.owner if old is not None else new.owner),
                self._owner_prefix + role_id(new.owner),
                self._ended_prefix + session,
            ]
            value = _dump(new.to_json())
            args: list[bytes | str | int] = [
                session,
                raw or b"",
                value,
                self.max_sessions,
                self.max_sessions_per_owner,
            ]
            done = await self._call(self._swap_session(keys=keys, args=args))
            if done == 1:
                return new
            if done == -3:
                raise self._ended_error()
            if done < 0:
                raise self._quota_error(total_full=done == -1)
        raise TierUnavailable("controller Redis: the session entry kept changing")

    async def _drop_session(
        self, session: str, check: Callable[[SessionEntry | None], object]
    ) -> None:
        for _ in range(self.retries):
            raw = await self._call(self._client.hget(self._sessions_key, session))
            entry = None if raw is None else SessionEntry.from_json(json.loads(raw))
            check(entry)
            if entry is None:
                return
            keys = [
                self._sessions_key,
                self._owner_prefix + role_id(entry.owner),
                self._ended_prefix + session,
            ]
            hold_ms = max(1, int(self.ended_ttl_s * 1000))
            if await self._call(self._drop(keys=keys, args=[session, raw, hold_ms])):
                return
        raise TierUnavailable("controller Redis: the session entry kept changing")

    async def _ended_entry(self, session: str) -> SessionEntry | None:
        raw = await self._call(self._client.get(self._ended_prefix + session))
        return None if raw is None else SessionEntry.from_json(json.loads(raw))

    async def _sessions_of(self, owner: str) -> list[SessionEntry]:
        names = await self._call(self._client.smembers(self._owner_prefix + role_id(owner)))
        if not names:
            return []
        values = await self._call(self._client.hmget(self._sessions_key, sorted(names)))
        entries = [SessionEntry.from_json(json.loads(v)) for v in values if v is not None]
        return [e for e in entries if e.owner == owner]

    async def _map(self, map_id: str) -> MapEntry | None:
        raw = await self._call(self._client.hget(self._maps_key, map_id))
        return None if raw is None else MapEntry.from_json(json.loads(raw))

    async def _change_map(self, map_id: str, change: MapChange) -> MapEntry:
        for _ in range(self.retries):
            raw, now = await self._read(self._maps_key, map_id)
            old = None if raw is None else MapEntry.from_json(json.loads(raw))
            entry = change(old, now)
            swap: list[bytes | str] = [map_id, raw or b"", _dump(entry.to_json())]
            if await self._call(self._swap(keys=[self._maps_key], args=swap)):
                return entry
        raise TierUnavailable("controller Redis: the map entry kept changing")

    async def close(self) -> None:
        await self._client.aclose()
