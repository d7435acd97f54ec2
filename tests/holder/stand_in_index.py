"""A stand-in Index Service over real HTTP (until the real IS exists): it validates
and records what holders publish and withdraw, and can be taken down."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvstore.protocol.records import ReplicaRecord
from kvstore.protocol.wire import role_id

from ..conftest import free_port


class StandInIndex:
    def __init__(self) -> None:
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}/is/"
        self.records: dict[str, ReplicaRecord] = {}
        self.log: list[tuple[str, str]] = []
        self.on_delete: Any = None
        self._runner: web.AppRunner | None = None

    async def _put(self, request: web.Request) -> web.Response:
        record = ReplicaRecord.from_json(await request.json())
        # P1: the path's holder id is the hash of the record's holder (H6).
        assert request.match_info["holder_id"] == role_id(record.holder)
        assert request.match_info["key"] == record.block_key
        self.records[record.block_key] = record
        self.log.append(("PUT", record.block_key))
        return web.Response(status=204)

    async def _delete(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        self.log.append(("DELETE", key))
        if self.on_delete is not None:
            self.on_delete(key)
        if self.records.pop(key, None) is None:
            return web.Response(status=404)
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_put("/is/replicas/{holder_id}/{key}", self._put)
        app.router.add_delete("/is/replicas/{holder_id}/{key}", self._delete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
