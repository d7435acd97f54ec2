"""docs/openapi/: one OpenAPI 3.1 document per role, as kvstore.openapi builds
them, and schemathesis against each role's app (in-process ASGI, a policy
that lets the anonymous principal do everything, so that generated input
reaches the handlers): no 5xx on any generated input, and every response
matches its documented status, media type and schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from kvstore.backends.host import HostTier
from kvstore.controller.app import create_app as create_controller
from kvstore.controller.state import MemoryControllerState
from kvstore.holder import HolderSettings
from kvstore.holder import create_app as create_holder
from kvstore.index import IndexSettings, MemoryState
from kvstore.index import create_app as create_index
from kvstore.instance.app import create_app as create_instance
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.openapi import ROLES, document, render
from kvstore.security import Policy
from kvstore.settings import ControllerSettings, InstanceSettings
from kvstore.storage import TieredStore

DOCS = Path(__file__).resolve().parent.parent / "docs" / "openapi"
ANYONE = Policy.from_json(
    {
        "principals": {
            "anonymous": {
                "roles": ["admin", "metrics", "pc", "holder", "instance"],
                "read_scopes": ["*"],
                "write_scopes": ["*"],
                "holder": "http://test/kvsp/",
                "instance": "http://test/ii/",
            }
        }
    }
)


@schemathesis.serializer("application/kvsp-block")
def _block(ctx: Any, value: Any) -> bytes:
    # Generated bodies go as they are: mostly not containers (400 expected).
    return value if isinstance(value, bytes) else str(value).encode()


def test_the_documents_are_current() -> None:
    for role in ROLES:
        assert (DOCS / f"{role}.json").read_text() == render(role), (
            f"docs/openapi/{role}.json is stale: kvstore openapi {role} > docs/openapi/{role}.json"
        )


def _apps() -> dict[str, tuple[str, Callable[[], Any]]]:
    def holder() -> Any:
        store = TieredStore([(HostTier(), 16 << 20)])
        return create_holder(
            HolderSettings("http://test/kvsp/", allow_anonymous=True), store, ANYONE
        )

    def index() -> Any:
        return create_index(
            IndexSettings("http://test/is/", allow_anonymous=True), MemoryState(), ANYONE
        )

    def controller() -> Any:
        return create_controller(
            ControllerSettings("http://test/pc/", allow_anonymous=True),
            MemoryControllerState(),
            ANYONE,
        )

    def instance() -> Any:
        store = TieredStore([(HostTier(), 16 << 20)])
        return create_instance(
            InstanceSettings("http://test/ii/", allow_anonymous=True),
            Prefetcher(store, None),
            ANYONE,
            Lifecycle(),
        )

    return {
        "holder": ("/kvsp/", holder),
        "index": ("/is/", index),
        "controller": ("/pc/", controller),
        "instance": ("/ii/", instance),
    }


class Served:
    """The role's app, and its document at /openapi.json."""

    def __init__(self, role: str) -> None:
        base, make = _apps()[role]
        self.app = make()
        spec = document(role)
        spec["servers"] = [{"url": base}]
        self.spec = json.dumps(spec).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/openapi.json":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": self.spec})
            return
        await self.app(scope, receive, send)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _schema(role: str) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", Served(role))


holder_schema = _schema("holder")
index_schema = _schema("index")
controller_schema = _schema("controller")
instance_schema = _schema("instance")


@holder_schema.parametrize()
@SETTINGS
def test_holder_api(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


@index_schema.parametrize()
@SETTINGS
def test_index_api(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


@controller_schema.parametrize()
@SETTINGS
def test_controller_api(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


@instance_schema.parametrize()
@SETTINGS
def test_instance_api(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


@pytest.mark.parametrize("role", ROLES)
def test_every_route_is_documented(role: str) -> None:
    # The document and the app agree on the resources (ours marked as such).
    from starlette.routing import Mount

    base, make = _apps()[role]
    app = make()
    mounted = next(r for r in app.routes if isinstance(r, Mount))
    routes = {
        (r.path, m)
        for r in mounted.routes
        for m in (r.methods or ())  # type: ignore[attr-defined]
        if m != "HEAD" and r.path != "/metrics"
    }
    documented = {
        (p, m.upper())
        for p, ops in document(role)["paths"].items()
        for m in ops
        if m != "parameters"
    }
    assert routes == documented, base
