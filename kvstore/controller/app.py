"""The Placement Controller's ASGI app: instance status and session checkpoints.

``PUT instances/{instance-id}/status`` (S1-S3) and
``PUT sessions/{session}/checkpoint`` (CK1, CK2). Only an instance may report,
and only for itself: its policy grant's ``instance`` base URI must hash to
``{instance-id}`` (H6) and equal the record's ``instance`` (SEC1).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route, Router

from ..http import EXCEPTION_HANDLERS, json_response, principal, read_json
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import Metrics, MetricsMiddleware
from ..protocol.control import InstanceStatus, SessionCheckpoint, StateChange
from ..protocol.problems import BadRequest, Forbidden
from ..protocol.wire import NO_STORE, role_id
from ..security import Grant, Policy
from .state import ControllerState


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    #: Public base URI of the PC (H7).
    controller_uri: str
    max_json_octets: int = 1 << 20
    allow_anonymous: bool = False

    @property
    def base_path(self) -> str:
        path = urlsplit(self.controller_uri).path or "/"
        return path if path.endswith("/") else path + "/"


def _instance_of(grant: Grant) -> str:
    if "instance" not in grant.roles or grant.instance is None:
        raise Forbidden("only inference instances report status and checkpoints")
    return grant.instance


def create_app(settings: ControllerSettings, state: ControllerState, policy: Policy) -> Starlette:
    def who(request: Request) -> str | None:
        return principal(request, settings.allow_anonymous)

    async def put_status(request: Request) -> Response:
        instance = _instance_of(policy.grant(who(request)))
        if role_id(instance) != request.path_params["instance_id"]:
            raise Forbidden("an instance reports only its own status (SEC1)")
        status = InstanceStatus.from_json(await read_json(request, settings.max_json_octets))
        if status.instance != instance:
            raise BadRequest("the record's instance is not the path's instance")
        answer = state.put_status(status)  # S2: stale epochs raise 409
        # S3: the answer carries the state the PC holds for the instance.
        return json_response(StateChange(answer).to_json())

    async def put_checkpoint(request: Request) -> Response:
        instance = _instance_of(policy.grant(who(request)))
        checkpoint = SessionCheckpoint.from_json(await read_json(request, settings.max_json_octets))
        if checkpoint.session != request.path_params["session"].lower():
            raise BadRequest("the checkpoint's session is not the path's session")
        entry = state.put_checkpoint(checkpoint, instance)  # CK2, CK7
        kept = entry.checkpoint.output_offset if entry.checkpoint is not None else 0
        # The acknowledgement a non-deterministic sampler waits for (CK3).
        return json_response({"epoch": entry.epoch, "output_offset": kept})

    metrics = Metrics()

    async def get_metrics(request: Request) -> Response:
        policy.require_any_role(who(request), ("metrics", "admin"))
        return Response(
            metrics.render(), headers={"Cache-Control": NO_STORE}, media_type=METRICS_CONTENT_TYPE
        )

    routes = [
        Route("/instances/{instance_id}/status", put_status, methods=["PUT"]),
        Route("/sessions/{session}/checkpoint", put_checkpoint, methods=["PUT"]),
    ]
    base = settings.base_path.rstrip("/")
    outside: list[BaseRoute] = [Route("/metrics", get_metrics, methods=["GET"])]
    inner = Router(routes, redirect_slashes=False)
    app = Starlette(
        routes=outside + ([Mount(base, app=inner)] if base else list(routes)),
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
    )
    app.router.redirect_slashes = False
    app.state.controller = state
    return app
