"""The Index Service's ASGI app: ``replicas/{holder-id}/{block_key}`` and ``lookup``.

Authorization (P1, L3, SEC1, SEC2):

* PUT and DELETE: the principal must be the holder the path names (its
  policy grant's ``holder`` base URI hashes to ``{holder-id}``, H6) or hold
  the ``admin`` role, and for PUT be allowed to write the record's scope;
* lookup: a principal that may not read the scope gets exactly the answer of
  an empty index, never a record.

Lookup answers are assembled from the stored record octets (see
:mod:`.state`); placement estimates per target follow PL1 when the IS knows
the target's status and the block size of the compatibility ID.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..http import (
    empty_response,
    json_response,
    principal,
    read_json,
    role_app,
    role_of,
)
from ..metrics import Metrics
from ..protocol.control import InstanceStatus
from ..protocol.placement import decode_shapes, plan_groups, recompute_us
from ..protocol.problems import BadRequest, Forbidden, NotFound
from ..protocol.records import LookupRequest, ReplicaRecord, TargetEstimate
from ..protocol.residency import ResidencyUpdate, Resident
from ..protocol.wire import JSON_MEDIA_TYPE, NO_STORE, role_id
from ..security import Grant, Policy
from ..settings import IndexSettings
from ..storage.errors import TierUnavailable
from .residency import ResidencyBook, ResidencyCounters
from .state import Hits, IndexState

log = logging.getLogger("kvstore.index")


class StatusSource(Protocol):
    """Where the IS reads instance status records: the state of the PC it
    runs with, in this process or in a shared Redis."""

    async def statuses(self, instances: Iterable[str]) -> Mapping[str, InstanceStatus]:
        """The status records of those of ``instances`` that are active."""
        ...


@dataclass(slots=True)
class StatusBook:
    """Status records kept in this process (tests, and an IS without a PC)."""

    records: dict[str, InstanceStatus] = field(default_factory=dict)

    def put(self, status: InstanceStatus) -> None:
        self.records[status.instance] = status

    async def statuses(self, instances: Iterable[str]) -> Mapping[str, InstanceStatus]:
        return {i: self.records[i] for i in instances if i in self.records}


@dataclass(slots=True)
class IndexCounters(ResidencyCounters):
    """OPS1 figures of the IS; ``lookup_matched_keys / lookup_keys`` is the
    hit ratio. With the residency book's (instances' memory, ours)."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_matched_keys: int = 0
    lookups_denied_scope: int = 0
    published: int = 0
    withdrawn: int = 0
    reported: int = 0


def _speaks_for(grant: Grant, instance_id: str) -> bool:
    """Only an instance tells its own residency (as only a holder publishes
    its own replicas, SEC1), or an admin."""
    return "admin" in grant.roles or (
        "instance" in grant.roles
        and grant.instance is not None
        and role_id(grant.instance) == instance_id
    )


def _may_act_for(grant: Grant, holder_id: str) -> bool:
    return "admin" in grant.roles or (
        "holder" in grant.roles and grant.acts_as_holder(lambda uri: role_id(uri) == holder_id)
    )


async def estimates(
    targets: Sequence[str], hits: Hits, block_tokens: int, statuses: StatusSource
) -> list[TargetEstimate]:
    """fetch_us and recompute_us per target with a known status (L2, PL1),
    from the shapes of the matched replicas, grouped (see protocol.placement)."""
    if not targets or not hits.matched or hits.shapes is None:
        return []
    groups = [(decode_shapes(octets), n) for octets, n in Counter(hits.shapes).items()]
    tokens = hits.matched * block_tokens
    known = await statuses.statuses(targets)
    out = []
    for target in targets:
        status = known.get(target)
        if status is None:
            continue
        plan = plan_groups(groups, status)
        if plan is None:
            continue  # no replica reachable over a link the instance reported
        recompute = recompute_us(tokens, status.prefill_tokens_per_s)
        if not (math.isfinite(plan.fetch_us) and math.isfinite(recompute)):
            continue  # no estimate JSON can carry (e.g. a prefill rate of 0)
        out.append(TargetEstimate(target, plan.fetch_us, recompute))
    return out


class Residency(Protocol):
    """Instances' residency: this process's (:class:`ResidencyBook`) or
    shared through Redis (:mod:`.shared_residency`)."""

    counters: ResidencyCounters

    async def tell(self, instance_id: str, update: ResidencyUpdate) -> tuple[int, bool, int]: ...

    def lookup(self, scope_id: str, compat_id: str, keys: Sequence[str]) -> list[Resident]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class Index:
    """The IS's handlers over its state (its ``routes()`` are the table)."""

    def __init__(
        self,
        settings: IndexSettings,
        state: IndexState,
        policy: Policy,
        statuses: StatusSource | None = None,
        residency: Residency | None = None,
    ) -> None:
        self.settings, self.state, self.policy = settings, state, policy
        self.statuses = statuses or StatusBook()
        self.counters = IndexCounters()
        self.residency: Residency = residency or ResidencyBook(
            settings.max_records, settings.max_ttl_ms
        )
        self.residency.counters = self.counters

    def routes(self) -> list[Route]:
        return [
            Route("/replicas/{holder_id}/{block_key}", self.put_replica, methods=["PUT"]),
            Route("/replicas/{holder_id}/{block_key}", self.delete_replica, methods=["DELETE"]),
            Route("/lookup", self.lookup, methods=["POST"]),
            Route("/residency/{instance_id}", self.put_residency, methods=["POST"]),
        ]

    def who(self, request: Request) -> str | None:
        return principal(request, self.settings.allow_anonymous)

    def path_parts(self, request: Request) -> tuple[str, str]:
        holder_id, block_key = request.path_params["holder_id"], request.path_params["block_key"]
        if len(holder_id) != 43 or len(block_key) != 64:
            raise NotFound("no such replica resource")
        return holder_id, block_key

    async def put_replica(self, request: Request) -> Response:
        holder_id, block_key = self.path_parts(request)
        grant = self.policy.grant(self.who(request))
        if not _may_act_for(grant, holder_id):
            raise Forbidden("only the holder itself may publish its replicas (P1)")
        body = await read_json(request, self.settings.max_json_octets)
        record = ReplicaRecord.from_json(body)
        if role_id(record.holder) != holder_id or record.block_key != block_key:
            raise BadRequest("the record's holder and block_key must match the path")
        self.policy.require_write(self.who(request), record.scope_id)
        ttl_ms = min(record.ttl_ms, self.settings.max_ttl_ms)  # P2: capped
        if ttl_ms != record.ttl_ms:
            record = dataclasses.replace(record, ttl_ms=ttl_ms)
        await self.state.put(record, ttl_ms)
        self.counters.published += 1
        return json_response({"ttl_ms": ttl_ms})

    async def delete_replica(self, request: Request) -> Response:
        holder_id, block_key = self.path_parts(request)
        grant = self.policy.grant(self.who(request))
        if not _may_act_for(grant, holder_id):
            # BL8: a client that found a replica failing its digest may withdraw
            # it on the holder's behalf, when the policy makes it a reporter.
            scope = await self.state.scope_of(holder_id, block_key)
            if "reporter" not in grant.roles or scope is None or not grant.can_read(scope):
                raise Forbidden("only the holder itself may withdraw its replicas (P1)")
            self.counters.reported += 1
        if not await self.state.delete(holder_id, block_key):
            raise NotFound("no such replica record")
        self.counters.withdrawn += 1
        return empty_response()

    async def put_residency(self, request: Request) -> Response:
        """An engine's bridge tells what its instance holds (ours,
        kvstore.protocol.residency): only for itself, in scopes it may write."""
        instance_id = request.path_params["instance_id"]
        if len(instance_id) != 43:
            raise NotFound("no such residency resource")
        who = self.who(request)
        grant = self.policy.grant(who)
        if not _speaks_for(grant, instance_id):
            raise Forbidden("only the instance itself may tell its residency")
        update = ResidencyUpdate.from_json(
            await read_json(request, self.settings.max_json_octets),
            max_keys=self.settings.max_lookup_keys * 8,
        )
        if role_id(update.instance) != instance_id:
            raise BadRequest("the update's instance must match the path")
        for group in (*update.add, *update.remove):
            self.policy.require_write(who, group.scope_id)
        ttl_ms, known, records = await self.residency.tell(instance_id, update)
        return json_response({"ttl_ms": ttl_ms, "known": known, "records": records})

    async def lookup(self, request: Request) -> Response:
        grant = self.policy.grant(self.who(request))
        query = LookupRequest.from_json(
            await read_json(request, self.settings.max_json_octets),
            max_keys=self.settings.max_lookup_keys,
            max_targets=self.settings.max_targets,
        )
        self.counters.lookups += 1
        self.counters.lookup_keys += len(query.block_keys)
        if not grant.can_read(query.scope_id):
            # L3: exactly what an empty index answers; nothing tells the scope exists.
            self.counters.lookups_denied_scope += 1
            return LookupAnswer(Hits())
        block_tokens = self.settings.block_tokens.get(query.compat_id)
        with_targets = bool(query.targets and block_tokens)
        hits = await self.state.lookup(
            query.scope_id,
            query.compat_id,
            query.block_keys,
            shapes=with_targets or query.shapes_only,
            records=not query.shapes_only,
        )
        self.counters.lookup_matched_keys += hits.matched
        found = []
        if query.targets and block_tokens:
            found = await estimates(query.targets, hits, block_tokens, self.statuses)
        try:
            await self.residency.start()
            resident = self.residency.lookup(query.scope_id, query.compat_id, query.block_keys)
        except TierUnavailable as exc:  # advisory (P4): the replicas still answer
            log.warning("residency unavailable: %s", exc.detail)
            resident = []
        if query.shapes_only:
            return _shapes_answer(hits, found, resident)
        return LookupAnswer(hits, found, resident)


def create_app(
    settings: IndexSettings,
    state: IndexState,
    policy: Policy,
    statuses: StatusSource | None = None,
    residency: Residency | None = None,
) -> Starlette:
    """The IS app over ``state``; ``statuses``: where instance status is read
    for estimates (L2), the PC's state when they share a process or Redis;
    ``residency``: instances' residency, this process's own by default (a
    :class:`~kvstore.index.shared_residency.SharedResidency` to share it)."""
    index = Index(settings, state, policy, statuses, residency)
    metrics = Metrics(counters=index.counters, counters_prefix="kvstore_index")
    app = role_app(
        settings.base_path,
        index.routes(),
        metrics,
        policy,
        settings.allow_anonymous,
        name="index",
    )
    app.state.state = state
    role_of(app).counters = index.counters
    app.state.statuses = index.statuses
    #: Instances' residency (the PC's placer in this process reads it too).
    app.state.residency = index.residency
    return app


def _resident_json(resident: Sequence[Resident]) -> bytes:
    return b',"resident":' + json.dumps([r.to_json() for r in resident]).encode()


def _shapes_answer(
    hits: Hits, found: Sequence[TargetEstimate], resident: Sequence[Resident] = ()
) -> Response:
    """The answer to ``shapes_only`` (ours): runs of keys by their replicas' shapes."""
    groups: dict[bytes, int] = {}
    runs = []
    # Consecutive keys mostly have replicas of equal shapes: groupby compares
    # them in C, and a prompt is a handful of runs.
    for octets, run in itertools.groupby(hits.shapes or ()):
        runs.append(b"[%d,%d]" % (groups.setdefault(octets, len(groups)), len(list(run))))
    body = b'{"matched":%d,"shapes":{"groups":[%s],"runs":[%s]}' % (
        hits.matched,
        b",".join(groups),
        b",".join(runs),
    )
    if found:
        body += b',"targets":' + json.dumps([t.to_json() for t in found]).encode()
    if resident:
        body += _resident_json(resident)
    return Response(body + b"}", headers={"Cache-Control": NO_STORE}, media_type=JSON_MEDIA_TYPE)


class LookupAnswer(Response):
    """The lookup answer, sent from the state's octets (:class:`Hits`).

    An 8k-key answer with three full records per key is ~60 MB. Joining it
    into one body costs more in fresh memory (page faults) than in copying;
    it is sent instead as messages of about ``message_octets``, each joined
    from the stored per-key octets into memory the allocator reuses as soon
    as the server has written it.
    """

    message_octets = 256 << 10

    def __init__(
        self,
        hits: Hits,
        targets: Sequence[TargetEstimate] = (),
        resident: Sequence[Resident] = (),
    ) -> None:
        super().__init__(None, headers={"Cache-Control": NO_STORE}, media_type=JSON_MEDIA_TYPE)
        self.hits = hits
        self.head = b'{"matched":%d,"replicas":[' % hits.matched
        self.tail = b"]"
        if targets:
            encoded = json.dumps([t.to_json() for t in targets], allow_nan=False)
            self.tail += b',"targets":' + encoded.encode()
        if resident:
            self.tail += _resident_json(resident)
        self.tail += b"}"
        chunks = hits.chunks
        self.octets = sum(map(len, chunks)) + max(len(chunks) - 1, 0)
        self.headers["content-length"] = str(len(self.head) + self.octets + len(self.tail))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        chunks = self.hits.chunks
        # Per-key chunks are of similar size: a fixed count of them per message.
        step = max(1, self.message_octets * len(chunks) // max(1, self.octets))
        body = self.head
        for start in range(0, max(1, len(chunks)), step):
            batch = chunks[start : start + step]
            if start:
                batch.insert(0, b"")  # the "," between this message and the last
                body = b""
            if start + step < len(chunks):
                await send(
                    {
                        "type": "http.response.body",
                        "body": body + b",".join(batch),
                        "more_body": True,
                    }
                )
            else:
                await send(
                    {"type": "http.response.body", "body": body + b",".join(batch) + self.tail}
                )
