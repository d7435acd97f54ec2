"""Async KVSP client for holders: blocks and leases, with verification (BL6).

The data path uses aiohttp, which moves large bodies several times faster
than httpx on this kind of machine; connections are pooled and authenticate
with the client certificate of the given SSL context (H1).

Every block fetched is verified before it is returned:

* ``Repr-Digest`` against the octets received (BL4, BL6);
* with the replica's codec and a Replica Record, every returned layer against
  the record's layer digests, and the replica digest when all layers came.

The two hashes run in worker threads at the same time (hashlib releases the
GIL), so both cores work (:mod:`kvstore.verify`). A mismatch raises :class:`DigestMismatch`; the
fall-back helper :meth:`HolderClient.fetch_first` treats it, and a 404, as a
miss and moves on to the next replica (P4, BL8).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urljoin

import aiohttp

from .fetch import BlockFetcher, BlockRequest, Source
from .logs import describe
from .protocol._bytes import BytesLike
from .protocol.control import (
    InstanceStatus,
    ReshardMessage,
    ResumeRequest,
    SessionCheckpoint,
    StateChange,
)
from .protocol.problems import (
    BadGateway,
    DigestMismatch,
    InvalidRecord,
    KvspError,
    NotFound,
)
from .protocol.records import (
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaRecord,
)
from .protocol.residency import ResidencyAnswer, ResidencyUpdate
from .protocol.wire import (
    BLOCK_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    Hex,
    block_path,
    format_layers,
    hex_id,
    replica_path,
    role_id,
)
from .unreachable import error_of, unreachable
from .verify import verify_block

log = logging.getLogger("kvstore.client")

DigestReporter = Callable[[ReplicaRecord, DigestMismatch], Awaitable[None]]


def _base(uri: str) -> str:
    return uri if uri.endswith("/") else uri + "/"


def _block_path(compat_id: Hex, scope_id: Hex, block_key: Hex) -> str:
    return block_path(
        hex_id(compat_id, 32, "compat_id"),
        hex_id(scope_id, 16, "scope_id"),
        hex_id(block_key, 32, "block_key"),
    )


class _Http:
    """Pooled HTTPS connections with the client certificate of ``ssl_context``.

    Without one, https servers are still verified against the system's CAs;
    ``verify=False`` (development against a self-signed server, never in a
    deployment) turns that off, explicitly."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        *,
        timeout_s: float = 30.0,
        connections: int = 64,
        verify: bool = True,
        fetch_threads: int | None = None,
    ) -> None:
        if ssl_context is not None:
            self._ssl: ssl.SSLContext | bool = ssl_context
        else:
            self._ssl = bool(verify)  # True: aiohttp verifies against the system CAs
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None
        self._fetch_threads = fetch_threads
        self._fetcher: BlockFetcher | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl, limit=self._connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._fetcher is not None:
            fetcher, self._fetcher = self._fetcher, None
            await asyncio.to_thread(fetcher.close)

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(
        self, method: str, url: str, *, expect: Iterable[int], **kw: Any
    ) -> tuple[int, dict[str, str], bytes]:
        try:
            async with self._http().request(method, url, **kw) as response:
                body = await response.read()
                headers = {k.lower(): v for k, v in response.headers.items()}
                if response.status not in set(expect):
                    raise error_of(response.status, headers, body)
                return response.status, headers, body
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as exc:
            raise unreachable(method, url, exc, self._timeout_s) from exc


class HolderClient(_Http):
    """A pooled client for any number of holders: blocks and leases."""

    async def get_block(
        self,
        holder: str,
        compat_id: Hex,
        scope_id: Hex,
        block_key: Hex,
        *,
        layers: tuple[int, int] | None = None,
        codec: int | None = None,
        record: ReplicaRecord | None = None,
    ) -> bytes:
        """Fetch a block (or a layer range) and verify it (BL6); returns the container."""
        params = {}
        if layers is not None:
            params["layers"] = format_layers(*layers)
        if codec is not None:
            params["codec"] = str(codec)
        url = urljoin(_base(holder), _block_path(compat_id, scope_id, block_key))
        _, headers, body = await self._request("GET", url, expect=[200], params=params)
        if "repr-digest" not in headers:
            raise DigestMismatch(f"{url}: no Repr-Digest field")
        await verify_block(body, headers["repr-digest"], record)
        return body

    async def get_blocks(
        self,
        holder: str,
        compat_id: Hex,
        scope_id: Hex,
        block_keys: Sequence[Hex],
        *,
        records: Sequence[ReplicaRecord | None] | None = None,
        concurrency: int = 4,
    ) -> list[memoryview]:
        """Several blocks of one holder at once, each verified (BL6) as
        :meth:`get_block` does, on the threads of :mod:`kvstore.fetch`
        (``fetch_threads``): each block received, decrypted and hashed in a
        thread of its own, at most ``concurrency`` (and the pool's threads)
        in flight. The containers in the order of ``block_keys``; the first
        failure in that order is raised once all have ended."""
        if records is not None and len(records) != len(block_keys):
            raise ValueError("records: one per block key (None where there is none)")
        base = _base(holder)
        requests = []
        for i, key in enumerate(block_keys):
            record = records[i] if records is not None else None
            source: Source = base
            if record is not None:
                # Verified against the record, fetched from the holder asked.
                source = record if record.holder == base else replace(record, holder=base)
            requests.append(
                BlockRequest(
                    hex_id(compat_id, 32, "compat_id"),
                    hex_id(scope_id, 16, "scope_id"),
                    hex_id(key, 32, "block_key"),
                    (source,),
                )
            )
        results = await self.fetcher().afetch(requests, limit=max(1, concurrency))
        for result in results:
            if result.data is None:
                key = result.request.block_key
                raise result.errors[-1] if result.errors else KvspError(f"{key}: not fetched")
        return [result.data for result in results if result.data is not None]

    def fetcher(self) -> BlockFetcher:
        """This client's pool of fetching threads (:mod:`kvstore.fetch`)."""
        if self._fetcher is None:
            context = self._ssl if isinstance(self._ssl, ssl.SSLContext) else None
            if self._ssl is False:  # explicitly unverified (development only)
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            self._fetcher = BlockFetcher(
                context, threads=self._fetch_threads, timeout_s=self._timeout_s
            )
        return self._fetcher

    async def has_block(self, holder: str, compat_id: Hex, scope_id: Hex, block_key: Hex) -> bool:
        """``HEAD`` of a block: True if the holder serves it, False on a 404."""
        url = urljoin(_base(holder), _block_path(compat_id, scope_id, block_key))
        status, _, _ = await self._request("HEAD", url, expect=[200, 404])
        return status == 200

    async def put_block(
        self, holder: str, compat_id: Hex, scope_id: Hex, block_key: Hex, data: BytesLike
    ) -> ReplicaRecord:
        """Store a block (BL7); :class:`PreconditionFailed` when the holder has one."""
        url = urljoin(_base(holder), _block_path(compat_id, scope_id, block_key))
        headers = {"If-None-Match": "*", "Content-Type": BLOCK_MEDIA_TYPE}
        _, _, body = await self._request("PUT", url, expect=[201], data=data, headers=headers)
        return ReplicaRecord.from_json(json.loads(body))

    async def shards(self, holder: str) -> list[str]:
        """``GET {base}shards`` (ours, not KVSP): the base URIs of every
        worker of the holder process behind ``holder`` (docs/workers.md);
        :class:`NotFound` from a holder that has none (another implementation)."""
        _, _, body = await self._request("GET", urljoin(_base(holder), "shards"), expect=[200])
        try:
            listed = json.loads(body).get("holders")
        except (ValueError, AttributeError):
            listed = None
        if not isinstance(listed, list) or not all(isinstance(u, str) for u in listed):
            raise KvspError(f"{holder}shards: no list of holder URIs")
        return listed

    async def fetch_first(
        self,
        records: Sequence[ReplicaRecord],
        *,
        layers: tuple[int, int] | None = None,
        on_digest_failure: DigestReporter | None = None,
        producer_digest: str | None = None,
    ) -> tuple[bytes, ReplicaRecord] | None:
        """Try replicas in order; a 404 or a failed digest is a miss (P4, BL8).

        Returns the first verified container and its record, or None: the
        caller recomputes. With ``producer_digest``, replicas whose record
        states another digest are skipped (SEC2). Digest failures are reported through
        ``on_digest_failure`` (e.g. to withdraw the replica at the IS).
        """
        for record in records:
            if producer_digest is not None and record.digest != producer_digest:
                # SEC2 pinning: only replicas carrying the digest the producing
                # instance published are accepted.
                continue
            try:
                body = await self.get_block(
                    record.holder,
                    record.compat_id,
                    record.scope_id,
                    record.block_key,
                    layers=layers,
                    record=record,
                )
                return body, record
            except DigestMismatch as exc:
                log.warning("digest failure from %s: %s", record.holder, exc.detail)
                if on_digest_failure is not None:
                    await on_digest_failure(record, exc)
            except NotFound:
                continue
            except KvspError as exc:
                # Unreachable holder, 5xx, unlisted codes by class (H4): next.
                log.info("replica at %s unusable: %s", record.holder, exc.detail)
        return None

    # --- leases ---------------------------------------------------------

    async def lease(
        self,
        holder: str,
        block_keys: Sequence[Hex],
        ttl_ms: int,
        *,
        scope_id: Hex | None = None,
        compat_id: Hex | None = None,
    ) -> LeaseGrant:
        """``POST leases`` (LE1)."""
        keys = tuple(hex_id(k, 32, "block_keys[]") for k in block_keys)
        scope = None if scope_id is None else hex_id(scope_id, 16, "scope_id")
        compat = None if compat_id is None else hex_id(compat_id, 32, "compat_id")
        body = LeaseRequest(keys, ttl_ms, scope, compat).to_json()
        _, _, raw = await self._request(
            "POST", urljoin(_base(holder), "leases"), expect=[200, 201], json=body
        )
        return LeaseGrant.from_json(json.loads(raw))

    async def renew_lease(self, holder: str, lease_id: str, ttl_ms: int) -> LeaseGrant:
        url = urljoin(_base(holder), f"leases/{lease_id}")
        _, _, raw = await self._request("PUT", url, expect=[200], json={"ttl_ms": ttl_ms})
        return LeaseGrant.from_json(json.loads(raw))

    async def release_lease(self, holder: str, lease_id: str) -> None:
        url = urljoin(_base(holder), f"leases/{lease_id}")
        await self._request("DELETE", url, expect=[200, 204])


class IndexClient(_Http):
    """A client of an Index Service: publish and withdraw replica records (P1-P3)."""

    def __init__(
        self, index_uri: str, ssl_context: ssl.SSLContext | None = None, **kw: Any
    ) -> None:
        super().__init__(ssl_context, **kw)
        self.index_uri = _base(index_uri)

    async def publish(self, record: ReplicaRecord) -> int:
        """``PUT replicas/{holder-id}/{block_key}``: publish or refresh (idempotent, P2).

        Returns the TTL the IS granted (it may cap the one asked for).
        """
        url = urljoin(self.index_uri, replica_path(record.holder, record.block_key))
        payload = json.dumps(record.to_json()).encode()
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        _, _, raw = await self._request(
            "PUT", url, expect=[200, 201, 204], data=payload, headers=headers
        )
        try:
            granted = json.loads(raw).get("ttl_ms") if raw else None
        except (ValueError, AttributeError):
            granted = None
        if isinstance(granted, int) and not isinstance(granted, bool) and granted > 0:
            return min(granted, record.ttl_ms)
        return record.ttl_ms

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        """``POST lookup`` (L1, L2)."""
        url = urljoin(self.index_uri, "lookup")
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        _, _, raw = await self._request(
            "POST", url, expect=[200], data=request.encode(), headers=headers
        )
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise BadGateway(f"POST {url}: the answer is not JSON") from exc
        return LookupResponse.from_json(value)

    async def tell_residency(self, update: ResidencyUpdate) -> ResidencyAnswer:
        """``POST residency/{instance-id}`` (ours, kvstore.protocol.residency):
        what the instance holds; the IS's answer (the TTL granted, whether it
        knew the instance before, its records there)."""
        url = urljoin(self.index_uri, f"residency/{role_id(update.instance)}")
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        body = json.dumps(update.to_json()).encode()
        _, _, raw = await self._request("POST", url, expect=[200], data=body, headers=headers)
        try:
            return ResidencyAnswer.from_json(json.loads(raw))
        except (ValueError, InvalidRecord) as exc:
            raise BadGateway(f"POST {url}: the answer is not a residency answer") from exc

    async def withdraw(self, holder: str, block_key: str) -> None:
        """``DELETE replicas/{holder-id}/{block_key}``; an unknown record is already gone."""
        url = urljoin(self.index_uri, replica_path(holder, block_key))
        with contextlib.suppress(NotFound):
            await self._request("DELETE", url, expect=[200, 204])


class InstanceClient(_Http):
    """The PC's client of inference instances: directives, resume, state (PF1,
    CK5, S3). Instances accept these only from the PC's identity (SEC1, PF5)."""

    async def _post(
        self, url: str, body: dict[str, Any], expect: list[int], **kw: Any
    ) -> tuple[dict[str, str], bytes]:
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        _, found, raw = await self._request(
            "POST", url, expect=expect, data=json.dumps(body).encode(), headers=headers, **kw
        )
        return found, raw

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str:
        """``POST prefetch`` (PF1); returns the directive's status URI (``Location``)."""
        url = urljoin(_base(instance), "prefetch")
        headers, _ = await self._post(url, directive.to_json(), [202])
        location = headers.get("location")
        if not location:
            raise KvspError(f"POST {url}: 202 without a Location")
        return urljoin(url, location)

    async def prefetch_status(self, location: str) -> PrefetchStatus:
        """``GET prefetch/{id}`` (PF3)."""
        _, _, raw = await self._request("GET", location, expect=[200])
        return PrefetchStatus.from_json(json.loads(raw))

    async def resume(self, instance: str, request: ResumeRequest) -> None:
        """``POST sessions/{session}/resume`` with the checkpoint and new epoch (CK5)."""
        url = urljoin(_base(instance), f"sessions/{request.checkpoint.session}/resume")
        await self._post(url, request.to_json(), [200, 202, 204])

    async def reshard(self, instance: str, message: ReshardMessage) -> None:
        """``POST reshard``: a plan (answered 200 once loaded, RS4), a commit or an
        abort. Not bounded by the client's timeout: the caller bounds it by
        the plan's ``deadline_ms``."""
        url = urljoin(_base(instance), "reshard")
        await self._post(url, message.to_json(), [200], timeout=aiohttp.ClientTimeout(total=None))

    async def set_state(self, instance: str, state: str) -> None:
        """``PUT state`` (S3, S6)."""
        url = urljoin(_base(instance), "state")
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        body = json.dumps(StateChange(state).to_json()).encode()
        await self._request("PUT", url, expect=[200, 204], data=body, headers=headers)


class ControllerClient(_Http):
    """An instance's client of the PC: status reports and checkpoints (S1, CK1)."""

    def __init__(
        self, controller_uri: str, ssl_context: ssl.SSLContext | None = None, **kw: Any
    ) -> None:
        super().__init__(ssl_context, **kw)
        self.controller_uri = _base(controller_uri)

    async def put_status(self, status: InstanceStatus) -> str:
        """``PUT instances/{id}/status``; the state the PC answers (S3)."""
        url = urljoin(self.controller_uri, f"instances/{role_id(status.instance)}/status")
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        body = json.dumps(status.to_json()).encode()
        _, _, raw = await self._request("PUT", url, expect=[200], data=body, headers=headers)
        try:
            return StateChange.from_json(json.loads(raw)).state
        except (ValueError, KvspError) as exc:
            raise BadGateway(f"PUT {url}: the answer is not a state") from exc

    async def put_checkpoint(self, checkpoint: SessionCheckpoint) -> int:
        """``PUT sessions/{session}/checkpoint`` (CK1); the output_offset the PC
        holds for the session, which acknowledges every token below it (CK3)."""
        url = urljoin(self.controller_uri, f"sessions/{checkpoint.session}/checkpoint")
        headers = {"Content-Type": JSON_MEDIA_TYPE}
        body = json.dumps(checkpoint.to_json()).encode()
        _, _, raw = await self._request("PUT", url, expect=[200], data=body, headers=headers)
        try:
            answer = json.loads(raw)
            if answer["epoch"] != checkpoint.epoch:
                return 0
            return int(answer["output_offset"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadGateway(f"PUT {url}: the answer is not an acknowledgement") from exc

    async def end_session(self, session: str) -> None:
        """``DELETE sessions/{session}`` (ours): the owner's session is over."""
        url = urljoin(self.controller_uri, f"sessions/{session}")
        with contextlib.suppress(NotFound):
            await self._request("DELETE", url, expect=[200, 204])

    async def session(self, session: str) -> tuple[str, int]:
        """``GET sessions/{session}`` (ours): its owner and epoch now."""
        url = urljoin(self.controller_uri, f"sessions/{session}")
        _, _, raw = await self._request("GET", url, expect=[200])
        try:
            answer = json.loads(raw)
            return str(answer["instance"]), int(answer["epoch"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadGateway(f"GET {url}: the answer is not a session") from exc


MAX_EVENTS = 4096


@dataclass(frozen=True, slots=True)
class OutputToken:
    """One output token of a session: its index in the output and the epoch
    of the instance that produced it (CK4)."""

    index: int
    token: int
    epoch: int
    logprob: float | None = None


class FrontEnd(_Http):
    """A front end's client of generation: starts a session on an instance
    (our ``POST generate``) and follows it, across migrations, to its end.

    Every output index is delivered once, in order (CK3: what a resumed
    instance regenerates is dropped by index), and tokens of an epoch lower
    than one already seen are dropped (CK4). When the stream breaks or the
    instance reports the session moved, the PC says where the session is now
    (``GET sessions/{session}``) and the stream goes on there from the next
    index."""

    def __init__(
        self,
        controller_uri: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        follow_timeout_s: float = 60.0,
        idle_timeout_s: float = 30.0,
        **kw: Any,
    ) -> None:
        super().__init__(ssl_context, **kw)
        self.controller = ControllerClient(controller_uri, ssl_context) if controller_uri else None
        self.follow_timeout_s, self.idle_timeout_s = follow_timeout_s, idle_timeout_s
        #: What the last session's end said (stats), and the events seen (the
        #: first MAX_EVENTS); one session at a time per FrontEnd.
        self.last_end: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []

    async def close(self) -> None:
        if self.controller is not None:
            await self.controller.close()
        await super().close()

    async def _lines(
        self, method: str, url: str, **kw: Any
    ) -> AsyncGenerator[dict[str, Any], None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.idle_timeout_s)
        async with self._http().request(method, url, timeout=timeout, **kw) as response:
            if response.status != 200:
                body = await response.read()
                headers = {k.lower(): v for k, v in response.headers.items()}
                raise error_of(response.status, headers, body)
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)

    async def generate(self, instance: str, request: dict[str, Any]) -> AsyncIterator[OutputToken]:
        """The output of a new session started at ``instance`` with the body
        ``request`` (``scope_id``, ``tokens``, ``max_tokens``, ``sampler``...;
        a ``session`` UUID is added when missing)."""
        body = dict(request)
        session = body.setdefault("session", str(uuid.uuid4()))
        self.session = session
        owner, epoch, next_index = instance, 0, 0
        self.events = []
        started = False
        deadline = None
        while True:
            if started:
                stream = self._lines(
                    "GET",
                    urljoin(_base(owner), f"sessions/{session}/tokens"),
                    params={"from": str(next_index)},
                )
            else:
                stream = self._lines(
                    "POST",
                    urljoin(_base(owner), "generate"),
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": JSON_MEDIA_TYPE},
                )
            ended = None
            try:
                async with contextlib.aclosing(stream):
                    async for event in stream:
                        if len(self.events) < MAX_EVENTS:
                            self.events.append(event)
                        started = True
                        if event.get("epoch", 0) < epoch:
                            continue  # CK4: an instance fenced off by a newer epoch
                        epoch = event.get("epoch", epoch)
                        if "index" in event:
                            if event["index"] > next_index:
                                break  # a gap: read again from the next index
                            if event["index"] < next_index:
                                continue  # CK3: delivered already
                            next_index += 1
                            deadline = None
                            yield OutputToken(
                                event["index"], event["token"], event["epoch"], event.get("logprob")
                            )
                        elif event.get("event") in ("done", "moved", "error"):
                            ended = event
                            break
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.info("session %s: stream from %s broke: %s", session, owner, describe(exc))
            except KvspError:
                if not started:
                    raise  # refused outright (a problem answer): nothing to follow
            if ended is not None and ended["event"] == "done":
                if ended.get("output_tokens", next_index) <= next_index:
                    self.last_end = ended
                    return
                ended = None  # tokens are missing: read them again
            if ended is not None and ended["event"] == "error":
                raise KvspError(f"session {session} failed: {ended.get('detail')}")
            if not started or self.controller is None:
                raise KvspError(f"session {session}: the stream from {owner} ended early")
            deadline = deadline or time.monotonic() + self.follow_timeout_s
            owner, epoch = await self._owner(session, owner, epoch, deadline)

    async def _owner(self, session: str, last: str, epoch: int, deadline: float) -> tuple[str, int]:
        """Where the session is now: the PC's owner once its epoch moved past
        ``epoch``, else the last instance again (it may still be there)."""
        assert self.controller is not None
        while True:
            if time.monotonic() > deadline:
                raise KvspError(f"session {session}: lost (no instance took it over in time)")
            try:
                owner, current = await self.controller.session(session)
            except NotFound:
                owner, current = last, epoch  # ended: the last instance has its end
            except KvspError as exc:
                log.info("session %s: asking the PC: %s", session, exc.detail)
                owner, current = last, epoch
            if current > epoch or owner != last:
                return owner, current
            await asyncio.sleep(0.2)
            if await self._reachable(last, session):
                return last, epoch

    async def _reachable(self, instance: str, session: str) -> bool:
        url = urljoin(_base(instance), f"sessions/{session}")
        try:
            _, _, raw = await self._request(
                "GET", url, expect=[200], timeout=aiohttp.ClientTimeout(total=2)
            )
            # A failed session is reached too: its stream ends with its error.
            return json.loads(raw).get("state") in ("running", "done", "failed")
        except (KvspError, ValueError):
            return False
