"""The Inference Instance's ASGI app: the KVSP resources the PC drives.

``POST prefetch`` (202 + ``Location``) and ``GET prefetch/{id}`` (PF1, PF3),
``PUT state`` (S3, S6). Each is accepted only from a principal with the
``pc`` role (SEC1, PF5: directives only from the PC). Resume and reshard
come with the rest of the instance role.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http import base_path, json_response, principal, read_json, role_app
from ..metrics import Metrics
from ..protocol.control import StateChange
from ..protocol.problems import BadRequest, InvalidState
from ..protocol.records import PrefetchDirective
from ..protocol.wire import NO_STORE
from ..security import Policy
from .prefetch import Prefetcher


@dataclass(frozen=True, slots=True)
class InstanceSettings:
    #: Public base URI of the instance (H7): what it reports as.
    instance_uri: str
    max_json_octets: int = 4 << 20
    max_directive_blocks: int = 8192
    allow_anonymous: bool = False

    @property
    def base_path(self) -> str:
        return base_path(self.instance_uri)


@dataclass
class Lifecycle:
    """The instance's state (S3-S6): ``active``, ``draining`` or ``sleeping``."""

    state: str = "active"
    #: Counts the PC's ``PUT state`` changes: an answer to a status report
    #: sent before the latest change must not undo it.
    changes: int = 0

    def set_by_pc(self, state: str) -> None:
        self.state = state
        self.changes += 1


def create_app(
    settings: InstanceSettings, prefetcher: Prefetcher, policy: Policy, lifecycle: Lifecycle
) -> Starlette:
    def from_pc(request: Request) -> None:
        policy.require_role(principal(request, settings.allow_anonymous), "pc")

    async def post_prefetch(request: Request) -> Response:
        from_pc(request)
        directive = PrefetchDirective.from_json(
            await read_json(request, settings.max_json_octets),
            max_blocks=settings.max_directive_blocks,
        )
        if lifecycle.state != "active":
            raise InvalidState(f"the instance is {lifecycle.state} (S4)")
        run = prefetcher.submit(directive)  # PF5: 429 beyond the pending quota
        location = f"{settings.base_path}prefetch/{directive.directive}"
        return json_response(run.status().to_json(), status=202,
                             headers={"Location": location, "Cache-Control": NO_STORE})  # fmt: skip

    async def get_prefetch(request: Request) -> Response:
        from_pc(request)
        return json_response(prefetcher.status(request.path_params["directive"].lower()).to_json())

    async def put_state(request: Request) -> Response:
        # S3, S6: the PC changes the instance's state; a sleeping instance
        # becomes active only this way.
        from_pc(request)
        change = StateChange.from_json(await read_json(request, settings.max_json_octets))
        if change.state == "failed":
            raise BadRequest("state: failed is not a state the PC sets")
        lifecycle.set_by_pc(change.state)
        return json_response(change.to_json())

    metrics = Metrics()
    routes = [
        Route("/prefetch", post_prefetch, methods=["POST"]),
        Route("/prefetch/{directive}", get_prefetch, methods=["GET"]),
        Route("/state", put_state, methods=["PUT"]),
    ]
    app = role_app(settings.base_path, routes, metrics, policy, settings.allow_anonymous)
    app.state.prefetcher = prefetcher
    app.state.lifecycle = lifecycle
    return app
