"""Baseline server for ``kvstore bench holder`` and ``bench load``: bare
uvicorn serving bytes from memory.

By default GET returns a fixed body and PUT reads the body and answers 201.
With ``--store`` (``bench load``) it keeps what is PUT under its path (412 if
held, as ``If-None-Match: *`` asks) and GET returns it (404 if not), a
``?layers=a-b`` range cut from the container: the same octets a holder moves
for the same traffic, with none of its checks. Same uvicorn, same TLS
settings as the holder, nothing else.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

BODY = b""
STORE: dict[str, bytes] | None = None


async def _answer(send: Any, status: int, body: bytes = b"") -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def stored(scope: Any, receive: Any, send: Any, store: dict[str, bytes]) -> None:
    path = scope["path"]
    if scope["method"] == "PUT":
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if path in store:
            await _answer(send, 412)
            return
        store[path] = b"".join(chunks)
        await _answer(send, 201)
        return
    body = store.get(path)
    if body is None:
        await _answer(send, 404)
        return
    query = scope.get("query_string", b"").decode()
    if query.startswith("layers="):
        from kvstore.protocol import container as kc

        a, b = (int(x) for x in query[len("layers=") :].split("-"))
        body = bytes(kc.decode(body).slice(a, b).tobytes())
    await _answer(send, 200, body)


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if STORE is not None:
        await stored(scope, receive, send, STORE)
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

    global BODY, STORE
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--octets", type=int, default=0)
    parser.add_argument("--store", action="store_true", help="keep what is PUT, GET it back")
    parser.add_argument("--tls-dir")
    args = parser.parse_args()
    BODY = bytes(args.octets)
    STORE = {} if args.store else None
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
