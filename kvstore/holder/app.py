"""The holder's ASGI app: ``blocks/{compat}/{scope}/{block_key}`` and ``leases``.

Resources are relative to the configured base URI (H7). Every request is
authorized by the principal of its client certificate (SEC1) before anything
about the block is revealed: a principal without the block's scope gets
``kvsp-scope-denied`` whether or not the block exists.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..http import (
    empty_response,
    json_response,
    principal,
    read_body,
    read_json,
    role_app,
)
from ..lifespan import Listening, Shutdown, Step, run_steps, running
from ..metrics import Metrics
from ..protocol import container as kc
from ..protocol._json import UINT32_MAX, check_int
from ..protocol.codecs import CODECS
from ..protocol.problems import BadRequest, Incompatible, NotFound, PreconditionRequired
from ..protocol.records import LeaseGrant, LeaseRequest
from ..protocol.stream import LayerHasher
from ..protocol.wire import (
    BLOCK_MEDIA_TYPE,
    block_cache_control,
    block_path,
    parse_layers,
    repr_digest,
)
from ..security import Policy
from ..settings import HolderSettings
from ..storage import BlockRef, TieredStore
from ..storage.leases import Lease

if TYPE_CHECKING:
    from .publisher import IndexPublisher

log = logging.getLogger("kvstore.holder")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


def _ref(request: Request) -> BlockRef:
    compat, scope, key = (request.path_params[k] for k in ("compat", "scope", "block_key"))
    # Malformed path parts name no resource: 404, never a 500.
    if not (_HEX64.fullmatch(compat) and _HEX32.fullmatch(scope) and _HEX64.fullmatch(key)):
        raise NotFound(
            "no such block resource (compat and block key are 64, scope 32 lowercase hex)"
        )
    return BlockRef(compat, scope, key)


def _lease_json(lease: Lease, clock: Callable[[], float]) -> dict[str, Any]:
    remaining = max(0, int((lease.expires_at - clock()) * 1000))
    return LeaseGrant(lease.id, remaining, tuple(r.block_key for r in lease.blocks)).to_json()


class Holder:
    """The holder's handlers over one store (its ``routes()`` are the table)."""

    def __init__(self, settings: HolderSettings, store: TieredStore, policy: Policy) -> None:
        self.settings, self.store, self.policy = settings, store, policy

    def routes(self) -> list[Route]:
        # One route per path, so that a 405's Allow lists every method of it.
        block = {
            "GET": self.get_block,
            "HEAD": self.get_block,
            "PUT": self.put_block,
            "DELETE": self.delete_block,
        }
        lease = {"PUT": self.renew_lease, "DELETE": self.release_lease}
        return [
            Route("/blocks/{compat}/{scope}/{block_key}", _by_method(block), methods=list(block)),
            Route("/scopes/{scope}", self.purge_scope, methods=["DELETE"]),
            Route("/leases", self.create_lease, methods=["POST"]),
            Route("/leases/{lease_id}", _by_method(lease), methods=list(lease)),
            Route("/shards", self.shards, methods=["GET"]),
        ]

    def who(self, request: Request) -> str | None:
        return principal(request, self.settings.allow_anonymous)

    async def shards(self, request: Request) -> Response:
        """``GET {base}shards`` (ours, not KVSP): the base URIs of every
        worker of this holder process, so that a client configured with one
        finds the others (:class:`kvstore.holderset.HolderSet`); 404 from a
        holder run alone. Any principal of the policy may ask; it reveals no
        block."""
        self.policy.grant(self.who(request))
        if not self.settings.shards:
            # A lone holder: the URI a client was given stands for itself
            # (answering with holder.uri would swap a client's alias for it).
            raise NotFound("this holder runs alone (server.workers = 1): no shards")
        return json_response(
            {"holders": list(self.settings.shards), "self": self.settings.uri},
            headers={"Cache-Control": "private, max-age=60"},
        )

    async def get_block(self, request: Request) -> Response:
        ref = _ref(request)
        self.policy.require_read(self.who(request), ref.scope_id)
        first = last = None
        if "layers" in request.query_params:
            first, last = parse_layers(request.query_params["layers"])
        if self.store.recovering and not await self.store.find(ref):
            # A restart still finding its blocks could not tell in time: a
            # miss (P4), the client goes on to another replica.
            raise NotFound(f"block {ref.block_key} is not held (yet: recovery is under way)")
        if request.method == "HEAD" and "codec" not in request.query_params:
            # An existence probe (engines send many): headers from what is
            # known, no segment read, not a hit (a HEAD asking for a codec
            # takes the GET path: a transcoded length is not known). Repr-Digest only once
            # computed by a GET (RFC 9110 lets HEAD omit what only
            # generating the content would give).
            probe = self.store.read(ref, first, last, count=False)
            probe.check_reachable()
            digest = probe.known_repr_digest()
            settings = self.settings
            headers = (
                _block_headers(digest, settings)
                if digest
                else {"Cache-Control": block_cache_control(settings.replica_ttl_ms // 3)}
            )
            headers["Content-Length"] = str(len(probe))
            return Response(None, headers=headers, media_type=BLOCK_MEDIA_TYPE)
        read = self.store.read(ref, first, last)
        codec = request.query_params.get("codec")
        info = self.store.info(ref)
        if codec is not None and _wants_transcode(codec, info.codec, ref, self.settings):
            # BL3: transcoded representations are protected by Repr-Digest only.
            body = kc.transcode(
                kc.decode(await read.read_all()),
                int(codec),
                self.settings.known_descriptors[ref.compat_id],
            )
            headers = _block_headers(repr_digest(body), self.settings)
            return Response(bytes(body), headers=headers, media_type=BLOCK_MEDIA_TYPE)
        digest = read.known_repr_digest()
        if digest is not None and read.in_memory:
            # Hot: streamed from memory tiers (B4), nothing read before the header.
            chunks: Any = _stream(read)
        else:
            # From a persistent tier, or a range not served before: one read
            # of the tiers gives the digest and the octets, and a tier that
            # fails does so before the status line (a 503, not a cut body).
            digest, loaded = await read.buffered()
            chunks = _from_memory(loaded)
        headers = _block_headers(digest, self.settings)
        headers["Content-Length"] = str(len(read))
        return StreamingResponse(chunks, headers=headers, media_type=BLOCK_MEDIA_TYPE)

    async def put_block(self, request: Request) -> Response:
        ref = _ref(request)
        self.policy.require_write(self.who(request), ref.scope_id)
        if request.headers.get("if-none-match", "").strip() != "*":
            raise PreconditionRequired("a block PUT must carry If-None-Match: * (BL7)")
        # B3: layer digests are taken as the body arrives (no second pass),
        # on the event loop. Measured (bench load, host only, C=16): hashing
        # in a worker thread instead cost more loop CPU per operation (3.4-3.7
        # ms against 2.8-3.4) and fewer operations a second, as the thread's
        # many small GIL hand-offs contend with a busy loop. Measured again
        # with the host arena (issue 19), handing the thread 256 KiB spans of
        # the body for both digests: equal at c=1 (0.29 GB/s), worse at c=4
        # and c=16 (0.31-0.37 against 0.37-0.41), so both stay as they are.
        hasher = LayerHasher()
        try:
            body = await read_body(
                request,
                self.settings.max_block_octets,
                hasher.feed,
                base_s=self.settings.body_timeout_base_s,
                min_rate=self.settings.body_min_octets_per_s,
                into=self.store.buffer,
            )
        except ClientDisconnect:
            log.info("PUT %s ended early; nothing stored", ref.block_key)
            return empty_response(400)
        descriptor = self.settings.known_descriptors.get(ref.compat_id)
        if (
            descriptor is None
            and self.settings.known_descriptors
            and (self.settings.descriptors_only)
        ):
            raise Incompatible(
                f"compat_id {ref.compat_id} is not one of this holder's "
                "descriptors (holder.descriptors, descriptors_only)"
            )
        digests = hasher.digests if hasher.complete else None
        # P1: the store's "stored" event has the publisher queue its record.
        await self.store.put(ref, body, descriptor=descriptor, layer_digests=digests)
        settings = self.settings
        record = self.store.replica_record(ref, settings.uri, settings.replica_ttl_ms)
        location = settings.base_path + block_path(ref.compat_id, ref.scope_id, ref.block_key)
        return json_response(record.to_json(), 201, {"Location": location})

    async def delete_block(self, request: Request) -> Response:
        """``DELETE blocks/...`` (ours: KVSP has no client delete): an
        operator removes a block, the admin role only. Its replica record is
        withdrawn from the IS first (P3). A leased block is refused (412,
        LE2) unless ``?force=true`` (a poisoned block goes even so, as data
        lost to a fault would, LE4)."""
        ref = _ref(request)
        self.policy.require_role(self.who(request), "admin")
        force = _force(request)
        await self.store.delete(ref, force=force)
        log.warning(
            "block %s removed by %s%s",
            ref.block_key,
            self.who(request),
            " (forced)" if force else "",
        )
        return empty_response(204)

    async def purge_scope(self, request: Request) -> Response:
        """``DELETE scopes/{scope}`` (ours): every block of a scope leaves the
        holder (a tenant leaving, a poisoned cache), each withdrawn first
        (P3); the admin role only. Leased blocks stay unless ``?force=true``;
        the answer counts both."""
        scope = request.path_params["scope"]
        if not _HEX32.fullmatch(scope):
            raise NotFound("no such scope (32 lowercase hex)")
        self.policy.require_role(self.who(request), "admin")
        removed, kept = await self.store.purge(scope, force=_force(request))
        log.warning(
            "scope %s purged by %s: %d blocks removed, %d leased kept",
            scope,
            self.who(request),
            removed,
            kept,
        )
        return json_response({"scope_id": scope, "removed": removed, "leased_kept": kept})

    async def create_lease(self, request: Request) -> Response:
        client = self.who(request)
        grant = self.policy.grant(client)
        wanted = LeaseRequest.from_json(
            await read_json(request, self.settings.max_json_octets), self.settings.max_lease_keys
        )

        def allowed(ref: BlockRef) -> bool:
            # Only blocks of scopes the client may read are leased (SEC1).
            return (
                grant.can_read(ref.scope_id)
                and wanted.scope_id in (None, ref.scope_id)
                and wanted.compat_id in (None, ref.compat_id)
            )

        assert client is not None
        if self.store.recovering:
            await self.store.find_keys(wanted.block_keys)
        lease = self.store.lease(client, wanted.block_keys, wanted.ttl_ms, allowed)
        location = self.settings.base_path + f"leases/{lease.id}"
        return json_response(_lease_json(lease, self.store.clock), 201, {"Location": location})

    async def renew_lease(self, request: Request) -> Response:
        client = self.who(request)
        self.policy.grant(client)
        body = await read_json(request, self.settings.max_json_octets)
        if not isinstance(body, dict):
            raise BadRequest('renewal body must be {"ttl_ms": <integer>}')
        ttl_ms = check_int(body.get("ttl_ms"), "renewal.ttl_ms", lo=1, hi=UINT32_MAX)
        assert client is not None
        lease = self.store.renew_lease(client, request.path_params["lease_id"], ttl_ms)
        return json_response(_lease_json(lease, self.store.clock))

    async def release_lease(self, request: Request) -> Response:
        client = self.who(request)
        self.policy.grant(client)
        assert client is not None
        self.store.release_lease(client, request.path_params["lease_id"])
        return empty_response()


def create_app(
    settings: HolderSettings,
    store: TieredStore,
    policy: Policy,
    publisher: IndexPublisher | None = None,
    *,
    listening: Listening | None = None,
    shutdown: Shutdown | None = None,
) -> Starlette:
    """The holder app over ``store``, authorizing with ``policy``.

    ``publisher`` (when the holder publishes to an IS) hears of replicas
    from the store's events; it runs with the app's lifespan, from the
    moment the listener listens (``listening``: its first round republishes
    what was recovered). At a graceful stop the lifespan stops it, spills
    what only memory holds into a persistent tier, then sends what is
    queued and withdraws the replicas that do not outlive the process, in
    what is left of ``shutdown``'s deadline.
    """
    stopping = shutdown or Shutdown()

    async def stop() -> None:
        # One budget for the store's spill and the IS: what the listener's
        # grace left, at least a second each.
        spill_s, withdraw_s = stopping.share(0.6), stopping.share(0.4)
        done: dict[str, int] = {}

        async def spill() -> None:
            done["spilled"] = await store.spill(spill_s)

        async def withdraw() -> None:
            assert publisher is not None
            done["withdrawn"] = await publisher.withdraw_volatile(withdraw_s / 2)

        # What only memory holds goes down to a persistent tier while there
        # is room and time (a restart serves it again) ...
        steps: list[Step] = [spill]
        if publisher is not None:
            # ... and the replicas that still do not survive the process
            # leave the IS; the rest stays published (withdrawals queued
            # while the IS was away go too, P3). One failing step does not
            # skip the others.
            steps += [lambda: publisher.drain(withdraw_s / 2), withdraw, publisher.close]
        await run_steps(steps)
        # What the stop did, once done (the operator's record of it).
        kept = sum(
            1
            for info in store.blocks()
            if any(store.slots[x.slot].tier.persistent for x in info.segments)
        )
        log.info(
            "stopped: %d segments spilled to persistent tiers; %d blocks kept there "
            "(published still: a restart serves them), %s replicas of memory-only blocks "
            "withdrawn from the IS",
            done.get("spilled", 0),
            kept,
            done.get("withdrawn", "no") if publisher is not None else "no",
        )

    def lifespan(app: Starlette) -> AbstractAsyncContextManager[None]:
        services = [publisher] if publisher is not None else []
        return running(services, after=listening, then=[stop])

    holder = Holder(settings, store, policy)
    metrics = Metrics(store, publisher)
    app = role_app(
        settings.base_path,
        holder.routes(),
        metrics,
        policy,
        settings.allow_anonymous,
        lifespan=lifespan,
        name="holder",
    )
    app.state.store = store
    app.state.settings = settings
    return app


def _by_method(handlers: Mapping[str, Callable[[Request], Any]]) -> Callable[[Request], Any]:
    async def dispatch(request: Request) -> Response:
        handler = handlers[request.method]
        request.scope["endpoint"] = handler  # the metrics' route label: get_block, put_block
        response: Response = await handler(request)
        return response

    return dispatch


def _force(request: Request) -> bool:
    value = request.query_params.get("force", "false")
    if value not in ("true", "false"):
        raise BadRequest(f"force={value!r}: true or false")
    return value == "true"


def _wants_transcode(codec: str, stored: int, ref: BlockRef, settings: HolderSettings) -> bool:
    try:
        value = int(codec)
    except ValueError:
        raise BadRequest(f"codec={codec!r} is not an integer") from None
    # A holder MAY transcode (BL3): only between codecs it has, with the geometry known.
    return value != stored and value in CODECS and ref.compat_id in settings.known_descriptors


def _block_headers(digest: str, settings: HolderSettings) -> dict[str, str]:
    return {
        "Repr-Digest": digest,  # BL4
        # BL5: records are refreshed every ttl/3, so a replica's remaining TTL
        # never drops below two thirds of it; a third is always within it.
        "Cache-Control": block_cache_control(settings.replica_ttl_ms // 3),
    }


async def _stream(read: Any) -> AsyncIterator[Any]:
    async for chunk in read:
        yield chunk


async def _from_memory(chunks: list[Any]) -> AsyncIterator[Any]:
    for chunk in chunks:
        yield chunk
