"""The Placement Controller's ASGI app: instance status and session checkpoints.

``PUT instances/{instance-id}/status`` (S1-S3),
``PUT sessions/{session}/checkpoint`` (CK1, CK2), and our ``POST place``
(not KVSP): the cheapest active instance for a prompt, with the estimates
that made the choice (PL1, PL2). Only an instance may report,
and only for itself: its policy grant's ``instance`` base URI must hash to
``{instance-id}`` (H6) and equal the record's ``instance`` (SEC1).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http import base_path, json_response, principal, read_json, role_app
from ..metrics import Metrics
from ..protocol._json import check_int
from ..protocol.control import InstanceStatus, SessionCheckpoint, StateChange
from ..protocol.placement import shape_groups
from ..protocol.problems import BadRequest, Forbidden, KvspError
from ..protocol.records import LookupRequest, ReplicaShape
from ..protocol.wire import role_id
from ..security import Grant, Policy
from .placement import choose, rank
from .state import ControllerState


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    #: Public base URI of the PC (H7).
    controller_uri: str
    max_json_octets: int = 1 << 20
    allow_anonymous: bool = False
    #: block_tokens per compat_id (from descriptors), for recompute estimates.
    block_tokens: Mapping[str, int] = field(default_factory=dict)
    #: Mean service time of a queued request, for wait_us (PL1).
    mean_service_ms: float = 0.0
    #: Most block keys in one placement request.
    max_place_keys: int = 8192
    #: Largest checkpoint accepted (it is kept per session).
    max_checkpoint_octets: int = 256 << 10

    @property
    def base_path(self) -> str:
        return base_path(self.controller_uri)


log = logging.getLogger("kvstore.controller")


def _instance_of(grant: Grant) -> str:
    if "instance" not in grant.roles or grant.instance is None:
        raise Forbidden("only inference instances report status and checkpoints")
    return grant.instance


def create_app(
    settings: ControllerSettings,
    state: ControllerState,
    policy: Policy,
    index: Any = None,
) -> Starlette:
    """``index``: a :class:`kvstore.client.IndexClient` for placement lookups."""

    def who(request: Request) -> str | None:
        return principal(request, settings.allow_anonymous)

    async def put_status(request: Request) -> Response:
        instance = _instance_of(policy.grant(who(request)))
        if role_id(instance) != request.path_params["instance_id"]:
            raise Forbidden("an instance reports only its own status (SEC1)")
        status = InstanceStatus.from_json(await read_json(request, settings.max_json_octets))
        if status.instance != instance:
            raise BadRequest("the record's instance is not the path's instance")
        answer = await state.put_status(status)  # S2: stale epochs raise 409
        # S3: the answer carries the state the PC holds for the instance.
        return json_response(StateChange(answer).to_json())

    async def put_checkpoint(request: Request) -> Response:
        instance = _instance_of(policy.grant(who(request)))
        checkpoint = SessionCheckpoint.from_json(
            await read_json(request, settings.max_checkpoint_octets)
        )
        # SEC1: the instance must be allowed to write the session's scope.
        policy.require_write(who(request), checkpoint.scope_id)
        if checkpoint.session != request.path_params["session"].lower():
            raise BadRequest("the checkpoint's session is not the path's session")
        entry = await state.put_checkpoint(checkpoint, instance)  # CK2, CK7
        kept = entry.checkpoint.output_offset if entry.checkpoint is not None else 0
        # The acknowledgement a non-deterministic sampler waits for (CK3).
        return json_response({"epoch": entry.epoch, "output_offset": kept})

    async def place(request: Request) -> Response:
        # Ours, not KVSP: where should this request go, and why (PL1, PL2).
        body = await read_json(request, settings.max_json_octets)
        query = LookupRequest.from_json(body, max_keys=settings.max_place_keys)
        policy.require_read(who(request), query.scope_id)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        block_tokens = settings.block_tokens.get(query.compat_id)
        if block_tokens is None:
            raise BadRequest("unknown compat_id: the PC needs its descriptor (block_tokens)")
        total = (
            check_int(tokens, "place.tokens", lo=0)
            if tokens is not None
            else (len(query.block_keys) * block_tokens)
        )
        groups: list[tuple[tuple[ReplicaShape, ...], int]] = []
        index_state = "unused"
        if index is not None and query.block_keys:
            try:
                # Shapes, not records, are all placement reads (ours; an IS
                # that does not know shapes_only answers with records).
                answer = await index.lookup(
                    LookupRequest(
                        query.scope_id, query.compat_id, query.block_keys, shapes_only=True
                    )
                )
                groups = (answer.shapes.counts() if answer.shapes is not None
                          else shape_groups(answer.replicas))  # fmt: skip
                index_state = "ok"
            except KvspError as exc:
                # The index is advisory (P4): without it, every instance
                # recomputes, and the placement still happens.
                log.warning("index lookup failed, placing without cache: %s", exc.detail)
                index_state = "unavailable"
        candidates = rank(
            await state.active(), groups, total_tokens=total, block_tokens=block_tokens,
            mean_service_us=settings.mean_service_ms * 1000,
        )  # fmt: skip
        chosen = choose(candidates)
        return json_response({
            "instance": chosen.instance,
            "matched": sum(count for _, count in groups),
            "index": index_state,
            "candidates": [c.to_json() for c in candidates],
        })  # fmt: skip

    metrics = Metrics()

    routes = [
        Route("/instances/{instance_id}/status", put_status, methods=["PUT"]),
        Route("/sessions/{session}/checkpoint", put_checkpoint, methods=["PUT"]),
        Route("/place", place, methods=["POST"]),
    ]
    app = role_app(
        settings.base_path, routes, metrics,
        lambda request: policy.require_any_role(who(request), ("metrics", "admin")),
    )  # fmt: skip
    app.state.controller = state
    return app
