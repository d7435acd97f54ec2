"""The Placement Controller's ASGI app: instance status and session checkpoints.

``PUT instances/{instance-id}/status`` (S1-S3),
``PUT sessions/{session}/checkpoint`` (CK1, CK2), ``DELETE sessions/{session}``
(ours: the owner ends it), and our ``POST place`` (not KVSP): the cheapest
active instance for a prompt, with the estimates that made the choice (PL1,
PL2), and a prefetch directive sent to it (PF1) when configured. Only an
instance may report, and only for itself: its policy grant's ``instance``
base URI must hash to ``{instance-id}`` (H6) and equal the record's
``instance`` (SEC1). Sessions of failed instances are moved by the
:class:`~.migrate.Migrator` (CK5).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import shlex
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http import (
    empty_response,
    json_response,
    principal,
    read_body,
    read_json,
    role_app,
    role_of,
)
from ..lifespan import Listening, Step, running
from ..metrics import Metrics
from ..protocol._json import check_int
from ..protocol.control import InstanceStatus, SessionCheckpoint, ShardMap, StateChange
from ..protocol.keys import PackedKeys
from ..protocol.lifecycle import InstanceState
from ..protocol.problems import (
    BadGateway,
    BadRequest,
    Forbidden,
    InvalidState,
    KvspError,
    NotFound,
    ScopeDenied,
)
from ..protocol.records import LookupRequest
from ..protocol.wire import role_id
from ..seams import Instances, Lookups
from ..security import Grant, Policy
from ..settings import ControllerSettings
from .coordinator import ReshardAborted, ReshardCoordinator
from .dispatch import ControllerCounters, Dispatch
from .migrate import Migrator
from .placer import Placer
from .starter import InstanceStarter
from .state import ControllerState

log = logging.getLogger("kvstore.controller")


def _instance_of(grant: Grant) -> str:
    if "instance" not in grant.roles or grant.instance is None:
        raise Forbidden("only inference instances report status and checkpoints")
    return grant.instance


class Controller:
    """The PC's handlers over its state (its ``routes()`` are the table)."""

    def __init__(
        self,
        settings: ControllerSettings,
        state: ControllerState,
        policy: Policy,
        index: Lookups | None = None,
        instances: Instances | None = None,
    ) -> None:
        self.settings, self.state, self.policy, self.instances = settings, state, policy, instances
        self.counters = ControllerCounters()
        # SEC1: work and sessions of a scope go only to instances that may write it.
        self.grants = {g.instance: g for g in policy.principals.values() if g.instance is not None}
        self.placer = Placer(state, index, settings.mean_service_ms * 1000, self.eligible)
        self.coordinator = ReshardCoordinator(state, instances) if instances is not None else None
        self.starter = None
        if settings.start_command:
            command = settings.start_command
            argv = tuple(shlex.split(command)) if isinstance(command, str) else tuple(command)
            self.starter = InstanceStarter(
                argv, timeout_s=settings.start_timeout_s, cooldown_s=settings.start_cooldown_s
            )
        self.dispatch = Dispatch(
            settings,
            self.placer,
            state,
            self.counters,
            self.eligible,
            instances=instances,
            starter=self.starter,
        )
        #: Moves the sessions of failed instances (CK5); runs with the app.
        self.migrator = None
        if instances is not None:
            self.migrator = Migrator(
                state,
                self.placer,
                instances,
                dict(settings.block_tokens),
                interval_s=settings.migrate_interval_s,
                session_idle_s=settings.session_idle_s,
                counters=self.counters,
            )

    def eligible(self, instance: str, scope_id: str) -> bool:
        grant = self.grants.get(instance)
        return grant is not None and "instance" in grant.roles and grant.can_write(scope_id)

    def routes(self) -> list[Route]:
        return [
            Route("/instances", self.list_instances, methods=["GET"]),
            Route("/instances/{instance_id}/status", self.put_status, methods=["PUT"]),
            Route("/instances/{instance_id}/state", self.put_state, methods=["PUT"]),
            Route("/sessions/{session}/checkpoint", self.put_checkpoint, methods=["PUT"]),
            Route("/sessions/{session}", self.end_session, methods=["DELETE"]),
            Route("/sessions/{session}", self.get_session, methods=["GET"]),
            Route("/maps/{map}", self.put_map, methods=["PUT"]),
            Route("/maps/{map}", self.get_map, methods=["GET"]),
            Route("/maps/{map}/reshard", self.post_reshard, methods=["POST"]),
            Route("/place", self.place, methods=["POST"]),
        ]

    def who(self, request: Request) -> str | None:
        return principal(request, self.settings.allow_anonymous)

    async def put_status(self, request: Request) -> Response:
        instance = _instance_of(self.policy.grant(self.who(request)))
        if role_id(instance) != request.path_params["instance_id"]:
            raise Forbidden("an instance reports only its own status (SEC1)")
        status = InstanceStatus.from_json(await read_json(request, self.settings.max_json_octets))
        if status.instance != instance:
            raise BadRequest("the record's instance is not the path's instance")
        answer = await self.state.put_status(status)  # S2: stale epochs raise 409
        # S3: the answer carries the state the PC holds for the instance.
        return json_response(StateChange(answer.value).to_json())

    async def put_checkpoint(self, request: Request) -> Response:
        instance = _instance_of(self.policy.grant(self.who(request)))
        checkpoint = SessionCheckpoint.from_json(
            await read_json(request, self.settings.max_checkpoint_octets)
        )
        # SEC1: the instance must be allowed to write the session's scope.
        self.policy.require_write(self.who(request), checkpoint.scope_id)
        if checkpoint.session != request.path_params["session"].lower():
            raise BadRequest("the checkpoint's session is not the path's session")
        entry = await self.state.put_checkpoint(checkpoint, instance)  # CK2, CK7
        kept = entry.checkpoint.output_offset if entry.checkpoint is not None else 0
        # The acknowledgement a non-deterministic sampler waits for (CK3).
        return json_response({"epoch": entry.epoch, "output_offset": kept})

    async def place(self, request: Request) -> Response:
        # Ours, not KVSP: where should this request go, and why (PL1, PL2).
        if request.headers.get("content-type", "").startswith("application/octet-stream"):
            body, packed = await self._packed_body(request)
            query = place_query(body, self.settings.max_place_keys, packed)
        else:
            body = await read_json(request, self.settings.max_json_octets)
            query = place_query(body, self.settings.max_place_keys)
        self.policy.require_read(self.who(request), query.scope_id)
        obj = body if isinstance(body, dict) else {}
        block_tokens = self.settings.block_tokens.get(query.compat_id)
        if block_tokens is None:
            raise BadRequest("unknown compat_id: the PC needs its descriptor (block_tokens)")
        tokens = obj.get("tokens")
        total = (
            check_int(tokens, "place.tokens", lo=0)
            if tokens is not None
            else (len(query.block_keys) * block_tokens)
        )
        request_ref = obj.get("request_ref")
        if request_ref is not None and not (
            isinstance(request_ref, str) and len(request_ref) <= 256
        ):
            raise BadRequest("place.request_ref: an opaque string of at most 256 characters")
        answer = await self.dispatch.place(query, total, block_tokens, request_ref)
        return json_response(answer.to_json())

    async def _packed_body(self, request: Request) -> tuple[Any, bytes]:
        """An ``application/octet-stream`` place body: a JSON header line
        (``{"scope_id", "compat_id", "tokens", "request_ref"}``), ``\n``,
        then the block keys as 32 raw octets each."""
        limit = self.settings.max_json_octets + 32 * self.settings.max_place_keys
        raw = bytes(await read_body(request, limit))  # no ``into``: bytes already
        newline = raw.find(b"\n")
        if newline < 0:
            raise BadRequest("place: an octet-stream body is a JSON header line, then the keys")
        try:
            header = json.loads(raw[:newline])
        except (ValueError, RecursionError):
            raise BadRequest("place: the header line is not JSON") from None
        return header, raw[newline + 1 :]

    async def put_state(self, request: Request) -> Response:
        # Ours: an operator wakes an instance or has it drain (S3, S6); the PC
        # tells the instance (PUT state) and then holds the new state.
        self.policy.require_role(self.who(request), "admin")
        change = StateChange.from_json(await read_json(request, self.settings.max_json_octets))
        if change.state not in (InstanceState.ACTIVE, InstanceState.DRAINING):
            raise BadRequest("state: an instance is set active or draining (it reports the rest)")
        instance = await self.state.instance_named(request.path_params["instance_id"])
        if self.instances is None:
            raise InvalidState("the PC has no client for instances")
        try:
            await self.instances.set_state(instance, change.state)
        except KvspError as exc:
            raise BadGateway(f"the instance did not take the state: {exc.detail}") from exc
        await self.state.set_state(instance, change.state)
        return json_response(change.to_json())

    def map_in(self, request: Request, body: Any, name: str) -> ShardMap:
        shard_map = ShardMap.from_json(body)
        if shard_map.map != request.path_params["map"]:
            raise BadRequest(f"{name}.map: must be the path's map")
        return shard_map

    async def put_map(self, request: Request) -> Response:
        # Ours: an operator gives the PC a context's shard map (RS1).
        self.policy.require_role(self.who(request), "admin")
        shard_map = self.map_in(
            request, await read_json(request, self.settings.max_json_octets), "map"
        )
        entry = await self.state.create_map(shard_map)
        return json_response(entry.current.to_json())

    async def get_map(self, request: Request) -> Response:
        self.policy.require_role(self.who(request), "admin")
        entry = await self.state.shard_map(request.path_params["map"])
        return json_response({**entry.current.to_json(), "resharding_to": entry.pending})

    async def post_reshard(self, request: Request) -> Response:
        # Ours: move the map to the target version (RS2-RS6), answered when
        # committed or aborted.
        self.policy.require_role(self.who(request), "admin")
        body = await read_json(request, self.settings.max_json_octets)
        obj = body if isinstance(body, dict) else {}
        target = self.map_in(request, obj.get("target"), "target")
        deadline_ms = check_int(obj.get("deadline_ms", 1000), "deadline_ms", lo=1, hi=600_000)
        if self.coordinator is None:
            raise InvalidState("the PC has no client for instances")
        outcome = await self.coordinator.reshard(target, deadline_ms)
        if not outcome.committed:
            raise ReshardAborted(
                "members did not acknowledge by the deadline (RS6)", **outcome.to_json()
            )
        return json_response(outcome.to_json())

    async def end_session(self, request: Request) -> Response:
        # Ours: the owner says the session is over; it is never migrated.
        instance = _instance_of(self.policy.grant(self.who(request)))
        await self.state.end_session(request.path_params["session"].lower(), instance)
        return empty_response()

    async def get_session(self, request: Request) -> Response:
        # Ours: where a session is now (a front end following it across a
        # migration, CK4). Only for principals of its scope; "absent" and
        # "not yours" read the same (L3).
        name = request.path_params["session"].lower()
        ended = False
        try:
            try:
                entry = await self.state.session(name)
            except NotFound:
                # Ended: its last owner holds its end (a front end that lost
                # the stream finds it there).
                entry, ended = await self.state.ended(name), True
            if entry.checkpoint is None:
                raise NotFound("unknown session")
            self.policy.require_read(self.who(request), entry.checkpoint.scope_id)
        except (Forbidden, ScopeDenied) as exc:
            raise NotFound("unknown session") from exc
        return json_response(
            {
                "session": entry.session,
                "epoch": entry.epoch,
                "instance": entry.owner,
                "ended": ended,
                "output_offset": entry.checkpoint.output_offset,
            }
        )

    async def list_instances(self, request: Request) -> Response:
        # Ours: operators see every instance and the state the PC holds.
        self.policy.require_any_role(self.who(request), ("admin", "metrics"))
        return json_response({"instances": await self.state.overview()})


def place_query(body: Any, max_keys: int, packed: bytes | None = None) -> LookupRequest:
    """The lookup a ``POST place`` body asks for. The block keys are either
    ``block_keys`` (hex, as a KVSP lookup has them) or, compactly (ours),
    ``block_keys_b64``: base64 of the keys' 32 octets each, concatenated (an
    8k-key prompt: 350 KB instead of 540 KB of JSON strings), or ``packed``,
    those octets themselves (an ``application/octet-stream`` body: 256 KB,
    and no JSON or base64 to decode)."""
    where = "place.keys"
    if packed is None:
        if not isinstance(body, dict) or "block_keys_b64" not in body:
            return LookupRequest.from_json(body, max_keys=max_keys)
        where = "place.block_keys_b64"
        encoded = body["block_keys_b64"]
        if not isinstance(encoded, str) or len(encoded) > 4 * (32 * max_keys + 2) // 3 + 4:
            raise BadRequest(f"{where}: base64 of at most {max_keys} keys of 32 octets")
        try:
            packed = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{where}: not base64") from None
    if not isinstance(body, dict):
        raise BadRequest("place: must be a JSON object")
    if "block_keys" in body:
        raise BadRequest("place: the block keys once: block_keys, block_keys_b64 or packed")
    raw = packed
    if not raw or len(raw) % 32:
        raise BadRequest(f"{where}: a whole number of 32-octet keys, at least one")
    if len(raw) // 32 > max_keys:
        raise BadRequest(f"{where}: {len(raw) // 32} keys, more than {max_keys}")
    # The keys stay packed: an index in this process walks the octets (no
    # string per key); one over HTTP gets them as hex.
    keys = PackedKeys(raw)
    rest = LookupRequest.from_json(
        {**{k: v for k, v in body.items() if k != "block_keys_b64"}, "block_keys": [keys[0]]},
        max_keys=max_keys,
    )
    return dataclasses.replace(rest, block_keys=keys)


def create_app(
    settings: ControllerSettings,
    state: ControllerState,
    policy: Policy,
    index: Lookups | None = None,
    instances: Instances | None = None,
    *,
    closing: Sequence[Step] = (),
    listening: Listening | None = None,
) -> Starlette:
    """``index``: a :class:`kvstore.client.IndexClient` for placement lookups;
    ``instances``: a :class:`kvstore.client.InstanceClient` for prefetch
    directives and resumes. The app's lifespan runs the migrator (with
    ``instances``) and at the stop closes the starter (the instances it
    started go on), then runs ``closing`` (the clients its maker made)."""
    controller = Controller(settings, state, policy, index, instances)
    services = [controller.migrator] if controller.migrator is not None else []
    then: list[Step] = [controller.starter.close] if controller.starter is not None else []

    def lifespan(app: Starlette) -> AbstractAsyncContextManager[None]:
        # The migrator's first round may resume sessions on instances of
        # this very listener: it starts once it listens.
        return running(services, after=listening, then=[*then, *closing])

    metrics = Metrics(counters=controller.counters, counters_prefix="kvstore_controller")
    app = role_app(
        settings.base_path,
        controller.routes(),
        metrics,
        policy,
        settings.allow_anonymous,
        lifespan=lifespan,
        name="pc",
    )
    app.state.controller = state
    role_of(app).counters = controller.counters
    app.state.starter = controller.starter
    app.state.migrator = controller.migrator
    app.state.placer = controller.placer
    return app
