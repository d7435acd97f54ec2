"""Operators can remove data (issue 33), over the real wire: a holder and an
Index Service as processes with TLS client certificates. ``DELETE
blocks/...`` removes one block and ``DELETE scopes/{scope}`` every block of
a scope, each withdrawn from the IS first (P3): the IS no longer lists it
once the 204 or 200 is back. Refused (403) to everyone but the admin role;
a leased block stays unless ``force=true``; a 405 lists every method."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvstore.client import HolderClient, IndexClient
from kvstore.protocol.problems import KvspError, PreconditionFailed
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..storage.helpers import SCOPE, block, ref
from .test_index import COMPAT, SERVER, Process, eventually, replicas_of

OTHER = "e" * 32


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("admin")
    create_dev_certificates(root / "certs", ["holder1", "alice", "ops"])
    ports = {"index": free_port(), "holder": free_port()}
    index_uri = f"https://127.0.0.1:{ports['index']}/is/"
    holder_uri = f"https://127.0.0.1:{ports['holder']}/kvsp/"
    (root / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:holder1": {
                        "roles": ["holder"],
                        "holder": holder_uri,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:alice": {"read_scopes": ["*"], "write_scopes": ["*"]},
                    "urn:kvstore:ops": {"roles": ["admin"], "read_scopes": ["*"]},
                }
            }
        )
    )
    processes = [
        Process(
            root,
            "index",
            SERVER.format(port=ports["index"])
            + f'[index]\nuri = "{index_uri}"\npolicy = "policy.json"\n',
            "index",
        ),
        Process(
            root,
            "holder",
            SERVER.format(port=ports["holder"])
            + f"""
[holder]
uri = "{holder_uri}"
policy = "policy.json"
index_uri = "{index_uri}"
client_certfile = "certs/client-holder1.pem"
client_keyfile = "certs/client-holder1.key"
[[storage.tiers]]
backend = "host"
capacity = "64MiB"
""",
            "holder",
        ),
    ]
    for process in processes:
        process.start(ports[process.name])

    def context(name: str) -> Any:
        certs = root / "certs"
        return client_context(
            str(certs / "ca.pem"),
            str(certs / f"client-{name}.pem"),
            str(certs / f"client-{name}.key"),
        )

    yield {"index": index_uri, "holder": holder_uri, "context": context}
    for process in processes:
        process.stop()


async def test_an_admin_removes_a_block_withdrawn_first(deployment: dict[str, Any]) -> None:
    holder, index_uri = deployment["holder"], deployment["index"]
    alice, ops = deployment["context"]("alice"), deployment["context"]("ops")
    async with HolderClient(alice) as client, IndexClient(index_uri, alice) as index:
        for n in (1, 2):
            await client.put_block(holder, COMPAT, SCOPE, ref(n).block_key, block())

        async def published() -> bool:
            return all([await replicas_of(index, ref(n).block_key) == [holder] for n in (1, 2)])

        await eventually(published)
        url = f"{holder}blocks/{COMPAT}/{SCOPE}/{ref(1).block_key}"
        # Not the admin: refused, and the block stays.
        async with aiohttp.ClientSession() as http:
            async with http.delete(url, ssl=alice) as answer:
                assert answer.status == 403
            assert await client.has_block(holder, COMPAT, SCOPE, ref(1).block_key)
            # A leased block stays unless forced (LE2).
            lease = await client.lease(holder, [ref(1).block_key], 30_000, scope_id=SCOPE)
            async with http.delete(url, ssl=ops) as answer:
                assert answer.status == 412
            async with http.delete(url + "?force=true", ssl=ops) as answer:
                assert answer.status == 204
            # P3: withdrawn before the 204 came back.
            assert await replicas_of(index, ref(1).block_key) == []
            assert not await client.has_block(holder, COMPAT, SCOPE, ref(1).block_key)
            assert await replicas_of(index, ref(2).block_key) == [holder]
            del lease
            # Allow lists every method of the block resource.
            async with http.post(url, ssl=alice) as answer:
                assert answer.status == 405
                allowed = {m.strip() for m in answer.headers["Allow"].split(",")}
                assert allowed == {"GET", "HEAD", "PUT", "DELETE"}


async def test_an_admin_purges_a_scope(deployment: dict[str, Any]) -> None:
    holder, index_uri = deployment["holder"], deployment["index"]
    alice, ops = deployment["context"]("alice"), deployment["context"]("ops")
    keys = [ref(n).block_key for n in range(10, 14)]
    async with HolderClient(alice) as client, IndexClient(index_uri, alice) as index:
        for key in keys[:3]:
            await client.put_block(holder, COMPAT, OTHER, key, block())
        await client.put_block(holder, COMPAT, SCOPE, keys[3], block())  # another scope

        async def published() -> bool:
            answer = [await replicas_of(index, k, scope=OTHER) for k in keys[:3]]
            return answer == [[holder]] * 3

        await eventually(published)
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{holder}scopes/{OTHER}", ssl=alice) as answer:
                assert answer.status == 403
            async with http.delete(f"{holder}scopes/{OTHER}", ssl=ops) as answer:
                assert answer.status == 200
                assert await answer.json() == {"scope_id": OTHER, "removed": 3, "leased_kept": 0}
        for key in keys[:3]:
            assert await replicas_of(index, key, scope=OTHER) == []  # withdrawn first (P3)
            assert not await client.has_block(holder, COMPAT, OTHER, key)
        assert await client.has_block(holder, COMPAT, SCOPE, keys[3])  # other scopes stay


async def test_the_client_maps_the_refusals(deployment: dict[str, Any]) -> None:
    # The problem types come back as the exceptions a script would catch.
    holder = deployment["holder"]
    async with HolderClient(deployment["context"]("alice")) as client:
        await client.put_block(holder, COMPAT, SCOPE, ref(20).block_key, block())
        url = f"{holder}blocks/{COMPAT}/{SCOPE}/{ref(20).block_key}"
        with pytest.raises(KvspError, match="admin") as refused:
            await client._request("DELETE", url, expect=[204])
        assert refused.value.status == 403
    async with HolderClient(deployment["context"]("ops")) as admin:
        await client_lease(deployment, ref(20).block_key)
        with pytest.raises(PreconditionFailed, match="force=true"):
            await admin._request("DELETE", url, expect=[204])


async def client_lease(deployment: dict[str, Any], key: str) -> None:
    async with HolderClient(deployment["context"]("alice")) as client:
        await client.lease(deployment["holder"], [key], 30_000, scope_id=SCOPE)
