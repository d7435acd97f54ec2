"""Fixtures for the regression tests found in review.

The ASGI transport here returns 500s instead of raising, as a server would.
"""

import httpx as _httpx
import pytest

from tests.holder.conftest import (  # noqa: F401 (fixtures used by name)
    HOLDER,
    app,
    certs,
    publisher,
    store,
)
from tests.holder.conftest import AsPrincipal as _AP
from tests.holder.conftest import pem as _pem


@pytest.fixture
async def client_as(app, certs):  # noqa: F811 (the imported fixtures)
    clients = []

    def make(name):
        wrapped = _AP(app, _pem(certs, name) if name else None)
        c = _httpx.AsyncClient(
            transport=_httpx.ASGITransport(wrapped, raise_app_exceptions=False), base_url=HOLDER
        )
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.aclose()
