"""A Placement Controller and an Index Service as separate processes over one
Redis, all over mutual TLS: the IS estimates from the status the PC recorded
(L2, PL1), and a PC killed and started again continues from Redis (S2, CK2)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from kvstore.client import IndexClient
from kvstore.protocol.control import InstanceStatus, Link, Sampler, SessionCheckpoint
from kvstore.protocol.records import LookupRequest, ReplicaRecord, Residency
from kvstore.protocol.residency import ResidencyGroup, ResidencyUpdate
from kvstore.protocol.wire import role_id
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..protocol.vectors import COMPAT_ID, DESCRIPTOR, K0, K1
from .test_index import SERVER, Process

SCOPE = "a" * 32
HOLDER, INSTANCE = "https://h1.test/kvsp/", "https://ii1.test/kvsp/"
POD = "https://vllm-0.test:8000/"


def status(epoch: int) -> InstanceStatus:
    return InstanceStatus(
        instance=INSTANCE,
        epoch=epoch,
        state="active",
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=40000,
        decode_tokens_per_s=2000,
        ttl_ms=60_000,
        links=(Link(HOLDER, 100000.0, 20.0),),
    )


def context(root: Path, name: str) -> Any:
    """A client context with ``name``'s development certificate under ``root``."""
    certs = root / "certs"
    return client_context(
        str(certs / "ca.pem"), str(certs / f"client-{name}.pem"), str(certs / f"client-{name}.key")
    )


async def publish_k0_k1(index_uri: str, root: Path) -> None:
    """holder1 publishes its records of K0 and K1 at the IS."""
    async with IndexClient(index_uri, context(root, "holder1")) as publisher:
        for key in (K0, K1):
            await publisher.publish(
                ReplicaRecord(
                    block_key=key,
                    compat_id=COMPAT_ID,
                    scope_id=SCOPE,
                    holder=HOLDER,
                    codec=1,
                    size=1 << 20,
                    digest="sha-256:" + "0" * 64,
                    residency=(Residency("host", 0, 31),),
                    ttl_ms=60_000,
                )
            )


async def test_pc_and_is_share_redis(tmp_path: Path, redis_server: Any) -> None:
    create_dev_certificates(tmp_path / "certs", ["holder1", "ii1", "alice"])
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR))
    ports = {"pc": free_port(), "pc2": free_port(), "index": free_port()}
    uris = {name: f"https://127.0.0.1:{port}/{name}/" for name, port in ports.items()}
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:holder1": {
                        "roles": ["holder"],
                        "holder": HOLDER,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:ii1": {
                        "roles": ["instance"],
                        "instance": INSTANCE,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:alice": {"read_scopes": [SCOPE]},
                }
            }
        )
    )
    prefix = f"it{uuid.uuid4().hex[:8]}"
    shared = f"""
state = "redis"
redis_url = "{redis_server.url}"
redis_prefix = "{prefix}-pc:"
policy = "policy.json"
descriptors = ["descriptor.json"]
"""

    def pc(name: str) -> Process:
        config = SERVER.format(port=ports[name]) + f'[controller]\nuri = "{uris[name]}"' + shared
        return Process(tmp_path, name, config, "pc")

    # The IS process runs no PC: it reads the PC's Redis for instance status.
    index = Process(
        tmp_path,
        "index",
        SERVER.format(port=ports["index"])
        + f"""
[index]
uri = "{uris["index"]}"
policy = "policy.json"
state = "redis"
redis_url = "{redis_server.url}"
redis_prefix = "{prefix}-is:"
descriptors = ["descriptor.json"]
[controller]"""
        + shared,
        "index",
    )

    first, second = pc("pc"), pc("pc2")
    first.start(ports["pc"])
    index.start(ports["index"])
    try:
        connector = aiohttp.TCPConnector(ssl=context(tmp_path, "ii1"))
        async with aiohttp.ClientSession(connector=connector) as ii1:

            async def report(base: str, epoch: int) -> int:
                url = f"{base}instances/{role_id(INSTANCE)}/status"
                async with ii1.put(url, json=status(epoch).to_json()) as response:
                    return response.status

            assert await report(uris["pc"], 7) == 200
            session = str(uuid.uuid4())
            checkpoint = SessionCheckpoint(
                session=session,
                epoch=1,
                compat_id=COMPAT_ID,
                scope_id=SCOPE,
                prompt_blocks=(K0,),
                prompt_tail=(5,),
                generated=(1, 2, 3),
                output_offset=3,
                sampler=Sampler("greedy", seed=1, step=3, deterministic=True),
            )
            url = f"{uris['pc']}sessions/{session}/checkpoint"
            async with ii1.put(url, json=checkpoint.to_json()) as response:
                assert response.status == 200, await response.text()

            await publish_k0_k1(uris["index"], tmp_path)
            query = LookupRequest(SCOPE, COMPAT_ID, (K0, K1), targets=(INSTANCE,))
            async with IndexClient(uris["index"], context(tmp_path, "alice")) as alice:
                answer = await alice.lookup(query)
                assert answer.matched == 2
                [estimate] = answer.targets  # from the status the PC process stored
                assert estimate.fetch_us == 20 + 2 * 8 * (1 << 20) / 100000
                assert estimate.recompute_us == 1e6 * 2 * 4 / 40000

                # The PC dies; another PC process continues from Redis.
                first.stop(signal.SIGKILL)
                second.start(ports["pc2"])
                assert await report(uris["pc2"], 6) == 409  # S2: epoch 7 was seen
                # CK2 across processes: a late, lower checkpoint keeps offset 3.
                lower = dataclasses.replace(checkpoint, output_offset=2, generated=(1, 2))
                url = f"{uris['pc2']}sessions/{session}/checkpoint"
                async with ii1.put(url, json=lower.to_json()) as response:
                    assert response.status == 200
                    assert await response.json() == {"epoch": 1, "output_offset": 3}
                assert await report(uris["pc2"], 8) == 200
                assert (await alice.lookup(query)).targets == (estimate,)
    finally:
        for process in (first, second, index):
            process.stop()


async def test_two_replicated_is_processes_answer_from_memory(
    tmp_path: Path, redis_server: Any
) -> None:
    # [index] state = "replicated": a record published at one IS process is
    # answered by the other; a killed IS process started again rebuilds the
    # index from the log before it answers. So is an engine's residency
    # (kvstore events), told at one and answered by the other.
    create_dev_certificates(tmp_path / "certs", ["holder1", "alice", "pod"])
    ports = {"is1": free_port(), "is2": free_port()}
    uris = {name: f"https://127.0.0.1:{port}/is/" for name, port in ports.items()}
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:holder1": {
                        "roles": ["holder"],
                        "holder": HOLDER,
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:alice": {"read_scopes": [SCOPE]},
                    "urn:kvstore:pod": {
                        "roles": ["instance"],
                        "instance": POD,
                        "write_scopes": [SCOPE],
                    },
                }
            }
        )
    )
    prefix = f"it{uuid.uuid4().hex[:8]}-rep:"

    def index(name: str) -> Process:
        return Process(
            tmp_path,
            name,
            SERVER.format(port=ports[name])
            + f"""
[index]
uri = "{uris[name]}"
policy = "policy.json"
state = "replicated"
redis_url = "{redis_server.url}"
redis_prefix = "{prefix}"
""",
            "index",
        )

    first, second = index("is1"), index("is2")
    first.start(ports["is1"])
    second.start(ports["is2"])
    query = LookupRequest(SCOPE, COMPAT_ID, (K0, K1))
    try:
        await publish_k0_k1(uris["is1"], tmp_path)
        async with IndexClient(uris["is1"], context(tmp_path, "pod")) as pod:
            told = await pod.tell_residency(
                ResidencyUpdate(
                    POD, 60_000, add=(ResidencyGroup(SCOPE, COMPAT_ID, "GPU", (K0, K1)),)
                )
            )
            assert not told.known and told.records == 2
        async with IndexClient(uris["is2"], context(tmp_path, "alice")) as alice:
            for _ in range(100):  # the log's lag: milliseconds
                answer = await alice.lookup(query)
                if answer.matched == 2 and answer.resident:
                    break
                await asyncio.sleep(0.02)
            assert answer.matched == 2
            assert [(r.instance, r.prefix_blocks) for r in answer.resident] == [(POD, 2)]
        second.stop(signal.SIGKILL)
        second.start(ports["is2"])
        async with IndexClient(uris["is2"], context(tmp_path, "alice")) as alice:
            answer = await alice.lookup(query)
            assert answer.matched == 2  # rebuilt from the log
            assert [(r.instance, r.prefix_blocks) for r in answer.resident] == [(POD, 2)]
    finally:
        first.stop()
        second.stop()
