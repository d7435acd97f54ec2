"""Baseline server for ``kvstore bench holder``: bare uvicorn serving bytes from memory.

GET returns a fixed body; PUT reads the body and answers 201. Same uvicorn,
same TLS settings as the holder, nothing else.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

BODY = b""


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "PUT":
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    headers = [
        (b"content-length", str(len(BODY)).encode()),
        (b"content-type", b"application/kvsp-block"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def main() -> None:
    import uvicorn

    global BODY
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--octets", type=int, required=True)
    parser.add_argument("--tls-dir")
    args = parser.parse_args()
    BODY = bytes(args.octets)
    options: dict[str, Any] = {}
    if args.tls_dir:
        options = {
            "ssl_certfile": f"{args.tls_dir}/server.pem",
            "ssl_keyfile": f"{args.tls_dir}/server.key",
            "ssl_ca_certs": f"{args.tls_dir}/ca.pem",
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
        }
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off", **options
    )


if __name__ == "__main__":
    main()
