"""A holder killed during a client's GET (issue 9): the client sees the short
body, treats the replica as a miss and takes the block from the next one
(P4, BL8); nothing of the cut body is returned."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import uvicorn

from kvstore.backends.host import HostTier
from kvstore.client import HolderClient
from kvstore.holder import HolderSettings, create_app
from kvstore.security import Policy
from kvstore.storage import TieredStore

from ..conftest import free_port, wait_for_port
from ..storage.helpers import block, ref

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)
DYING = Path(__file__).resolve().parent / "dying_holder.py"


async def test_a_holder_dying_mid_get_is_a_miss_and_the_next_replica_serves(
    tmp_path: Path,
) -> None:
    data = block(section=256 << 10)  # 8 layers x 2 x 256 KiB: a few MiB
    (tmp_path / "block.kvb").write_bytes(data)
    port = free_port()
    uri = f"http://127.0.0.1:{port}/kvsp/"
    store = TieredStore([(HostTier(), 64 << 20)])
    await store.put(ref(1), data)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(HolderSettings(uri, allow_anonymous=True), store, OPEN),
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="off",
        )
    )
    task = asyncio.create_task(server.serve())
    dying_port = free_port()
    dying = subprocess.Popen(
        [sys.executable, str(DYING), str(dying_port), str(tmp_path / "block.kvb")],
        stdout=subprocess.PIPE,
    )
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        wait_for_port(dying_port)
        good = store.replica_record(ref(1), uri, 60_000)
        doomed = dataclasses.replace(good, holder=f"http://127.0.0.1:{dying_port}/kvsp/")
        async with HolderClient(timeout_s=10) as client:
            found = await client.fetch_first([doomed, good])
        assert dying.wait(timeout=10) == -9  # it died in the middle of the answer
        assert found is not None
        body, served_by = found
        assert served_by.holder == uri and body == data
    finally:
        if dying.poll() is None:
            dying.kill()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
