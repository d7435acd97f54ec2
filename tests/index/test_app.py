"""The Index Service's resources in-process: publish, withdraw, lookup, estimates."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.index import IndexSettings, MemoryState, StatusBook, create_app
from kvstore.protocol.control import InstanceStatus, Link
from kvstore.protocol.placement import shape_groups
from kvstore.protocol.records import LookupResponse, ReplicaRecord, Residency
from kvstore.protocol.wire import replica_path
from kvstore.security import Policy, create_dev_certificates

from ..holder.conftest import AsPrincipal

IS = "https://index.test/is/"
H1, H2 = "https://h1.test/kvsp/", "https://h2.test/kvsp/"
II = "https://ii7.test/kvsp/"
COMPAT = hashlib.sha256(b"compat").hexdigest()
SCOPE, OTHER = "a" * 32, "b" * 32


def key(n: int) -> str:
    return hashlib.sha256(f"k{n}".encode()).hexdigest()


def record(n: int, holder: str = H1, **changes: Any) -> dict[str, Any]:
    base = ReplicaRecord(
        block_key=key(n),
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=2097152,
        digest="sha-256:" + "0" * 64,
        residency=(Residency("host", 0, 31, 400000.0),),
        ttl_ms=60_000,
    ).to_json()
    base.update(changes)
    return base


POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:holder1": {"roles": ["holder"], "holder": H1, "write_scopes": [SCOPE]},
            "urn:kvstore:holder2": {"roles": ["holder"], "holder": H2, "write_scopes": [SCOPE]},
            "urn:kvstore:alice": {"read_scopes": [SCOPE]},
            "urn:kvstore:bob": {"read_scopes": [OTHER]},
            "urn:kvstore:carol": {"roles": ["reporter", "metrics"], "read_scopes": [SCOPE]},
            "urn:kvstore:dave": {"roles": ["reporter"], "read_scopes": [OTHER]},
        }
    }
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("is-certs")
    create_dev_certificates(directory, ["holder1", "holder2", "alice", "bob", "carol", "dave"])
    return directory


@pytest.fixture
def statuses() -> StatusBook:
    return StatusBook()


@pytest.fixture
async def as_(
    certs: Path, statuses: StatusBook
) -> AsyncIterator[Callable[[str], httpx.AsyncClient]]:
    settings = IndexSettings(IS, max_ttl_ms=120_000, max_lookup_keys=100, block_tokens={COMPAT: 16})
    app = create_app(settings, MemoryState(), POLICY, statuses)
    clients: list[httpx.AsyncClient] = []

    def make(name: str) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=IS)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def publish(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.put(replica_path(body["holder"], body["block_key"]), json=body)


async def lookup(client: httpx.AsyncClient, keys: list[str], **extra: Any) -> httpx.Response:
    return await client.post(
        "lookup", json={"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": keys, **extra}
    )


async def test_publish_and_lookup(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # P1, L1: two holders publish; a lookup returns both replicas of a key.
    h1, h2, alice = as_("holder1"), as_("holder2"), as_("alice")
    for n in range(2):
        assert (await publish(h1, record(n))).status_code == 200
    assert (await publish(h2, record(0, holder=H2))).status_code == 200
    response = await lookup(alice, [key(0), key(1), key(2)])
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    answer = LookupResponse.from_json(response.json())
    assert answer.matched == 2
    assert {r.holder for r in answer.replicas[0]} == {H1, H2}


async def test_lookup_stops_at_the_first_miss(as_: Callable[[str], httpx.AsyncClient]) -> None:
    h1, alice = as_("holder1"), as_("alice")
    for n in (0, 2, 3):
        await publish(h1, record(n))
    assert (await lookup(alice, [key(n) for n in range(4)])).json()["matched"] == 1


async def test_holders_act_only_for_themselves(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # P1, SEC1: holder A cannot publish or withdraw for holder B.
    h1, h2, alice = as_("holder1"), as_("holder2"), as_("alice")
    assert (await h1.put(replica_path(H2, key(0)), json=record(0, holder=H2))).status_code == 403
    mismatch = await h1.put(replica_path(H1, key(0)), json=record(0, holder=H2))
    assert mismatch.status_code == 400
    assert (await publish(alice, record(0))).status_code == 403
    await publish(h2, record(0, holder=H2))
    assert (await h1.delete(replica_path(H2, key(0)))).status_code == 403
    assert (await h2.delete(replica_path(H2, key(0)))).status_code == 204
    assert (await h2.delete(replica_path(H2, key(0)))).status_code == 404
    assert (await lookup(alice, [key(0)])).json()["matched"] == 0


async def test_publishing_needs_the_scope(as_: Callable[[str], httpx.AsyncClient]) -> None:
    response = await publish(as_("holder1"), record(0, scope_id=OTHER))
    assert response.status_code == 403
    assert response.json()["type"].endswith("#kvsp-scope-denied")


async def test_unauthorized_scope_looks_like_an_empty_index(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    # L3: bob learns nothing, not even that the scope has records.
    await publish(as_("holder1"), record(0))
    empty = await lookup(as_("bob"), [key(9)])
    denied = await lookup(as_("bob"), [key(0)])
    assert denied.status_code == empty.status_code == 200
    assert denied.content == empty.content == b'{"matched":0,"replicas":[]}'


async def test_ttl_is_capped(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # P2: the IS caps ttl_ms at its configured maximum.
    response = await publish(as_("holder1"), record(0, ttl_ms=10_000_000))
    assert response.json() == {"ttl_ms": 120_000}
    answer = LookupResponse.from_json((await lookup(as_("alice"), [key(0)])).json())
    assert answer.replicas[0][0].ttl_ms == 120_000


async def test_bad_input(as_: Callable[[str], httpx.AsyncClient]) -> None:
    h1, alice = as_("holder1"), as_("alice")
    overlap = record(
        0, residency=[{"tier": "host", "layers": [0, 9]}, {"tier": "device", "layers": [5, 31]}]
    )
    bad = await publish(h1, overlap)
    assert bad.status_code == 400 and "residency" in bad.json()["detail"]
    assert (await h1.put(replica_path(H1, "x"), json=record(0))).status_code == 404
    # L4: a lookup over the configured maximum of keys is refused.
    too_many = await lookup(alice, [key(n) for n in range(101)])
    assert too_many.status_code == 400
    assert (await alice.post("lookup", content=b"{")).status_code == 400


async def test_placement_estimates_by_the_drafts_formulas(
    as_: Callable[[str], httpx.AsyncClient], statuses: StatusBook
) -> None:
    # L2, PL1: hand-computed from the draft's example numbers.
    h1, alice = as_("holder1"), as_("alice")
    for n in range(2):
        await publish(h1, record(n))
    statuses.put(
        InstanceStatus(
            instance=II,
            epoch=12,
            state="active",
            running=18,
            queued=3,
            batch_size=32,
            kv_utilization=0.71,
            prefill_tokens_per_s=42000,
            decode_tokens_per_s=3100,
            ttl_ms=3000,
            links=(Link(H1, 200000.0, 12.0),),
        )
    )
    answer = (await lookup(alice, [key(0), key(1)], targets=[II, "https://unknown.test/"])).json()
    [target] = answer["targets"]
    assert target["instance"] == II
    # One source: RTT once, then 2 x 8 x 2097152 octets at 200000 Mbit/s.
    assert target["fetch_us"] == pytest.approx(12 + 2 * 8 * 2097152 / 200000)
    # Two blocks of 16 tokens at 42000 tokens/s.
    assert target["recompute_us"] == pytest.approx(1e6 * 32 / 42000)


async def test_a_reporter_may_withdraw_a_bad_replica(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    # BL8: a client that found a digest failure withdraws on the holder's
    # behalf when the policy makes it a reporter for the scope.
    h1, alice, carol, dave = as_("holder1"), as_("alice"), as_("carol"), as_("dave")
    await publish(h1, record(0))
    assert (await alice.delete(replica_path(H1, key(0)))).status_code == 403  # not a reporter
    assert (await dave.delete(replica_path(H1, key(0)))).status_code == 403  # other scope
    assert (await carol.delete(replica_path(H1, key(0)))).status_code == 204
    assert (await lookup(alice, [key(0)])).json()["matched"] == 0
    assert (await carol.delete(replica_path(H1, key(0)))).status_code == 403  # gone: no scope


async def test_index_metrics(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # OPS1: lookup hit ratio = matched keys / looked-up keys.
    h1, alice = as_("holder1"), as_("alice")
    await publish(h1, record(0))
    await lookup(alice, [key(0), key(1)])
    await lookup(as_("bob"), [key(0)])
    assert (await alice.get("https://index.test/metrics")).status_code == 403
    text = (await as_("carol").get("https://index.test/metrics")).text
    assert "kvstore_index_lookup_keys_total 3.0" in text
    assert "kvstore_index_lookup_matched_keys_total 1.0" in text
    assert "kvstore_index_lookups_denied_scope_total 1.0" in text
    assert "kvstore_index_published_total 1.0" in text


async def test_shapes_only_answers_runs_of_shapes(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    # Ours (PL1 for the PC): no records, the matched keys as runs of equal
    # replica shapes; the same placement groups as the full answer gives.
    h1, h2, alice = as_("holder1"), as_("holder2"), as_("alice")
    for n in range(5):
        await publish(h1, record(n))
    for n in (2, 3):
        await publish(h2, record(n, holder=H2))
    keys = [key(n) for n in range(6)]
    full = LookupResponse.from_json((await lookup(alice, keys)).json())
    response = await lookup(alice, keys, shapes_only=True)
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    raw = response.json()
    assert "replicas" not in raw and raw["matched"] == 5
    answer = LookupResponse.from_json(raw)
    assert answer.shapes is not None and answer.replicas == ()
    assert [count for _, count in answer.shapes.runs] == [2, 2, 1]
    assert answer.shapes.runs[0][0] == answer.shapes.runs[2][0]  # keys 0-1 and 4 alike
    assert sorted(answer.shapes.counts(), key=repr) == sorted(shape_groups(full.replicas), key=repr)
    # L3 holds for shapes too: another scope's reader learns nothing.
    denied = (await lookup(as_("bob"), keys, shapes_only=True)).json()
    assert denied["matched"] == 0
    # A value that is not a flag is a bad request, not ignored.
    assert (await lookup(alice, keys, shapes_only="yes")).status_code == 400
