"""A PC process moves the session of an instance that stopped reporting to
another instance, over mutual TLS (S1, CK5, CK7, SEC1). The instances are
stand-ins in this process that accept directives only from the PC's
certificate (the Inference Instance role is its own issue)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvstore.config import Config, ServerConfig
from kvstore.http import principal
from kvstore.listener import uvicorn_config
from kvstore.protocol.control import InstanceStatus, ResumeRequest, Sampler, SessionCheckpoint
from kvstore.protocol.wire import role_id
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..protocol.vectors import COMPAT_ID, DESCRIPTOR, K0
from .test_index import SERVER, Process

SCOPE = "a" * 32


async def test_sessions_move_off_an_instance_that_stopped_reporting(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    create_dev_certificates(certs, ["pc", "ii1", "ii2", "mallory"])
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR))
    ii_port, pc_port = free_port(), free_port()
    ii = {name: f"https://127.0.0.1:{ii_port}/{name}/" for name in ("ii1", "ii2")}
    pc_uri = f"https://127.0.0.1:{pc_port}/pc/"
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:ii1": {
                        "roles": ["instance"],
                        "instance": ii["ii1"],
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:ii2": {
                        "roles": ["instance"],
                        "instance": ii["ii2"],
                        "write_scopes": ["*"],
                    },
                }
            }
        )
    )

    resumed: list[tuple[str, str | None, dict[str, Any]]] = []

    async def resume(request: Request) -> Response:
        who = principal(request)
        if who != "urn:kvstore:pc":
            return Response(status_code=403)  # SEC1: directives only from the PC
        resumed.append((request.path_params["name"], who, json.loads(await request.body())))
        return Response(status_code=200)

    app = Starlette(routes=[Route("/{name}/sessions/{session}/resume", resume, methods=["POST"])])
    server_cfg = ServerConfig(
        host="127.0.0.1",
        port=ii_port,
        certfile=str(certs / "server.pem"),
        keyfile=str(certs / "server.key"),
        cafile=str(certs / "ca.pem"),
    )
    stand_in = uvicorn.Server(uvicorn_config(Config(server=server_cfg), app))
    serving = asyncio.create_task(stand_in.serve())
    pc = Process(
        tmp_path,
        "pc",
        SERVER.format(port=pc_port)
        + f"""
[controller]
uri = "{pc_uri}"
policy = "policy.json"
descriptors = ["descriptor.json"]
client_certfile = "certs/client-pc.pem"
client_keyfile = "certs/client-pc.key"
migrate_interval_s = 0.2
""",
        "pc",
    )
    try:
        while not stand_in.started:
            await asyncio.sleep(0.01)
        pc.start(pc_port)

        def session_for(name: str) -> aiohttp.ClientSession:
            context = client_context(
                str(certs / "ca.pem"),
                str(certs / f"client-{name}.pem"),
                str(certs / f"client-{name}.key"),
            )
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))

        async with session_for("ii1") as ii1, session_for("ii2") as ii2:
            for client, name, ttl in ((ii1, "ii1", 1000), (ii2, "ii2", 60_000)):
                record = InstanceStatus(
                    instance=ii[name],
                    epoch=1,
                    state="active",
                    running=1,
                    queued=0,
                    batch_size=8,
                    kv_utilization=0.2,
                    prefill_tokens_per_s=40000,
                    decode_tokens_per_s=3000,
                    ttl_ms=ttl,
                )
                url = f"{pc_uri}instances/{role_id(ii[name])}/status"
                async with client.put(url, json=record.to_json()) as response:
                    assert response.status == 200
            session = str(uuid.uuid4())
            checkpoint = SessionCheckpoint(
                session=session,
                epoch=1,
                compat_id=COMPAT_ID,
                scope_id=SCOPE,
                prompt_blocks=(K0,),
                prompt_tail=(7,),
                generated=(1, 2),
                output_offset=2,
                sampler=Sampler("top-p", seed=3, step=2, deterministic=False, params={"p": 0.9}),
            )
            url = f"{pc_uri}sessions/{session}/checkpoint"
            async with ii1.put(url, json=checkpoint.to_json()) as response:
                assert response.status == 200
            # ii1 stops reporting: failed after its 1 s TTL (S1); the PC moves it.
            deadline = time.monotonic() + 15
            while not resumed:
                assert time.monotonic() < deadline, (tmp_path / "pc.log").read_text()
                await asyncio.sleep(0.1)
            [(name, who, body)] = resumed
            request = ResumeRequest.from_json(body)
            assert name == "ii2" and who == "urn:kvstore:pc"
            assert request.epoch == 2 and request.checkpoint == checkpoint
            # CK7: the failed instance, back, cannot extend the session; the
            # new owner can, at the new epoch.
            later = dataclasses.replace(checkpoint, generated=(1, 2, 5), output_offset=3)
            async with ii1.put(url, json=later.to_json()) as response:
                assert response.status == 409
                assert (await response.json())["type"].endswith("kvsp-stale-epoch")
            later = dataclasses.replace(later, epoch=2)
            async with ii1.put(url, json=later.to_json()) as response:
                assert response.status == 403
            async with ii2.put(url, json=later.to_json()) as response:
                assert response.status == 200
                assert await response.json() == {"epoch": 2, "output_offset": 3}
    finally:
        pc.stop()
        stand_in.should_exit = True
        await serving
