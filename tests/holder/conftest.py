"""Holder fixtures: development certificates and an app wrapped as a given principal."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.backends.host import HostTier
from kvstore.holder import HolderSettings, create_app
from kvstore.protocol.compat import parse_descriptor
from kvstore.security import Policy, create_dev_certificates
from kvstore.storage import BlockRef, LeaseLimits, TieredStore

from ..protocol.vectors import DESCRIPTOR
from ..storage.helpers import SCOPE

HOLDER = "https://holder.test/kvsp/"
OTHER_SCOPE = "f" * 32

# A small geometry the storage helpers' blocks fit: 8 layers, 4 tokens, 1 x 32 fp16.
SMALL = parse_descriptor(
    dict(DESCRIPTOR, layers=8, kv_heads=1, head_dim=32, kv_dtype="fp16", block_tokens=4)
)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    create_dev_certificates(directory, ["alice", "bob", "mallory", "holder1"])
    return directory


def pem(certs: Path, name: str) -> str:
    return (certs / f"client-{name}.pem").read_text()


POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:alice": {"read_scopes": [SCOPE], "write_scopes": [SCOPE]},
            "urn:kvstore:bob": {"read_scopes": [OTHER_SCOPE], "write_scopes": [OTHER_SCOPE]},
            "urn:kvstore:holder1": {"roles": ["holder", "metrics"], "read_scopes": ["*"]},
        }
    }
)


class AsPrincipal:
    """ASGI wrapper that presents a client certificate, as the TLS layer would."""

    def __init__(self, app: Any, cert_pem: str | None) -> None:
        self.app, self.cert_pem = app, cert_pem

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.cert_pem is not None:
            tls = {"client_cert_chain": [self.cert_pem], "tls_version": 0x0304}
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), "tls": tls}}
        await self.app(scope, receive, send)


class RecordingPublisher:
    """A listener of the store's events, as the holder's publisher is one."""

    def __init__(self, store: TieredStore | None = None) -> None:
        self.events: list[tuple[str, BlockRef]] = []
        if store is not None:
            store.events.subscribe(self)

    def stored(self, ref: BlockRef) -> None:
        self.events.append(("published", ref))

    async def evicting(self, ref: BlockRef, reason: str) -> None:
        self.events.append(("withdrawn", ref))


@pytest.fixture
def store() -> TieredStore:
    return TieredStore([(HostTier(), 64 << 20)], lease_limits=LeaseLimits(max_ttl_ms=10_000))


@pytest.fixture
def publisher(store: TieredStore) -> RecordingPublisher:
    return RecordingPublisher(store)


@pytest.fixture
def app(store: TieredStore, publisher: RecordingPublisher) -> Any:
    settings = HolderSettings(
        HOLDER,
        max_block_octets=1 << 20,
        known_descriptors={SMALL.compat_id_hex: SMALL},
        descriptors_only=False,  # the tests' blocks are under COMPAT, no descriptor's
    )
    return create_app(settings, store, POLICY)


ClientFactory = Callable[[str | None], httpx.AsyncClient]


@pytest.fixture
async def client_as(app: Any, certs: Path) -> AsyncIterator[ClientFactory]:
    clients: list[httpx.AsyncClient] = []

    def make(name: str | None) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, pem(certs, name) if name else None)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=HOLDER)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
async def served_as(app: Any, certs: Path) -> AsyncIterator[ClientFactory]:
    """Like ``client_as``, but an exception in the app is a 500 answer, as a
    server would give, instead of raised into the test."""
    clients: list[httpx.AsyncClient] = []

    def make(name: str | None) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, pem(certs, name) if name else None)
        transport = httpx.ASGITransport(wrapped, raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url=HOLDER)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()
