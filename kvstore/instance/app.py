"""The Inference Instance's ASGI app: the KVSP resources the PC drives.

KVSP's ``POST prefetch`` (202 + ``Location``) and ``GET prefetch/{id}``
(PF1, PF3), ``POST sessions/{session}/resume`` (CK5) and ``PUT state`` (S3,
S6), each accepted only from a principal with the ``pc`` role (SEC1, PF5:
directives only from the PC). Ours, for front ends of a scope: ``POST
generate`` starts a session and streams its output as NDJSON events (each
token with its index and epoch, CK4), ``GET sessions/{session}/tokens?from=N``
streams it again from index N (after a reconnect or a migration), and
``GET sessions/{session}`` says how it stands.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..http import json_response, principal, read_json, role_app
from ..lifespan import Listening, Service, Step, running
from ..metrics import Metrics
from ..protocol._json import check_int
from ..protocol.control import ResumeRequest, StateChange, parse_reshard
from ..protocol.lifecycle import InstanceState
from ..protocol.problems import (
    BadRequest,
    InvalidState,
    KvspError,
    NotFound,
    PlanConflict,
    UnknownResource,
)
from ..protocol.records import PrefetchDirective
from ..protocol.wire import NO_STORE
from ..security import Policy
from ..settings import InstanceSettings
from .lifecycle import Lifecycle
from .prefetch import Prefetcher

if TYPE_CHECKING:
    from .sessions import Session, Sessions
    from .shards import Shards

NDJSON = "application/x-ndjson"


class Instance:
    """The instance's handlers (its ``routes()`` are the table)."""

    def __init__(
        self,
        settings: InstanceSettings,
        prefetcher: Prefetcher,
        policy: Policy,
        lifecycle: Lifecycle,
        sessions: Sessions | None = None,
        shards: Shards | None = None,
    ) -> None:
        self.settings, self.prefetcher, self.policy = settings, prefetcher, policy
        self.lifecycle, self.sessions, self.shards = lifecycle, sessions, shards

    def routes(self) -> list[Route]:
        return [
            Route("/prefetch", self.post_prefetch, methods=["POST"]),
            Route("/prefetch/{directive}", self.get_prefetch, methods=["GET"]),
            Route("/state", self.put_state, methods=["PUT"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/sessions/{session}", self.get_session, methods=["GET"]),
            Route("/sessions/{session}/tokens", self.get_tokens, methods=["GET"]),
            Route("/sessions/{session}/resume", self.resume, methods=["POST"]),
            Route("/reshard", self.reshard, methods=["POST"]),
            Route("/contexts/{map}", self.put_context, methods=["PUT"]),
            Route("/contexts/{map}", self.get_context, methods=["GET"]),
        ]

    def who(self, request: Request) -> str | None:
        return principal(request, self.settings.allow_anonymous)

    def from_pc(self, request: Request) -> None:
        self.policy.require_role(self.who(request), "pc")

    def engine(self) -> Sessions:
        if self.sessions is None:
            raise NotFound("this instance runs no engine")
        return self.sessions

    def stream(self, session: Session, start: int) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            async for event in self.engine().follow(session, start):
                yield json.dumps(event, separators=(",", ":")).encode() + b"\n"

        return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": NO_STORE})

    def readable(self, request: Request) -> Session:
        session = self.engine().get(request.path_params["session"].lower())
        # "absent" and "not yours" read the same (L3).
        try:
            self.policy.require_read(self.who(request), session.scope_id)
        except KvspError as exc:
            raise NotFound("unknown session") from exc
        return session

    async def generate(self, request: Request) -> Response:
        from .requests import GenerateRequest

        found = self.engine()
        self.policy.grant(self.who(request))  # 401/403 before parsing
        body = GenerateRequest.from_json(
            await read_json(request, self.settings.max_json_octets),
            max_prompt=found.settings.max_prompt_tokens,
            max_output=found.settings.max_output_tokens,
        )
        self.policy.require_read(self.who(request), body.scope_id)
        return self.stream(found.begin(body), 0)

    async def get_tokens(self, request: Request) -> Response:
        session = self.readable(request)
        start = check_int(int_param(request, "from"), "from", lo=0)
        return self.stream(session, start)

    async def get_session(self, request: Request) -> Response:
        session = self.readable(request)
        return json_response(
            {
                "session": session.id,
                "epoch": session.epoch,
                "state": session.state.value,
                "released": session.released,
                "output_tokens": len(session.generated),
                "checkpointed": session.checkpointed,
                "stats": session.stats,
            }
        )

    async def resume(self, request: Request) -> Response:
        # CK5, CK6: the PC moves a session here; answered once restored.
        self.from_pc(request)
        found = self.engine()
        body = ResumeRequest.from_json(await read_json(request, self.settings.max_json_octets))
        session = await found.resume(body, request.path_params["session"].lower())
        return json_response(
            {
                "session": session.id,
                "epoch": session.epoch,
                "output_offset": body.checkpoint.output_offset,
                "loaded_tokens": session.stats.get("loaded_tokens", 0),
                "computed_tokens": session.stats.get("computed_tokens", 0),
            }
        )

    async def post_prefetch(self, request: Request) -> Response:
        self.from_pc(request)
        directive = PrefetchDirective.from_json(
            await read_json(request, self.settings.max_json_octets),
            max_blocks=self.settings.max_directive_blocks,
        )
        if self.lifecycle.state is not InstanceState.ACTIVE:
            raise InvalidState(f"the instance is {self.lifecycle.state} (S4)")
        run = self.prefetcher.submit(directive)  # PF5: 429 beyond the pending quota
        location = f"{self.settings.base_path}prefetch/{directive.directive}"
        return json_response(
            run.status().to_json(),
            status=202,
            headers={"Location": location, "Cache-Control": NO_STORE},
        )

    async def get_prefetch(self, request: Request) -> Response:
        self.from_pc(request)
        return json_response(
            self.prefetcher.status(request.path_params["directive"].lower()).to_json()
        )

    async def put_state(self, request: Request) -> Response:
        # S3, S6: the PC changes the instance's state; a sleeping instance
        # becomes active only this way.
        self.from_pc(request)
        change = StateChange.from_json(await read_json(request, self.settings.max_json_octets))
        if change.state == InstanceState.FAILED:
            raise BadRequest("state: failed is not a state the PC sets")
        self.lifecycle.set_by_pc(change.state)
        return json_response(change.to_json())

    def sharded(self) -> Shards:
        if self.shards is None:
            raise UnknownResource("this instance holds no sharded contexts")
        return self.shards

    async def put_context(self, request: Request) -> Response:
        # Ours: the PC tells a member which context it holds ranges of.
        from .shards import ContextDefinition

        self.from_pc(request)
        definition = ContextDefinition.from_json(
            await read_json(request, self.settings.max_json_octets)
        )
        map_id = request.path_params["map"]
        await self.sharded().define(map_id, definition, deadline_s=30.0)
        return json_response(self.sharded().answer(map_id))

    async def get_context(self, request: Request) -> Response:
        self.from_pc(request)
        return json_response(self.sharded().answer(request.path_params["map"]))

    async def reshard(self, request: Request) -> Response:
        # RS2-RS6: a plan (200 once its fetch ranges are loaded), a commit
        # or an abort.
        self.from_pc(request)
        message = parse_reshard(await read_json(request, self.settings.max_json_octets))
        if self.shards is None:  # RS7: no version of any map here
            raise PlanConflict(f"this instance holds no version of map {message.map} (RS7)")
        return json_response(await self.shards.reshard(message))


def create_app(
    settings: InstanceSettings,
    prefetcher: Prefetcher,
    policy: Policy,
    lifecycle: Lifecycle,
    sessions: Sessions | None = None,
    shards: Shards | None = None,
    *,
    reporter: Service | None = None,
    closing: Sequence[Step] = (),
    listening: Listening | None = None,
) -> Starlette:
    """The instance app. Its lifespan starts the engine's sessions and the
    status ``reporter`` once the listener listens (the first report may go
    to a PC of this very listener); at the stop it ends them, then closes
    the prefetcher and runs ``closing`` (the clients the role made)."""
    services: list[Service] = [s for s in (sessions, reporter) if s is not None]

    def lifespan(app: Starlette) -> AbstractAsyncContextManager[None]:
        return running(services, after=listening, then=[prefetcher.close, *closing])

    instance = Instance(settings, prefetcher, policy, lifecycle, sessions, shards)
    metrics = Metrics(
        counters=sessions.counters if sessions is not None else None,
        counters_prefix="kvstore_instance",
    )
    app = role_app(
        settings.base_path,
        instance.routes(),
        metrics,
        policy,
        settings.allow_anonymous,
        lifespan=lifespan,
        name="instance",
    )
    app.state.prefetcher = prefetcher
    app.state.lifecycle = lifecycle
    app.state.sessions = sessions
    app.state.shards = shards
    return app


def int_param(request: Request, name: str) -> Any:
    value = request.query_params.get(name, "0")
    try:
        return int(value)
    except ValueError as exc:
        raise BadRequest(f"{name}: must be an integer") from exc
