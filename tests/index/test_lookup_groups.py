"""Edge cases of joined lookup groups (Redis index state)."""

from __future__ import annotations

import uuid
from typing import Any

import redis as syncredis

from kvstore.index.redis_state import RedisState
from kvstore.index.state import MemoryState, record_octets
from kvstore.protocol.control import Link
from kvstore.protocol.placement import plan_groups, shape_groups
from kvstore.protocol.wire import role_id
from tests.index.test_state import COMPAT, H1, H2, SCOPE, key, parsed, record
from tests.protocol.test_placement import status


async def test_a_group_is_gone_in_the_millisecond_its_record_expires(redis_server: Any) -> None:
    # P2: a record is live while expiry > now; Redis keeps a key while now <=
    # its PXAT. A lookup in the record's expiry millisecond returned it.
    raw = syncredis.Redis.from_url(redis_server.url)
    served = 0
    for _ in range(20):
        state = RedisState(redis_server.url, f"t{uuid.uuid4().hex[:8]}:")
        await state.put(record(0, ttl_ms=30), 30)
        expiry = int(raw.zscore(f"{state.prefix}{{{key(0)}}}:z", role_id(H1)) or 0)
        while True:
            seconds, micros = raw.time()
            if seconds * 1000 + micros // 1000 >= expiry:
                break
        served += (await state.lookup(SCOPE, COMPAT, [key(0)])).matched
        await state.close()
    raw.close()
    assert served == 0


async def test_writes_to_a_key_with_thousands_of_holders(redis_server: Any) -> None:
    # Lua's unpack() stops near 8000 values: rebuilding the group of a key
    # with that many live holders failed every PUT and DELETE, half done.
    state = RedisState(redis_server.url, f"t{uuid.uuid4().hex[:8]}:")
    raw = syncredis.Redis.from_url(redis_server.url)
    base = f"{state.prefix}{{{key(0)}}}"
    await state.put(record(0), 60_000)
    expiry = raw.zscore(base + ":z", role_id(H1))
    pipe = raw.pipeline()
    for n in range(8500):  # what 8500 earlier publishes leave behind
        other = record(0, holder=f"https://h{n}.many.test/kvsp/")
        value, shape = record_octets(other)
        pipe.zadd(base + ":z", {role_id(other.holder): expiry})
        pipe.hset(
            base + ":v", role_id(other.holder), (SCOPE + COMPAT).encode() + shape + b"\n" + value
        )
    pipe.execute()
    await state.put(record(0, holder=H2), 60_000)
    assert len(parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))[0]) == 8502
    assert await state.delete(role_id(H1), key(0)) is True
    found = parsed(await state.lookup(SCOPE, COMPAT, [key(0)]))[0]
    assert len(found) == 8501 and H1 not in {r.holder for r in found}
    raw.close()
    await state.close()


async def test_equal_replicas_plan_alike_on_every_state(redis_server: Any) -> None:
    # PL1 ties: replicas at equally good sources are chosen by holder, not by
    # the order a state lists them in (publish order in memory, expiry in Redis).
    instance = status(Link(H1, 200000.0, 12.0), Link(H2, 200000.0, 12.0))
    plans = []
    for state in (MemoryState(), RedisState(redis_server.url, f"t{uuid.uuid4().hex[:8]}:")):
        for n in range(2):
            await state.put(record(n, holder=H2), 60_000)
            await state.put(record(n, holder=H1), 30_000)
        found = parsed(await state.lookup(SCOPE, COMPAT, [key(0), key(1)]))
        plans.append(plan_groups(shape_groups(found), instance))
        await state.close()
    assert plans[0] == plans[1] and plans[0] is not None
    assert list(plans[0].sources) == [H1]
