"""Instance residency in the Index Service (kvstore.index.residency, ours):
only an instance tells its own, in scopes it may write; a lookup answers it
apart from the replicas, as prefixes; its records live by the instance's
TTL; a clear voids them."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.index import IndexSettings, MemoryState, create_app
from kvstore.index.residency import ResidencyBook
from kvstore.protocol.records import LookupResponse
from kvstore.protocol.residency import ResidencyGroup, ResidencyUpdate
from kvstore.protocol.wire import role_id
from kvstore.security import Policy, create_dev_certificates

from ..holder.conftest import AsPrincipal
from ..storage.helpers import Clock

IS = "https://index.test/is/"
POD, OTHER_POD = "https://vllm-0.test:8000/", "https://vllm-1.test:8000/"
COMPAT = hashlib.sha256(b"compat").hexdigest()
SCOPE, TENANT = "a" * 32, "b" * 32


def key(n: int) -> str:
    return hashlib.sha256(f"k{n}".encode()).hexdigest()


POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:pod0": {"roles": ["instance"], "instance": POD, "write_scopes": [SCOPE]},
            "urn:kvstore:pod1": {
                "roles": ["instance"],
                "instance": OTHER_POD,
                "write_scopes": [SCOPE, TENANT],
            },
            "urn:kvstore:alice": {"read_scopes": [SCOPE]},
            "urn:kvstore:bob": {"read_scopes": [TENANT]},
        }
    }
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("residency-certs")
    create_dev_certificates(directory, ["pod0", "pod1", "alice", "bob"])
    return directory


@pytest.fixture
async def as_(certs: Path) -> AsyncIterator[Callable[[str], httpx.AsyncClient]]:
    app = create_app(IndexSettings(IS, max_ttl_ms=120_000), MemoryState(), POLICY)
    clients: list[httpx.AsyncClient] = []

    def make(name: str) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=IS)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


def update(instance: str = POD, **more: Any) -> dict[str, Any]:
    return {"instance": instance, "ttl_ms": 30_000, **more}


def group(keys: list[str], scope: str = SCOPE, medium: str = "GPU") -> dict[str, Any]:
    return {"scope_id": scope, "compat_id": COMPAT, "medium": medium, "block_keys": keys}


async def tell(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post(f"residency/{role_id(body['instance'])}", json=body)


async def lookup(
    client: httpx.AsyncClient, keys: list[str], scope: str = SCOPE, **more: Any
) -> Any:
    response = await client.post(
        "lookup", json={"scope_id": scope, "compat_id": COMPAT, "block_keys": keys, **more}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_lookup_answers_residency_apart_as_prefixes(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    pod0, pod1, alice = as_("pod0"), as_("pod1"), as_("alice")
    told = await tell(pod0, update(add=[group([key(0), key(1), key(2)])]))
    assert told.status_code == 200
    assert told.json() == {"ttl_ms": 30_000, "known": False, "records": 3}
    await tell(pod1, update(OTHER_POD, add=[group([key(0)]), group([key(0)], medium="CPU")]))
    answer = await lookup(alice, [key(0), key(1), key(2), key(3)])
    assert answer["matched"] == 0 and answer["replicas"] == []  # never a source
    assert answer["resident"] == [
        {"instance": POD, "prefix_blocks": 3, "media": ["GPU"]},
        {"instance": OTHER_POD, "prefix_blocks": 1, "media": ["CPU", "GPU"]},
    ]
    parsed = LookupResponse.from_json(answer)
    assert parsed.resident[0].prefix_blocks == 3
    # A hole in the chain ends the prefix; a chain not from key 0 is none.
    await tell(pod0, update(remove=[group([key(1)])]))
    answer = await lookup(alice, [key(0), key(1), key(2)])
    assert answer["resident"][0] == {"instance": POD, "prefix_blocks": 1, "media": ["GPU"]}
    assert "resident" not in await lookup(alice, [key(5), key(0)])  # none from the first
    # Shapes-only lookups (the PC's) carry it too.
    shapes = await lookup(alice, [key(0)], shapes_only=True)
    assert {r["instance"] for r in shapes["resident"]} == {POD, OTHER_POD}


async def test_only_the_instance_itself_in_its_scopes(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    pod0, alice = as_("pod0"), as_("alice")
    # pod0 may not speak for pod1, nor write the tenant's scope; alice is no instance.
    assert (await tell(pod0, update(OTHER_POD, add=[group([key(0)])]))).status_code == 403
    assert (await tell(pod0, update(add=[group([key(0)], scope=TENANT)]))).status_code == 403
    assert (await tell(alice, update(add=[group([key(0)])]))).status_code == 403
    # The body's instance must be the path's.
    wrong = await pod0.post(f"residency/{role_id(OTHER_POD)}", json=update(add=[]))
    assert wrong.status_code in (400, 403)
    assert (await pod0.post(f"residency/{role_id(POD)}", json=update(OTHER_POD))).status_code == 400
    for bad in (
        update(add=[group(["not-a-key"])]),
        update(add=[group([key(0)], medium="FLOPPY")]),
        update(ttl_ms=0),
        {"ttl_ms": 1000},
    ):
        response = await pod0.post(f"residency/{role_id(POD)}", json=bad)
        assert response.status_code == 400, bad
        assert response.headers["content-type"].startswith("application/problem+json")
    # Nothing of that was kept.
    assert not (await lookup(alice, [key(0)])).get("resident")


async def test_tenants_see_only_their_scope(as_: Callable[[str], httpx.AsyncClient]) -> None:
    pod1, alice, bob = as_("pod1"), as_("alice"), as_("bob")
    await tell(pod1, update(OTHER_POD, add=[group([key(0)], scope=TENANT)]))
    assert (await lookup(bob, [key(0)], scope=TENANT))["resident"][0]["instance"] == OTHER_POD
    # Alice asks for the tenant's scope: the answer of an empty index (L3).
    assert (await lookup(alice, [key(0)], scope=TENANT)) == {"matched": 0, "replicas": []}
    assert not (await lookup(alice, [key(0)])).get("resident")  # her scope: nothing


async def test_a_clear_voids_and_the_answer_says_what_is_known(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    pod0, alice = as_("pod0"), as_("alice")
    await tell(pod0, update(add=[group([key(0), key(1)])]))
    again = await tell(pod0, update(clear=True, add=[group([key(5)])]))
    assert again.json() == {"ttl_ms": 30_000, "known": True, "records": 1}
    assert not (await lookup(alice, [key(0)])).get("resident")
    assert (await lookup(alice, [key(5)]))["resident"][0]["prefix_blocks"] == 1
    capped = await tell(pod0, update(ttl_ms=10**9))
    assert capped.json()["ttl_ms"] == 120_000  # the IS's max_ttl_ms


def test_records_expire_with_their_instance_s_ttl() -> None:
    clock = Clock()
    book = ResidencyBook(clock=clock)
    keys = (key(0), key(1))
    book.apply(
        role_id(POD), ResidencyUpdate(POD, 5_000, add=(ResidencyGroup(SCOPE, COMPAT, "GPU", keys),))
    )
    book.apply(
        role_id(OTHER_POD),
        ResidencyUpdate(OTHER_POD, 60_000, add=(ResidencyGroup(SCOPE, COMPAT, "GPU", keys[:1]),)),
    )
    assert [r.instance for r in book.lookup(SCOPE, COMPAT, keys)] == [POD, OTHER_POD]
    clock.advance(6)  # POD's bridge stopped refreshing (its pod is gone)
    assert [r.instance for r in book.lookup(SCOPE, COMPAT, keys)] == [OTHER_POD]
    assert book.records == 1 and book.counters.residency_expired == 2  # swept
    # Its bridge comes back: the IS did not know it any more.
    ttl, known, records = book.apply(role_id(POD), ResidencyUpdate(POD, 5_000))
    assert (ttl, known, records) == (5_000, False, 0)


def test_the_book_is_bounded() -> None:
    book = ResidencyBook(max_records=3)
    keys = tuple(key(n) for n in range(4))
    from kvstore.protocol.problems import InsufficientStorage

    with pytest.raises(InsufficientStorage):
        book.apply(
            role_id(POD),
            ResidencyUpdate(POD, 5_000, add=(ResidencyGroup(SCOPE, COMPAT, "GPU", keys),)),
        )
    assert book.records == 0


async def test_the_pc_s_in_process_lookup_sees_residency_too() -> None:
    # kvstore serve --roles pc,index: the placer asks the IS's state directly.
    from kvstore.index.local import LocalIndex
    from kvstore.protocol.records import LookupRequest

    book = ResidencyBook()
    keys = (key(0), key(1))
    group = ResidencyGroup(SCOPE, COMPAT, "GPU", keys)
    book.apply(role_id(POD), ResidencyUpdate(POD, 5_000, add=(group,)))
    local = LocalIndex(MemoryState(), residency=book)
    answer = await local.lookup(LookupRequest(SCOPE, COMPAT, keys, shapes_only=True))
    assert [(r.instance, r.prefix_blocks) for r in answer.resident] == [(POD, 2)]
