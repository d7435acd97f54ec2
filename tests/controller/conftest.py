"""Stand-in inference instances for the PC's directives, over real HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvstore.security import create_dev_certificates

from ..conftest import free_port


class Instances:
    """Stand-in inference instances under one server: ``/<name>/...``.

    Records every resume and prefetch; ``refuse`` names instances that
    answer 503."""

    def __init__(self) -> None:
        self.resumed: list[tuple[str, dict[str, Any]]] = []
        self.prefetched: list[tuple[str, dict[str, Any]]] = []
        self.states: list[tuple[str, dict[str, Any]]] = []
        self.reshards: list[tuple[str, dict[str, Any]]] = []
        self.slow: set[str] = set()  # answer reshard plans after 2 s
        self.refuse: set[str] = set()
        self.refused: list[str] = []  # the resumes refused
        self.port = free_port()

    def uri(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}/"

    def app(self) -> Starlette:
        async def resume(request: Request) -> Response:
            name = request.path_params["name"]
            if name in self.refuse:
                self.refused.append(name)
                return Response(status_code=503)
            self.resumed.append((name, json.loads(await request.body())))
            return Response(status_code=200)

        async def prefetch(request: Request) -> Response:
            body = json.loads(await request.body())
            self.prefetched.append((request.path_params["name"], body))
            return JSONResponse(
                {}, status_code=202, headers={"Location": f"prefetch/{body['directive']}"}
            )

        async def put_state(request: Request) -> Response:
            self.states.append((request.path_params["name"], json.loads(await request.body())))
            return Response(status_code=204)

        async def reshard(request: Request) -> Response:
            name = request.path_params["name"]
            body = json.loads(await request.body())
            self.reshards.append((name, body))
            if name in self.refuse:
                return Response(status_code=503)
            if name in self.slow and "to" in body:
                await asyncio.sleep(2)
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/{name}/reshard", reshard, methods=["POST"]),
                Route("/{name}/sessions/{session}/resume", resume, methods=["POST"]),
                Route("/{name}/prefetch", prefetch, methods=["POST"]),
                Route("/{name}/state", put_state, methods=["PUT"]),
            ]
        )


@pytest.fixture
async def instances() -> AsyncIterator[Instances]:
    found = Instances()
    config = uvicorn.Config(
        found.app(), host="127.0.0.1", port=found.port, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield found
    server.should_exit = True
    await task


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pc-directives")
    create_dev_certificates(directory, ["alice", "ii1"])
    return directory
