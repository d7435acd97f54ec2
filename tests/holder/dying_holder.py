"""A holder that dies in the middle of a GET: it answers the headers of the
block given on the command line and half of its body, then kills itself
(SIGKILL), as a holder process crashing mid-transfer would look to a client."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import signal
import sys
from pathlib import Path


async def main(port: int, body: bytes) -> None:
    digest = base64.b64encode(hashlib.sha256(body).digest()).decode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            (
                f"HTTP/1.1 200 OK\r\nContent-Type: application/kvsp-block\r\n"
                f"Content-Length: {len(body)}\r\nRepr-Digest: sha-256=:{digest}:\r\n"
                "Cache-Control: private, immutable\r\n\r\n"
            ).encode()
        )
        writer.write(body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2]).read_bytes()))
