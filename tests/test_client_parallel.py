"""kvstore.client fetching several blocks of a holder at once (issue 19):
every one still verified (BL6), a byte corrupted on the way caught, the
order of the answer the order asked, the concurrency bounded."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from kvstore.backends.host import HostTier
from kvstore.client import HolderClient
from kvstore.holder import HolderSettings, create_app
from kvstore.protocol.problems import DigestMismatch
from kvstore.protocol.records import ReplicaRecord
from kvstore.security import Policy
from kvstore.storage import TieredStore

from .storage.helpers import COMPAT, SCOPE, block, ref

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)


class Corrupting:
    """Flips one octet of the body of GETs whose path names ``key``, and
    counts the GETs in flight at once."""

    def __init__(self, app: Any) -> None:
        self.app, self.key = app, ""
        self.in_flight = self.most = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        flip = bool(self.key) and self.key in scope["path"]
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)

        async def sending(message: Any) -> None:
            nonlocal flip
            body = message.get("body", b"")
            if flip and message["type"] == "http.response.body" and len(body) > 200:
                changed = bytearray(body)
                changed[-100] ^= 0x01
                message = {**message, "body": bytes(changed)}
                flip = False
            await send(message)

        try:
            await asyncio.sleep(0.01)  # long enough for the others to arrive
            await self.app(scope, receive, sending)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Corrupting]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{sock.getsockname()[1]}/kvsp/"
    store = TieredStore([(HostTier(), 64 << 20)])
    app = Corrupting(create_app(HolderSettings(uri, allow_anonymous=True), store, OPEN))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield uri, app
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_several_blocks_at_once_each_verified(served: tuple[str, Corrupting]) -> None:
    uri, app = served
    keys = [ref(n).block_key for n in range(12)]
    bodies = [block() for _ in keys]
    async with HolderClient(fetch_threads=8) as client:
        records: list[ReplicaRecord | None] = [
            await client.put_block(uri, COMPAT, SCOPE, k, b)
            for k, b in zip(keys, bodies, strict=True)
        ]
        got = await client.get_blocks(uri, COMPAT, SCOPE, keys, records=records, concurrency=4)
        assert got == bodies
        assert app.most == 4  # in parallel, and no more than asked
        app.key = keys[7]  # one octet of one block corrupted on the way
        for given in (records, None):  # layer digests, or Repr-Digest alone
            app.key = keys[7]
            with pytest.raises(DigestMismatch):
                await client.get_blocks(uri, COMPAT, SCOPE, keys, records=given)
        with pytest.raises(ValueError):
            await client.get_blocks(uri, COMPAT, SCOPE, keys, records=records[:2])
