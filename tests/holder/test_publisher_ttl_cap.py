"""P2: the holder refreshes at a third of the TTL the IS grants, when the IS
caps the one asked for (a real IS app under uvicorn)."""

import asyncio
import socket

import uvicorn

from kvstore.backends.host import HostTier
from kvstore.client import IndexClient
from kvstore.holder.publisher import IndexPublisher
from kvstore.index import IndexSettings, MemoryState, create_app
from kvstore.security import Policy
from kvstore.storage import TieredStore
from tests.storage.helpers import COMPAT, SCOPE, block, ref, size_of

HOLDER = "https://holder.test/kvsp/"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


async def test_is_ttl_cap_ignored_by_publisher():
    port = free_port()
    uri = f"http://127.0.0.1:{port}/is/"
    policy = Policy.from_json(
        {
            "principals": {
                "anonymous": {
                    "roles": ["holder"],
                    "holder": HOLDER,
                    "read_scopes": ["*"],
                    "write_scopes": ["*"],
                }
            }
        }
    )
    state = MemoryState()
    app = create_app(IndexSettings(uri, max_ttl_ms=200, allow_anonymous=True), state, policy)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with IndexClient(uri) as client:
            store = TieredStore([(HostTier(), 10 * size_of())])
            p = IndexPublisher(client, store, HOLDER, ttl_ms=3000)  # refresh every 1 s
            await store.put(ref(1), block())
            p.start()
            seen = []
            for _ in range(8):
                await asyncio.sleep(0.1)
                seen.append((await state.lookup(SCOPE, COMPAT, [ref(1).block_key])).matched)
            await p.stop()
            assert all(seen), f"record visible at IS per 100 ms sample: {seen}"
    finally:
        server.should_exit = True
        await task
