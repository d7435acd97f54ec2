"""Index Service and Placement Controller in one process, over mutual TLS:
instances report status to the PC, and IS lookups estimate costs from it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvstore.client import IndexClient
from kvstore.protocol.control import InstanceStatus, Link
from kvstore.protocol.records import LookupRequest, ReplicaRecord, Residency
from kvstore.protocol.wire import role_id
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..protocol.vectors import COMPAT_ID, DESCRIPTOR, K0, K1

SCOPE = "a" * 32


async def test_lookup_estimates_come_from_reported_status(tmp_path: Path) -> None:
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    holder, instance = "https://h1.test/kvsp/", "https://ii1.test/kvsp/"
    create_dev_certificates(tmp_path / "certs", ["holder1", "ii1", "alice", "pc"])
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR))
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:holder1": {
                        "roles": ["holder"],
                        "holder": holder,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:ii1": {
                        "roles": ["instance"],
                        "instance": instance,
                        "write_scopes": [SCOPE],
                    },
                    "urn:kvstore:alice": {"read_scopes": [SCOPE]},
                    "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
                }
            }
        )
    )
    (tmp_path / "k.toml").write_text(f"""
[server]
port = {port}
certfile = "certs/server.pem"
keyfile = "certs/server.key"
cafile = "certs/ca.pem"
[index]
uri = "{base}/is/"
policy = "policy.json"
descriptors = ["descriptor.json"]
[controller]
uri = "{base}/pc/"
policy = "policy.json"
index_uri = "{base}/is/"
client_certfile = "certs/client-pc.pem"
client_keyfile = "certs/client-pc.key"
descriptors = ["descriptor.json"]
""")
    log = (tmp_path / "serve.log").open("ab")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--roles",
            "index,pc",
            "--config",
            str(tmp_path / "k.toml"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port)

        def context(name: str) -> object:
            certs = tmp_path / "certs"
            return client_context(
                str(certs / "ca.pem"),
                str(certs / f"client-{name}.pem"),
                str(certs / f"client-{name}.key"),
            )

        status = InstanceStatus(
            instance=instance,
            epoch=1,
            state="active",
            running=0,
            queued=0,
            batch_size=8,
            kv_utilization=0.1,
            prefill_tokens_per_s=40000,
            decode_tokens_per_s=2000,
            ttl_ms=1500,
            links=(Link(holder, 100000.0, 20.0),),
        )
        connector = aiohttp.TCPConnector(ssl=context("ii1"))
        async with aiohttp.ClientSession(connector=connector) as session:
            url = f"{base}/pc/instances/{role_id(instance)}/status"
            async with session.put(url, json=status.to_json()) as response:
                assert response.status == 200
                assert await response.json() == {"state": "active"}
        async with IndexClient(f"{base}/is/", context("holder1")) as publisher:
            for key in (K0, K1):
                await publisher.publish(
                    ReplicaRecord(
                        block_key=key,
                        compat_id=COMPAT_ID,
                        scope_id=SCOPE,
                        holder=holder,
                        codec=1,
                        size=1 << 20,
                        digest="sha-256:" + "0" * 64,
                        residency=(Residency("host", 0, 31),),
                        ttl_ms=60_000,
                    )
                )
        async with IndexClient(f"{base}/is/", context("alice")) as alice:
            query = LookupRequest(SCOPE, COMPAT_ID, (K0, K1), targets=(instance,))
            answer = await alice.lookup(query)
            assert answer.matched == 2
            [estimate] = answer.targets
            assert estimate.fetch_us == 20 + 2 * 8 * (1 << 20) / 100000
            assert estimate.recompute_us == 1e6 * 2 * 4 / 40000  # B = 4 (the descriptor)
            # PL2: the PC looks the prompt up in the IS and picks the instance.
            connector = aiohttp.TCPConnector(ssl=context("alice"))
            async with aiohttp.ClientSession(connector=connector) as session:
                body = {
                    "scope_id": SCOPE,
                    "compat_id": COMPAT_ID,
                    "block_keys": [K0, K1],
                    "tokens": 10,
                }
                async with session.post(f"{base}/pc/place", json=body) as response:
                    assert response.status == 200, await response.text()
                    choice = await response.json()
            assert choice["instance"] == instance and choice["matched"] == 2
            [candidate] = choice["candidates"]
            assert candidate["fetch_us"] == estimate.fetch_us
            # S1: the instance stops reporting; once expired it gets no estimate.
            deadline = time.monotonic() + 10
            while (await alice.lookup(query)).targets:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=20)
