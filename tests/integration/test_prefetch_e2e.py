"""A placement's prefetch across real processes over mutual TLS: a holder
with a block, an IS, a PC, and an inference instance (``--roles
holder,instance``) that reports its status, takes the PC's directive,
fetches the block from the holder, and publishes its own replica (PL2, PF1,
PF2, PF3, S1)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp

from kvstore.client import HolderClient, IndexClient, InstanceClient
from kvstore.protocol.compat import parse_descriptor
from kvstore.protocol.records import LookupRequest
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..storage.helpers import SCOPE, block, ref
from .test_index import SERVER, Process

TIERS = '\n[[storage.tiers]]\nbackend = "host"\ncapacity = 67108864\n'


async def test_the_chosen_instance_prefetches_from_the_holder(tmp_path: Path) -> None:
    create_dev_certificates(tmp_path / "certs", ["pc", "holder1", "ii1", "alice"])
    ports = {n: free_port() for n in ("index", "pc", "holder1", "ii1")}
    base = {n: f"https://127.0.0.1:{p}" for n, p in ports.items()}
    holder1, ii_holder, ii = (
        f"{base['holder1']}/kvsp/",
        f"{base['ii1']}/kvsp/",
        f"{base['ii1']}/ii/",
    )
    index, pc = f"{base['index']}/is/", f"{base['pc']}/pc/"
    descriptor = {
        "model": "m",
        "model_digest": "sha-256:" + "0" * 64,
        "tokenizer_digest": "sha-256:" + "1" * 64,
        "layers": 8,
        "kv_heads": 1,
        "head_dim": 16,
        "kv_dtype": "fp32",
        "positional": "none",
        "block_tokens": 4,
        "layout": "kvsp-layout-1",
    }
    (tmp_path / "descriptor.json").write_text(json.dumps(descriptor))
    compat = parse_descriptor(descriptor).compat_id_hex
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
                    "urn:kvstore:holder1": {
                        "roles": ["holder"],
                        "holder": holder1,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:ii1": {
                        "roles": ["instance", "holder"],
                        "instance": ii,
                        "holder": ii_holder,
                        "read_scopes": ["*"],
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:alice": {"read_scopes": ["*"], "write_scopes": ["*"]},
                }
            }
        )
    )

    def cert(name: str) -> str:
        return (
            f'client_certfile = "certs/client-{name}.pem"\n'
            f'client_keyfile = "certs/client-{name}.key"\n'
        )

    processes = [
        Process(
            tmp_path,
            "index",
            SERVER.format(port=ports["index"])
            + f'[index]\nuri = "{index}"\npolicy = "policy.json"\n',
            "index",
        ),
        Process(
            tmp_path,
            "pc",
            SERVER.format(port=ports["pc"])
            + f'[controller]\nuri = "{pc}"\npolicy = "policy.json"\nindex_uri = "{index}"\n'
            + 'descriptors = ["descriptor.json"]\nprefetch = true\n'
            + "prefetch_deadline_ms = 5000\n"
            + cert("pc"),
            "pc",
        ),
        Process(
            tmp_path,
            "holder1",
            SERVER.format(port=ports["holder1"])
            + f'[holder]\nuri = "{holder1}"\npolicy = "policy.json"\nindex_uri = "{index}"\n'
            + cert("holder1")
            + TIERS,
            "holder",
        ),
        Process(
            tmp_path,
            "ii1",
            SERVER.format(port=ports["ii1"])
            + f'[holder]\nuri = "{ii_holder}"\npolicy = "policy.json"\nindex_uri = "{index}"\n'
            + cert("ii1")
            + f'[instance]\nuri = "{ii}"\npolicy = "policy.json"\ncontroller_uri = "{pc}"\n'
            + f'index_uri = "{index}"\nstatus_ttl_ms = 1500\nprefill_tokens_per_s = 1000.0\n'
            + cert("ii1")
            + TIERS,
            "holder,instance",
        ),
    ]
    try:
        for process in processes:
            process.start(ports[process.name])

        def context(name: str) -> object:
            certs = tmp_path / "certs"
            return client_context(
                str(certs / "ca.pem"),
                str(certs / f"client-{name}.pem"),
                str(certs / f"client-{name}.key"),
            )

        data = block()
        async with HolderClient(context("alice")) as alice:
            await alice.put_block(holder1, compat, SCOPE, ref(0).block_key, data)
        query = LookupRequest(SCOPE, compat, (ref(0).block_key,))
        async with IndexClient(index, context("alice")) as lookup:
            deadline = time.monotonic() + 15
            while (await lookup.lookup(query)).matched == 0:  # published by holder1 (P1)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            connector = aiohttp.TCPConnector(ssl=context("alice"))
            async with aiohttp.ClientSession(connector=connector) as front:
                body = {
                    "scope_id": SCOPE,
                    "compat_id": compat,
                    "block_keys": [ref(0).block_key],
                    "request_ref": "req-1",
                }
                while True:  # until the instance's status report has arrived (S1)
                    async with front.post(f"{pc}place", json=body) as response:
                        answer = await response.json()
                    if response.status == 200:
                        break
                    assert response.status == 409 and time.monotonic() < deadline, answer
                    await asyncio.sleep(0.2)
            assert answer["instance"] == ii and answer["matched"] == 1
            location = answer["prefetch"]["location"]
            async with InstanceClient(context("pc")) as as_pc:
                while (status := await as_pc.prefetch_status(location)).state == "pending":
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            assert status.state == "complete" and status.loaded == (ref(0).block_key,)
            # PF2: the instance's own replica is published and serves the block.
            while len((await lookup.lookup(query)).replicas[0]) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            holders = {r.holder for r in (await lookup.lookup(query)).replicas[0]}
            assert holders == {holder1, ii_holder}
        async with HolderClient(context("alice")) as alice:
            assert await alice.get_block(ii_holder, compat, SCOPE, ref(0).block_key) == data
    finally:
        for process in processes:
            process.stop()
