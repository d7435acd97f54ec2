"""The holder's resources in-process (ASGI transport): every route and error."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvstore.protocol import container as kc
from kvstore.protocol.codecs import CODEC_RAW, CODEC_ZSTD_RAW
from kvstore.protocol.records import LeaseGrant, ReplicaRecord
from kvstore.protocol.wire import parse_repr_digest, repr_digest
from kvstore.storage import BlockRef, TieredStore

from ..storage.helpers import SCOPE, block
from .conftest import HOLDER, OTHER_SCOPE, SMALL, ClientFactory, RecordingPublisher

CID = SMALL.compat_id_hex
KEY = hashlib.sha256(b"k1").hexdigest()
KEY2 = hashlib.sha256(b"k2").hexdigest()


def path(key: str = KEY, scope: str = SCOPE, compat: str = CID) -> str:
    return f"blocks/{compat}/{scope}/{key}"


def assert_problem(
    response: httpx.Response, status: int, suffix: str | None = None
) -> dict[str, Any]:
    # H3, H5: problem+json with the table's type and status, never cached.
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["cache-control"] == "no-store"
    problem = response.json()
    assert problem["status"] == status
    if suffix:
        assert problem["type"] == "https://iana.org/assignments/kvsp#" + suffix
    return problem


async def put(client: httpx.AsyncClient, data: bytes, key: str = KEY, **kw: Any) -> httpx.Response:
    return await client.put(path(key, **kw), content=data, headers={"If-None-Match": "*"})


async def test_put_then_get(client_as: ClientFactory, publisher: RecordingPublisher) -> None:
    alice = client_as("alice")
    data = block()
    response = await put(alice, data)
    assert response.status_code == 201
    assert response.headers["content-type"] == "application/kvsp+json"
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["location"] == "/kvsp/" + path()
    record = ReplicaRecord.from_json(response.json())
    assert record.holder == HOLDER
    assert publisher.events == [("published", BlockRef(CID, SCOPE, KEY))]

    got = await alice.get(path())
    assert got.status_code == 200
    assert got.content == data
    assert got.headers["content-type"] == "application/kvsp-block"
    # BL4: Repr-Digest is the SHA-256 of exactly the octets sent.
    assert parse_repr_digest(got.headers["repr-digest"]) == hashlib.sha256(data).digest()
    # BL5: private, immutable, max-age within the replica's TTL.
    cache = got.headers["cache-control"]
    assert "private" in cache and "immutable" in cache
    max_age = int(cache.split("max-age=")[1])
    assert 0 < max_age <= record.ttl_ms // 1000


async def test_layer_range_verifies_against_the_record(client_as: ClientFactory) -> None:
    # BL2, BL6: a range's layers match the record's layer digests.
    alice = client_as("alice")
    record = ReplicaRecord.from_json((await put(alice, block())).json())
    got = await alice.get(path(), params={"layers": "4-7"})
    assert got.status_code == 200
    assert parse_repr_digest(got.headers["repr-digest"]) == hashlib.sha256(got.content).digest()
    container = kc.decode(got.content)
    assert (container.first_layer, container.last_layer) == (4, 7)
    assert record.layer_digests is not None
    container.verify([bytes.fromhex(d) for d in record.layer_digests])


async def test_layers_not_held(client_as: ClientFactory) -> None:
    alice = client_as("alice")
    await put(alice, block())
    assert_problem(
        await alice.get(path(), params={"layers": "6-9"}), 404, "kvsp-layers-unavailable"
    )
    assert_problem(await alice.get(path(), params={"layers": "7-4"}), 400)
    assert_problem(await alice.get(path(), params={"layers": "x"}), 400)


async def test_unknown_and_malformed_resources(client_as: ClientFactory) -> None:
    alice = client_as("alice")
    assert_problem(await alice.get(path(KEY2)), 404, "kvsp-not-found")
    for bad in (KEY.upper(), KEY[:-1], KEY + "0", "zz" * 32):
        assert_problem(await alice.get(path(bad)), 404, "kvsp-not-found")
    assert_problem(await alice.get("nothing/here"), 404)
    assert_problem(await alice.post(path()), 405)


async def test_put_requires_if_none_match(client_as: ClientFactory, store: TieredStore) -> None:
    alice = client_as("alice")
    response = await alice.put(path(), content=block())
    assert_problem(response, 428)
    assert len(store) == 0


async def test_existing_replica_412_keeps_the_old_copy(client_as: ClientFactory) -> None:
    # BL7: the key names the prefix; the holder keeps its copy.
    alice = client_as("alice")
    first = block()
    await put(alice, first)
    assert_problem(await put(alice, block()), 412)
    assert (await alice.get(path())).content == first


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],  # ends early
        lambda d: d + b"x",  # trailing octets
        lambda d: b"XXXX" + d[4:],  # bad magic
        lambda d: bytes(kc.encode([(os.urandom(100), os.urandom(100))], token_count=4)),  # geometry
    ],
)
async def test_bad_containers_store_nothing(
    client_as: ClientFactory, store: TieredStore, mangle: Any
) -> None:
    alice = client_as("alice")
    assert_problem(await put(alice, mangle(block())), 400)
    assert len(store) == 0
    assert_problem(await alice.get(path()), 404, "kvsp-not-found")


async def test_body_over_the_limit_is_413(client_as: ClientFactory, store: TieredStore) -> None:
    alice = client_as("alice")
    assert_problem(await put(alice, bytes(2 << 20)), 413)
    assert len(store) == 0


async def test_scope_isolation(client_as: ClientFactory) -> None:
    # SEC1, L3-like: bob, outside the scope, learns nothing, held or not.
    alice, bob = client_as("alice"), client_as("bob")
    await put(alice, block())
    held = assert_problem(await bob.get(path()), 403, "kvsp-scope-denied")
    absent = assert_problem(await bob.get(path(KEY2)), 403, "kvsp-scope-denied")
    assert held["detail"] == absent["detail"]
    assert_problem(await put(bob, block()), 403, "kvsp-scope-denied")
    assert (await put(bob, block(), scope=OTHER_SCOPE)).status_code == 201


async def test_identity_is_required(client_as: ClientFactory) -> None:
    assert_problem(await client_as(None).get(path()), 401)
    assert_problem(await client_as("mallory").get(path()), 403)  # not in the policy


async def test_transcoding_to_our_private_codec(client_as: ClientFactory) -> None:
    # BL3: codec=n transcodes when the holder knows the geometry.
    alice = client_as("alice")
    data = bytes(kc.encode([(bytes(256), bytes(256)) for _ in range(8)], token_count=4))
    await put(alice, data)
    got = await alice.get(path(), params={"codec": str(CODEC_ZSTD_RAW)})
    assert got.status_code == 200
    assert parse_repr_digest(got.headers["repr-digest"]) == hashlib.sha256(got.content).digest()
    packed = kc.decode(got.content)
    assert packed.codec == CODEC_ZSTD_RAW and len(got.content) < len(data)
    assert bytes(kc.transcode(packed, CODEC_RAW, SMALL)) == data
    same = await alice.get(path(), params={"codec": "1"})
    assert same.content == data
    assert_problem(await alice.get(path(), params={"codec": "abc"}), 400)


async def test_leases(client_as: ClientFactory) -> None:
    # LE1: create, renew, release; LE3: TTL quota -> 429.
    alice, bob = client_as("alice"), client_as("bob")
    await put(alice, block())
    created = await alice.post("leases", json={"block_keys": [KEY, KEY2], "ttl_ms": 5000})
    assert created.status_code == 201
    grant = LeaseGrant.from_json(created.json())
    assert grant.block_keys == (KEY,) and 0 < grant.ttl_ms <= 5000
    assert created.headers["location"] == f"/kvsp/leases/{grant.lease}"
    renewed = await alice.put(f"leases/{grant.lease}", json={"ttl_ms": 8000})
    assert renewed.status_code == 200 and renewed.json()["ttl_ms"] > 5000
    assert_problem(await bob.delete(f"leases/{grant.lease}"), 404, "kvsp-not-found")
    assert (await alice.delete(f"leases/{grant.lease}")).status_code == 204
    assert_problem(await alice.delete(f"leases/{grant.lease}"), 404, "kvsp-not-found")
    too_long = await alice.post("leases", json={"block_keys": [KEY], "ttl_ms": 60_000})
    assert_problem(too_long, 429, "kvsp-lease-quota")
    # bob may not read alice's scope: nothing of it is leased to him.
    assert_problem(await bob.post("leases", json={"block_keys": [KEY], "ttl_ms": 1000}), 404)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"ttl_ms": 10}', b'{"block_keys": ["xy"], "ttl_ms": 10}'],
)
async def test_bad_lease_requests(client_as: ClientFactory, body: bytes) -> None:
    assert_problem(await client_as("alice").post("leases", content=body), 400)


async def test_eviction_is_withdrawn_first(
    client_as: ClientFactory, store: TieredStore, publisher: RecordingPublisher
) -> None:
    # P3: the store's eviction hook reaches the publisher.
    alice = client_as("alice")
    await put(alice, block())
    await store.delete(BlockRef(CID, SCOPE, KEY))
    assert publisher.events[-1] == ("withdrawn", BlockRef(CID, SCOPE, KEY))


async def test_repr_digest_is_base64_sha256(client_as: ClientFactory) -> None:
    alice = client_as("alice")
    data = block()
    await put(alice, data)
    header = (await alice.get(path())).headers["repr-digest"]
    assert header == "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


async def test_metrics(client_as: ClientFactory, store: TieredStore) -> None:
    # OPS1: requests by route and status, octets, tier occupancy, lease rejections.
    alice = client_as("alice")
    data = block()
    await put(alice, data)
    await alice.get(path())
    await alice.get(path(KEY2))
    await alice.post("leases", json={"block_keys": [KEY], "ttl_ms": 60_000})  # over quota
    assert_problem(await alice.get("https://holder.test/metrics"), 403)  # a tenant: no
    response = await client_as("holder1").get("https://holder.test/metrics")
    assert response.status_code == 200
    text = response.text
    assert 'kvstore_http_requests_total{method="GET",route="get_block",status="200"} 1.0' in text
    assert 'kvstore_http_requests_total{method="GET",route="get_block",status="404"} 1.0' in text
    assert f'kvstore_http_received_bytes_total{{route="put_block"}} {float(len(data))}' in text
    assert f'kvstore_tier_used_bytes{{position="0",tier="host"}} {float(len(data))}' in text
    # The host tier's arena: its mapping and the block's extent (64-aligned).
    assert 'kvstore_tier_arena_bytes{position="0",state="mapped",tier="host"}' in text
    extent = float(-(-len(data) // 64) * 64)
    assert (
        f'kvstore_tier_arena_bytes{{position="0",state="in_extents",tier="host"}} {extent}' in text
    )
    assert 'kvstore_tier_arena_fallbacks_total{position="0",tier="host"} 0.0' in text
    assert 'kvstore_tier_reserved_bytes{position="0",tier="host"} 0.0' in text
    assert 'kvstore_store_blocks{state="resident"} 1.0' in text
    assert 'kvstore_store_blocks{state="leaving"} 0.0' in text
    assert "kvstore_lease_rejections_total 1.0" in text
    # Each tier's calls by operation: the PUT's write, the hit's read (the
    # miss asked no tier), nothing deleted; their time within the buckets.
    latency = "kvstore_tier_operation_duration_seconds"
    host = 'position="0",tier="host"'
    assert f'{latency}_count{{op="write",{host}}} 1.0' in text
    assert f'{latency}_count{{op="read",{host}}} 1.0' in text
    assert f'{latency}_count{{op="delete",{host}}} 0.0' in text
    assert f'{latency}_bucket{{le="+Inf",op="read",{host}}} 1.0' in text
    # A tenant's usage: its blocks and their K/V octets (8 layers of 2 x 256).
    assert f'kvstore_scope_blocks{{scope="{SCOPE}"}} 1.0' in text
    assert f'kvstore_scope_kv_bytes{{scope="{SCOPE}"}} 4096.0' in text
    await store.delete(BlockRef(CID, SCOPE, KEY))  # an operator's removal
    text = (await client_as("holder1").get("https://holder.test/metrics")).text
    assert "kvstore_scope_blocks{" not in text  # nothing held: no series
    assert f'{latency}_count{{op="delete",{host}}} 1.0' in text
    assert 'kvstore_store_evictions_total{kind="fault"} 0.0' in text  # a DELETE is none
    assert_problem(await client_as("mallory").get("https://holder.test/metrics"), 403)


async def test_head_is_a_probe_that_reads_no_segment(
    client_as: ClientFactory, store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Engines probe existence with HEAD, many at a time: the answer comes
    # from what the holder knows (length, a Repr-Digest once a GET computed
    # it), without loading the block, counting a hit or touching its place
    # in the eviction order.
    alice = client_as("alice")
    data = block()
    assert (await put(alice, data)).status_code == 201
    loads: list[object] = []
    original = store.loader.load

    async def counted(*args: Any) -> Any:
        loads.append(args)
        return await original(*args)

    monkeypatch.setattr(store.loader, "load", counted)
    hits = store.stats.hits
    head = await alice.head(path())
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(data)
    # BL4: taken at PUT time, so a HEAD (and a hot GET) reads no segment for it.
    assert head.headers["repr-digest"] == repr_digest(data)
    assert loads == [] and store.stats.hits == hits
    got = await alice.get(path())
    assert loads and store.stats.hits == hits + 1
    assert got.headers["repr-digest"] == head.headers["repr-digest"] == repr_digest(got.content)
    ranged = await alice.head(path() + "?layers=1-2")
    assert "repr-digest" not in ranged.headers  # a range not served yet: nothing read for it
    again = await alice.head(path())
    assert again.headers["repr-digest"] == got.headers["repr-digest"]
    assert (await alice.head(path(KEY2))).status_code == 404


async def test_a_put_under_a_compat_id_without_a_descriptor_is_refused(
    store: TieredStore, certs: Any
) -> None:
    # Issue 33: with holder.descriptors set, a PUT under another compat_id was
    # accepted, though the docs said PUTs are checked against them.
    from kvstore.holder import HolderSettings, create_app

    from ..storage.helpers import COMPAT
    from .conftest import POLICY, AsPrincipal, pem

    settings = HolderSettings(HOLDER, known_descriptors={SMALL.compat_id_hex: SMALL})
    app = AsPrincipal(create_app(settings, store, POLICY), pem(certs, "alice"))
    headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=HOLDER) as alice:
        data = block()
        other = await alice.put(
            f"blocks/{COMPAT}/{SCOPE}/{'1' * 64}", content=data, headers=headers
        )
        assert other.status_code == 409
        assert other.json()["type"].endswith("kvsp-incompatible")
        assert "holder.descriptors" in other.json()["detail"]
        known = await alice.put(
            f"blocks/{SMALL.compat_id_hex}/{SCOPE}/{'1' * 64}", content=data, headers=headers
        )
        assert known.status_code == 201
    assert len(store) == 1


async def test_received_octets_are_those_that_arrived(client_as: ClientFactory) -> None:
    # Not the declared Content-Length: a request refused at its headers
    # that declares a terabyte sent nothing; a chunked upload declares none.
    alice = client_as("alice")
    huge = await alice.put(
        path(),
        content=b"",
        headers={"If-None-Match": "*", "Content-Length": "999999999999"},
    )
    assert huge.status_code == 413

    data = block()

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 1000):
            yield data[start : start + 1000]

    stored = await alice.put(path(KEY2), content=chunked(), headers={"If-None-Match": "*"})
    assert stored.status_code == 201, stored.text
    text = (await client_as("holder1").get("https://holder.test/metrics")).text
    assert f'kvstore_http_received_bytes_total{{route="put_block"}} {float(len(data))}' in text
