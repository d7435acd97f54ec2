"""The ASGI ``tls`` extension our uvicorn protocols add (fails if an upgrade breaks it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn

from kvstore.security import create_dev_certificates
from kvstore.tls import (
    PRINCIPAL,
    TLSH11Protocol,
    TLSHttpToolsProtocol,
    client_context,
    principal_from_scope,
)

from ..conftest import free_port


async def echo(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    tls = (scope.get("extensions") or {}).get("tls") or {}
    body = json.dumps(
        {
            "principal": principal_from_scope(scope),
            "tls_version": tls.get("tls_version"),
            "per_connection": tls.get(PRINCIPAL),
            "tls_id": id(tls),
        }
    ).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, protocol: type) -> AsyncIterator[tuple[int, ssl.SSLContext]]:
    """``echo`` under uvicorn with ``protocol``, TLS 1.3 and client certificates."""
    create_dev_certificates(tmp_path, ["carol"])
    port = free_port()
    config = uvicorn.Config(
        echo,
        host="127.0.0.1",
        port=port,
        http=protocol,
        lifespan="off",
        log_level="warning",
        ssl_certfile=str(tmp_path / "server.pem"),
        ssl_keyfile=str(tmp_path / "server.key"),
        ssl_ca_certs=str(tmp_path / "ca.pem"),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        yield (
            port,
            client_context(
                str(tmp_path / "ca.pem"),
                str(tmp_path / "client-carol.pem"),
                str(tmp_path / "client-carol.key"),
            ),
        )
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("protocol", [TLSH11Protocol, TLSHttpToolsProtocol])
async def test_principal_reaches_the_app(tmp_path: Path, protocol: type) -> None:
    async with serving(tmp_path, protocol) as (port, context):
        connector = aiohttp.TCPConnector(ssl=context)
        async with aiohttp.ClientSession(connector=connector) as session:
            answers = []
            for _ in range(2):  # two requests on one connection: both carry it
                async with session.get(f"https://127.0.0.1:{port}/") as response:
                    answers.append(json.loads(await response.read()))
        for seen in answers:
            assert seen["principal"] == seen["per_connection"] == "urn:kvstore:carol"
            assert seen["tls_version"] == 0x0304
        # SEC1: the principal was taken at the handshake, once: both requests
        # of the connection carry the very same extension.
        assert answers[0]["tls_id"] == answers[1]["tls_id"]


async def test_http2_carries_the_principal_too(tmp_path: Path) -> None:
    # H1 SHOULD: HTTP/2 by ALPN, with the same client-certificate identity.
    import httpx

    from kvstore.tls import http2_protocol

    async with serving(tmp_path, http2_protocol()) as (port, context):
        async with httpx.AsyncClient(verify=context, http2=True) as client:
            response = await client.get(f"https://127.0.0.1:{port}/")
        assert response.http_version == "HTTP/2"
        seen = response.json()
        assert seen["principal"] == seen["per_connection"] == "urn:kvstore:carol"
        assert seen["tls_version"] == 0x0304
