"""The IS app at its edges: TTL 0, expired records, lookups a principal may
not see, malformed keys, absurd JSON, methods not allowed."""

import asyncio
import json
import uuid

import httpx
import pytest

from kvstore.index import IndexSettings, MemoryState, create_app
from kvstore.index.redis_state import RedisState
from kvstore.protocol.wire import replica_path
from kvstore.security import create_dev_certificates
from tests.holder.conftest import AsPrincipal
from tests.index.test_app import COMPAT, H1, H2, IS, POLICY, SCOPE, key, record


@pytest.fixture(scope="module")
def icerts(tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    create_dev_certificates(d, ["holder1", "holder2", "alice", "bob", "carol", "dave"])
    return d


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def state(request):
    if request.param == "memory":
        yield MemoryState()
        return
    cluster = request.param == "redis-cluster"  # a real cluster: 3 masters, 3 replicas
    url = request.getfixturevalue("redis_cluster").url if cluster else "redis://127.0.0.1:6379/0"
    s = RedisState(url, prefix=f"rev2-{uuid.uuid4().hex}:", cluster=cluster)
    yield s
    await s.close()


@pytest.fixture
async def as_(icerts, state):
    app = create_app(IndexSettings(IS, max_ttl_ms=120_000, max_lookup_keys=100), state, POLICY)
    cs = []

    def make(n):
        c = httpx.AsyncClient(
            transport=httpx.ASGITransport(
                AsPrincipal(app, (icerts / f"client-{n}.pem").read_text()),
                raise_app_exceptions=False,
            ),
            base_url=IS,
        )
        cs.append(c)
        return c

    yield make
    for c in cs:
        await c.aclose()


async def pub(c, body):
    return await c.put(replica_path(body["holder"], body["block_key"]), json=body)


async def look(c, keys, scope=SCOPE):
    return await c.post("lookup", json={"scope_id": scope, "compat_id": COMPAT, "block_keys": keys})


async def test_ttl_zero_publish(as_):
    h1 = as_("holder1")
    r = await pub(h1, record(1, ttl_ms=0))
    assert r.status_code in (200, 400), (r.status_code, r.text)


async def test_ttl_zero_publish_after_other(as_):
    h1, h2 = as_("holder1"), as_("holder2")
    assert (await pub(h2, record(1, holder=H2))).status_code == 200
    r = await pub(h1, record(1, ttl_ms=0))
    assert r.status_code in (200, 400), (r.status_code, r.text)


async def test_delete_expired_is_404(as_):
    h1 = as_("holder1")
    assert (await pub(h1, record(1, ttl_ms=1))).status_code == 200
    await asyncio.sleep(0.05)
    r = await h1.delete(replica_path(H1, key(1)))
    assert r.status_code == 404, r.status_code


async def test_lookup_denied_equals_empty(as_):
    h1, bob, alice = as_("holder1"), as_("bob"), as_("alice")
    await pub(h1, record(1))
    r_denied = await look(bob, [key(1)])
    r_empty = await look(alice, [key(2)])
    assert r_denied.content == r_empty.content and r_denied.status_code == r_empty.status_code


async def test_lookup_keys_newline_validation(as_):
    alice = as_("alice")
    r = await alice.post(
        "lookup",
        json={"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [key(1) + "\n" + key(2)]},
    )
    assert r.status_code == 400, r.status_code


async def test_json_huge_int(as_):
    h1 = as_("holder1")
    body = json.dumps(record(1)).replace('"ttl_ms": 60000', '"ttl_ms": ' + "9" * 5000)
    r = await h1.put(replica_path(H1, key(1)), content=body)
    assert r.status_code == 400, r.status_code


async def test_405_problem(as_):
    r = await as_("alice").get("lookup")
    assert r.status_code == 405 and r.headers.get("cache-control") == "no-store"


async def test_delete_expired_with_other_holder_is_404(as_):
    h1, h2 = as_("holder1"), as_("holder2")
    assert (await pub(h2, record(1, holder=H2))).status_code == 200
    assert (await pub(h1, record(1, ttl_ms=1))).status_code == 200
    await asyncio.sleep(0.05)
    r = await h1.delete(replica_path(H1, key(1)))
    assert r.status_code == 404, r.status_code
