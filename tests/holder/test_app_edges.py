"""The holder app at its edges: absurd JSON, odd codecs, lying lengths,
other scopes and clients, and the headers of every refusal (served as a
server would: an app error is a 500, not an exception)."""

import hashlib

from kvstore.http import role_of
from kvstore.protocol.wire import parse_repr_digest
from tests.holder.conftest import SMALL
from tests.storage.helpers import SCOPE, block

CID = SMALL.compat_id_hex
KEY = hashlib.sha256(b"k1").hexdigest()


def path(key=KEY, scope=SCOPE, compat=CID):
    return f"blocks/{compat}/{scope}/{key}"


async def put(c, data, key=KEY, **kw):
    return await c.put(path(key, **kw), content=data, headers={"If-None-Match": "*"})


async def test_json_huge_int_lease(served_as):
    a = served_as("alice")
    body = b'{"block_keys":["' + KEY.encode() + b'"],"ttl_ms":' + b"9" * 5000 + b"}"
    r = await a.post("leases", content=body)
    assert r.status_code == 400, r.status_code


async def test_json_deep_nesting_lease(served_as):
    a = served_as("alice")
    body = b"[" * 200000 + b"]" * 200000
    r = await a.post("leases", content=body)
    assert r.status_code == 400, r.status_code


async def test_renew_ttl_bool(served_as):
    a = served_as("alice")
    await put(a, block())
    g = (await a.post("leases", json={"block_keys": [KEY], "ttl_ms": 1000})).json()
    r = await a.put(f"leases/{g['lease']}", json={"ttl_ms": True})
    assert r.status_code == 400, (r.status_code, r.text)


async def test_renew_ttl_negative(served_as):
    a = served_as("alice")
    await put(a, block())
    g = (await a.post("leases", json={"block_keys": [KEY], "ttl_ms": 1000})).json()
    r = await a.put(f"leases/{g['lease']}", json={"ttl_ms": -5000})
    assert r.status_code == 400, (r.status_code, r.text)


async def test_head_digest(served_as):
    a = served_as("alice")
    data = block()
    await put(a, data)
    g = await a.get(path(), params={"layers": "2-5"})
    h = await a.head(path(), params={"layers": "2-5"})
    assert h.status_code == 200 and h.content == b""
    assert h.headers["repr-digest"] == g.headers["repr-digest"]
    assert h.headers["content-length"] == g.headers["content-length"]


async def test_405_no_store(served_as):
    a = served_as("alice")
    r = await a.post(path())
    assert r.status_code == 405
    assert r.headers.get("cache-control") == "no-store", r.headers
    assert r.headers["content-type"] == "application/problem+json"


async def test_404_unmatched_no_store(served_as):
    a = served_as("alice")
    r = await a.get("nothing/here")
    assert r.status_code == 404 and r.headers.get("cache-control") == "no-store"


async def test_metrics_method_cardinality(served_as, app):
    c = served_as("mallory")  # principal not even in the policy
    for i in range(200):
        await c.request(f"X{i}", path())
    text = role_of(app).metrics.render().decode()
    n = sum(1 for line in text.splitlines() if line.startswith("kvstore_http_requests_total{"))
    assert n < 20, n


async def test_layers_and_transcode(served_as):
    a = served_as("alice")
    await put(a, block())
    from kvstore.protocol.codecs import CODECS

    for codec in CODECS:
        r = await a.get(path(), params={"layers": "2-5", "codec": str(codec)})
        assert r.status_code == 200, (codec, r.status_code, r.text)
        assert parse_repr_digest(r.headers["repr-digest"]) == hashlib.sha256(r.content).digest()


async def test_codec_weird(served_as):
    a = served_as("alice")
    await put(a, block())
    for v in ["", " 1", "abc", "9" * 5000, "-1", "1e3"]:
        r = await a.get(path(), params={"codec": v})
        assert r.status_code in (200, 400), (v, r.status_code)


async def test_lying_content_length_short(served_as, store):
    a = served_as("alice")
    data = block()
    r = await a.put(
        path(), content=data, headers={"If-None-Match": "*", "Content-Length": str(len(data) - 10)}
    )
    assert r.status_code >= 400 and len(store) == 0


async def test_lease_other_scope_key(served_as):
    a, b = served_as("alice"), served_as("bob")
    await put(a, block())
    r = await b.post("leases", json={"block_keys": [KEY], "ttl_ms": 1000})
    assert r.status_code == 404, r.status_code
    r2 = await b.post(
        "leases", json={"block_keys": [hashlib.sha256(b"zz").hexdigest()], "ttl_ms": 1000}
    )
    assert r.content.replace(KEY.encode(), b"") == r2.content.replace(
        hashlib.sha256(b"zz").hexdigest().encode(), b""
    ), (r.content, r2.content)


async def test_lease_renew_release_other_client(served_as):
    a, b = served_as("alice"), served_as("bob")
    await put(a, block())
    g = (await a.post("leases", json={"block_keys": [KEY], "ttl_ms": 1000})).json()
    assert (await b.put(f"leases/{g['lease']}", json={"ttl_ms": 5000})).status_code == 404
    assert (await b.delete(f"leases/{g['lease']}")).status_code == 404


async def test_get_other_scope_existing_vs_missing(served_as):
    a, b = served_as("alice"), served_as("bob")
    await put(a, block())
    r1 = await b.get(path())
    r2 = await b.get(path(key=hashlib.sha256(b"none").hexdigest()))
    r3 = await b.head(path())
    assert r1.status_code == r2.status_code == r3.status_code == 403
    assert r1.json()["detail"] == r2.json()["detail"]
    # PUT to existing other-scope block: 403, not 412
    assert (await put(b, block())).status_code == 403
