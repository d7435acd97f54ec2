"""Fetch at the speed of prefill (issue 35): blocks received, decrypted and
verified on as many cores as the caller gives.

A KV cache pays only when loading a prefix beats recomputing it. One event
loop that receives, decrypts (TLS), parses HTTP and takes both SHA-256
passes of BL6 is held to one core whatever the machine has. Here each block
is fetched by a worker thread of a pool over a blocking HTTP/1.1 connection
of its own (kept alive, one per thread and holder); ``ssl`` decrypts
straight into the block's buffer and ``hashlib`` digests it where it lies,
both without the GIL, so K threads use K cores::

    fetcher = BlockFetcher(client_context(...), threads=8)
    wanted = [BlockRequest(compat, scope, key, [record_or_holder, ...], into=buf)
              for key, buf in ...]
    for done in fetcher.fetch(wanted):         # engine threads: as each completes
        ...
    results = await fetcher.afetch(wanted, on_done=...)   # event loops

Each octet is touched as few times as the two digests allow: decrypted into
the caller's buffer (a ``bytearray``, a memoryview of pinned host memory, a
CPU tensor), then, while it is still in cache (a read is at most
``chunk_octets``), hashed for the ``Repr-Digest`` (BL4) and, with the
replica's record, for its layer's digest (B3): a layer is checked against
the record the moment its last octet arrives (BL6), so a flipped octet is
named by its layer, and ``on_layer`` hands each verified layer to the
caller before the block is complete (B4). The replica digest is checked
when all layers came. Nothing is copied after the decryption.

Failure is decided here, in one place (STYLE 8, BL8): a block whose digest
fails is discarded and reported (``on_digest_failure``) and the next source
is tried; a 404 tries the next source; a holder that cannot be reached or
does not answer in time costs one timeout, is then skipped by every other
request for ``down_backoff_s`` and the block comes from the next source; a
block no source served is a result without data (the caller recomputes),
with every source's error. The errors of one holder never touch the blocks
another holder serves.

Cancelling (:meth:`Batch.cancel`, or cancelling :meth:`BlockFetcher.afetch`)
shuts the sockets of the reads in progress down and returns only once no
thread works on any buffer of the batch any more.

PUT (:meth:`BlockFetcher.put`): the container is built in the pool (the
caller's ``build``, e.g. from tensors), its layer digests taken there, the
body sent from where it lies, and the holder's Replica Record checked
against what was sent: a holder that stored other octets is an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .cores import available_cores
from .holderset import DownHolders
from .logs import describe
from .protocol import container as kc
from .protocol._bytes import BytesLike
from .protocol.problems import (
    DigestMismatch,
    HolderUnavailable,
    KvspError,
    MalformedContainer,
    NotFound,
    PayloadTooLarge,
    Unreachable,
)
from .protocol.records import ReplicaRecord
from .protocol.stream import LayerHasher
from .protocol.wire import (
    BLOCK_MEDIA_TYPE,
    block_path,
    format_layers,
    hex_id,
)
from .unreachable import error_of, unreachable
from .verify import StreamCheck

log = logging.getLogger("kvstore.fetch")

#: Octets read (decrypted) before they are hashed: small enough to be hashed
#: while still in the core's cache, large enough that Python's overhead per
#: read is nothing beside the work.
CHUNK_OCTETS = 256 * 1024
#: The most threads a fetcher starts by default, whatever the machine has.
MAX_DEFAULT_THREADS = 32
#: Most octets of an error answer read (a problem+json is small).
_ERROR_BODY = 64 * 1024


def default_threads() -> int:
    return min(available_cores(), MAX_DEFAULT_THREADS)


Source = str | ReplicaRecord
"""Where a block may be fetched: a holder's base URI (Repr-Digest checked
only), or the replica's record (its layer and replica digests too, BL6)."""


@dataclass(slots=True)
class BlockRequest:
    """One block (or a layer range of it) to fetch, from the first of
    ``sources`` that serves it verified."""

    compat_id: str
    scope_id: str
    block_key: str
    sources: Sequence[Source]
    #: Inclusive layer range (BL2); None: the whole block.
    layers: tuple[int, int] | None = None
    #: The caller's buffer (a bytearray, a writable memoryview, a CPU
    #: tensor): the container lands at its start. Its contents are
    #: undefined unless the result is ``ok``. None: one is allocated.
    into: Any = None
    #: Anything the caller wants back with the result.
    tag: Any = None
    #: ``on_layer(layer)``, in a pool thread, for each layer once it is
    #: verified (B4): with the replica's record, the moment its last octet
    #: arrived and its digest matched; without one, once the Repr-Digest of
    #: the whole answer matched. Views of the buffer, valid while it is.
    on_layer: Callable[[kc.Layer], None] | None = None


@dataclass(slots=True)
class Fetched:
    """What became of one :class:`BlockRequest`."""

    #: Its position in the batch.
    index: int
    request: BlockRequest
    #: The verified container (a view of ``request.into`` or of a new
    #: buffer); None: no source served it (recompute), or cancelled.
    data: memoryview | None = None
    #: The holder that served it, and its record (None: a bare holder URI).
    holder: str | None = None
    record: ReplicaRecord | None = None
    #: One error for each source that failed, in the order tried.
    errors: list[KvspError] = field(default_factory=list)
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.data is not None


DigestFailure = Callable[[Source, DigestMismatch], None]


class _Cancelled(Exception):
    pass


class _Target:
    """A holder's base URI taken apart once: scheme, address, path prefix."""

    __slots__ = ("base", "host", "https", "key", "path", "port")

    def __init__(self, base: str) -> None:
        base = base if base.endswith("/") else base + "/"
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base!r}: not an http(s) holder URI")
        self.base = base
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.path = parts.path
        self.key = (self.https, self.host, self.port)


class Batch:
    """Requests handed to the pool: their results as each completes."""

    def __init__(
        self,
        fetcher: BlockFetcher,
        requests: Sequence[BlockRequest],
        on_done: Callable[[Fetched], None] | None,
        limit: int | None,
    ) -> None:
        self._fetcher = fetcher
        self.requests = list(requests)
        self._on_done = on_done
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._active: dict[int, socket.socket] = {}  # request index -> its socket
        self._done: list[Fetched | None] = [None] * len(self.requests)
        self._finished_count = 0
        self._queue: list[Fetched] = []
        self._ready = threading.Condition(self._lock)
        #: Set once every request has its result and no thread works on the batch.
        self.finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._next = min(len(self.requests), limit or len(self.requests))
        if not self.requests:
            self.finished.set_result(None)
        for i in range(self._next):
            self._submit(i)

    # --- the caller's side ---------------------------------------------

    def __iter__(self) -> Iterator[Fetched]:
        """The results in the order they complete (blocking)."""
        given = 0
        while given < len(self.requests):
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                ready, self._queue = self._queue, []
            given += len(ready)
            yield from ready

    def results(self) -> list[Fetched]:
        """Every result, in the order of the requests (blocking)."""
        self.wait()
        return [r for r in self._done if r is not None]

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until no thread works on the batch; whether that came in time."""
        try:
            self.finished.result(timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def cancel(self) -> None:
        """Stop: requests not started are not, reads in progress are cut
        (their sockets shut down). Returns at once; :meth:`wait` (or
        awaiting :meth:`BlockFetcher.afetch`) tells when no thread writes
        any buffer of the batch any more."""
        self._cancelled.set()
        with self._lock:
            active = list(self._active.values())
        for sock in active:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # --- the pool's side -----------------------------------------------

    def _submit(self, i: int) -> None:
        try:
            self._fetcher._pool.submit(self._run, i)
        except RuntimeError:  # the fetcher was closed meanwhile
            self._finish(Fetched(i, self.requests[i], cancelled=True))

    def _run(self, i: int) -> None:
        request = self.requests[i]
        if self._cancelled.is_set():
            result = Fetched(i, request, cancelled=True)
        else:
            try:
                result = self._fetcher._fetch_one(self, i, request)
            except _Cancelled:
                result = Fetched(i, request, cancelled=True)
            except Exception as exc:  # a bug here must not hang the caller
                log.exception("fetch of block %s failed unexpectedly", request.block_key)
                error = exc if isinstance(exc, KvspError) else KvspError(describe(exc))
                result = Fetched(i, request, errors=[error])
        with self._lock:  # the next request of a limited batch
            more = self._next < len(self.requests)
            following, self._next = self._next, self._next + more
        if more:
            self._submit(following)
        self._finish(result)

    def _finish(self, result: Fetched) -> None:
        with self._ready:
            self._done[result.index] = result
            self._queue.append(result)
            self._ready.notify_all()
        if self._on_done is not None:
            try:
                self._on_done(result)
            except Exception:
                log.exception("on_done callback failed")
        with self._lock:  # after on_done: its effects come before ``finished``
            self._finished_count += 1
            last = self._finished_count == len(self.requests)
        if last:
            self.finished.set_result(None)

    def _reading(self, i: int, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is None:
                self._active.pop(i, None)
            else:
                self._active[i] = sock
        if sock is not None and self._cancelled.is_set():
            raise _Cancelled


class _Connections(threading.local):
    def __init__(self) -> None:
        self.by_target: dict[tuple[bool, str, int], http.client.HTTPConnection] = {}


class BlockFetcher:
    """A pool of threads fetching and verifying blocks; see the module
    docstring. One per process is enough (it is thread-safe); close it."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        *,
        threads: int | None = None,
        timeout_s: float = 30.0,
        down_backoff_s: float = 5.0,
        down: DownHolders | None = None,
        chunk_octets: int = CHUNK_OCTETS,
        max_octets: int = 1 << 30,
        limits: kc.Limits = kc.DEFAULT_LIMITS,
        verify: bool = True,
        on_digest_failure: DigestFailure | None = None,
        put_threads: int | None = None,
    ) -> None:
        """``threads``: the pool's size (default: the cores this process
        may use, at most 32). ``put_threads``: a pool of its own for PUTs
        (default half as many), so that a flood of stores never queues a
        load behind it. ``timeout_s``: the most one request to one
        holder may take, connecting included. ``max_octets``: the largest
        block a holder may announce when no buffer is given (a lying
        Content-Length costs an error, not an allocation). ``verify=False``
        skips the digests (benchmarks only: BL6 requires them)."""
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError("threads: at least 1")
        if ssl_context is None:
            ssl_context = ssl.create_default_context()
        self._ssl = ssl_context
        self.timeout_s = timeout_s
        #: Holders skipped after a failure (shared with a caller's own, if given).
        self.down = down or DownHolders(down_backoff_s)
        self.chunk_octets = max(16 * 1024, chunk_octets)
        self.max_octets = max_octets
        self.limits = limits
        self.verify = verify
        self.on_digest_failure = on_digest_failure
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "kvstore-fetch")
        self.put_threads = put_threads or max(1, self.threads // 2)
        self._put_pool = concurrent.futures.ThreadPoolExecutor(self.put_threads, "kvstore-put")
        self._local = _Connections()
        self._all: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._targets: dict[str, _Target] = {}

    def close(self) -> None:
        """Wait for the work in progress, then close every connection."""
        self._pool.shutdown(wait=True)
        self._put_pool.shutdown(wait=True)
        with self._lock:
            connections, self._all = list(self._all), set()
        for conn in connections:
            conn.close()

    def __enter__(self) -> BlockFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- GET ---------------------------------------------------------------

    def submit(
        self,
        requests: Sequence[BlockRequest],
        on_done: Callable[[Fetched], None] | None = None,
        *,
        limit: int | None = None,
    ) -> Batch:
        """Hand ``requests`` to the pool; ``on_done(result)`` is called in a
        pool thread as each completes; at most ``limit`` of them in flight
        at once (None: as many as the pool has threads)."""
        return Batch(self, requests, on_done, limit)

    def fetch(self, requests: Sequence[BlockRequest]) -> Generator[Fetched, None, None]:
        """The results as each completes (blocking; for engine threads).
        Leaving the loop early cancels what is left and waits for it."""
        batch = self.submit(requests)
        try:
            yield from batch
        finally:
            if not batch.wait(0):
                batch.cancel()
                batch.wait()

    async def afetch(
        self,
        requests: Sequence[BlockRequest],
        on_done: Callable[[Fetched], None] | None = None,
        *,
        limit: int | None = None,
    ) -> list[Fetched]:
        """Every result, in the order of ``requests``; ``on_done(result)``
        is called on this event loop as each completes, before this
        returns. Cancelled, the batch is cancelled and this returns
        (raising) only once no thread works on its buffers."""
        loop = asyncio.get_running_loop()
        callback = None
        if on_done is not None:
            done = on_done

            def callback(result: Fetched) -> None:
                loop.call_soon_threadsafe(done, result)

        batch = self.submit(requests, callback, limit=limit)
        waited = asyncio.wrap_future(batch.finished)
        try:
            await asyncio.shield(waited)
        except asyncio.CancelledError:
            batch.cancel()
            await asyncio.gather(waited, return_exceptions=True)
            raise
        return batch.results()

    def fetch_all(self, requests: Sequence[BlockRequest]) -> list[Fetched]:
        """Every result, in the order of ``requests`` (blocking)."""
        return self.submit(requests).results()

    # --- one block ----------------------------------------------------------

    def _target(self, base: str) -> _Target:
        target = self._targets.get(base)
        if target is None:
            target = self._targets[base] = _Target(base)
        return target

    def _fetch_one(self, batch: Batch, i: int, request: BlockRequest) -> Fetched:
        result = Fetched(i, request)
        try:
            path = block_path(
                hex_id(request.compat_id, 32, "compat_id"),
                hex_id(request.scope_id, 16, "scope_id"),
                hex_id(request.block_key, 32, "block_key"),
            )
        except (KvspError, ValueError) as exc:  # the caller's request, not a holder
            result.errors.append(exc if isinstance(exc, KvspError) else KvspError(str(exc)))
            return result
        query = "" if request.layers is None else "?layers=" + format_layers(*request.layers)
        for source in request.sources:
            record = source if isinstance(source, ReplicaRecord) else None
            holder = record.holder if record is not None else str(source)
            if batch.cancelled:
                raise _Cancelled
            if not self.down.up(holder):
                result.errors.append(
                    HolderUnavailable(
                        f"{holder}: skipped, it failed within the last {self.down.down_s:g} s",
                        uri=holder,
                        reason="down",
                    )
                )
                continue
            try:
                target = self._target(holder)
            except ValueError as exc:
                result.errors.append(KvspError(str(exc)))
                continue
            try:
                data = self._get(batch, i, target, target.path + path + query, record, request)
            except _Cancelled:
                raise
            except DigestMismatch as exc:
                # BL8: discarded, reported, and the next replica.
                log.warning("block %s from %s discarded: %s", request.block_key, holder, exc.detail)
                result.errors.append(exc)
                if self.on_digest_failure is not None:
                    try:
                        self.on_digest_failure(source, exc)
                    except Exception:
                        log.exception("on_digest_failure callback failed")
                continue
            except NotFound as exc:
                result.errors.append(exc)
                continue
            except Unreachable as exc:
                if batch.cancelled:
                    raise _Cancelled from exc
                self.down.failed(holder)
                log.info("holder %s unusable for %g s: %s", holder, self.down.down_s, exc.detail)
                result.errors.append(exc)
                continue
            except KvspError as exc:  # 5xx, a malformed answer: the next replica
                result.errors.append(exc)
                continue
            result.data, result.holder, result.record = data, holder, record
            return result
        return result

    def _connection(self, target: _Target) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``target``, and whether it was used before."""
        conn = self._local.by_target.get(target.key)
        if conn is not None and _stale(conn):
            self._drop(target, conn)  # the server closed it while it was idle
            conn = None
        if conn is not None:
            return conn, True
        if target.https:
            conn = http.client.HTTPSConnection(
                target.host, target.port, timeout=self.timeout_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(target.host, target.port, timeout=self.timeout_s)
        self._local.by_target[target.key] = conn
        with self._lock:
            self._all.add(conn)
        return conn, False

    def _drop(self, target: _Target, conn: http.client.HTTPConnection) -> None:
        self._local.by_target.pop(target.key, None)
        with self._lock:
            self._all.discard(conn)
        conn.close()

    def _get(
        self,
        batch: Batch,
        i: int,
        target: _Target,
        path: str,
        record: ReplicaRecord | None,
        request: BlockRequest,
    ) -> memoryview:
        url = f"{'https' if target.https else 'http'}://{target.host}:{target.port}{path}"
        for attempt in (0, 1):
            conn, reused = self._connection(target)
            response: http.client.HTTPResponse | None = None
            try:
                try:
                    if conn.sock is None:
                        conn.connect()
                    batch._reading(i, conn.sock)
                    conn.putrequest("GET", path, skip_accept_encoding=True)
                    conn.putheader("Accept", BLOCK_MEDIA_TYPE)
                    conn.endheaders()
                    response = conn.getresponse()
                except (OSError, http.client.HTTPException) as exc:
                    if _retry(exc, reused, attempt) and not batch.cancelled:
                        # A kept-alive connection the server closed meanwhile:
                        # once more on a new one (a GET is safe to repeat).
                        self._drop(target, conn)
                        continue
                    raise
                return self._receive(batch, url, response, record, request)
            except _Cancelled:
                self._drop(target, conn)
                raise
            except KvspError:
                if response is None or not response.isclosed():
                    self._drop(target, conn)  # the rest of the answer is not read
                raise
            except (OSError, http.client.HTTPException) as exc:
                self._drop(target, conn)
                if batch.cancelled:
                    raise _Cancelled from exc
                raise unreachable("GET", url, exc, self.timeout_s) from exc
            finally:
                batch._reading(i, None)
        raise AssertionError("unreachable")

    def _receive(
        self,
        batch: Batch,
        url: str,
        response: http.client.HTTPResponse,
        record: ReplicaRecord | None,
        request: BlockRequest,
    ) -> memoryview:
        deadline = time.monotonic() + self.timeout_s
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.status != 200:
            body = response.read(_ERROR_BODY)
            raise error_of(response.status, headers, body)
        length_field = headers.get("content-length")
        if length_field is None or not length_field.isdigit():
            raise MalformedContainer(f"GET {url}: a block answer without a Content-Length")
        length = int(length_field)
        if request.into is not None:
            buffer = _writable(request.into)
            if len(buffer) < length:
                raise PayloadTooLarge(
                    f"GET {url}: {length} octets do not fit the buffer given ({len(buffer)} octets)"
                )
            view = buffer[:length]
        else:
            if length > self.max_octets:
                raise PayloadTooLarge(
                    f"GET {url}: the holder announces {length} octets, "
                    f"more than max_octets ({self.max_octets})"
                )
            view = memoryview(bytearray(length))
        if self.verify and "repr-digest" not in headers:
            raise DigestMismatch(f"GET {url}: no Repr-Digest field")
        check = StreamCheck(
            f"GET {url}",
            headers.get("repr-digest") if self.verify else None,
            record if self.verify else None,
            length,
            request.on_layer,
            self.limits,
        )
        filled = 0
        while filled < length:
            if batch.cancelled:
                raise _Cancelled
            if time.monotonic() > deadline:
                raise TimeoutError(f"the body took more than {self.timeout_s:g} s")
            end = min(length, filled + self.chunk_octets)
            n = response.readinto(view[filled:end])
            if not n:
                raise http.client.IncompleteRead(bytes(0), length - filled)
            check.update(view, filled, filled + n)
            filled += n
        check.finish(view)
        return view

    # --- PUT ----------------------------------------------------------------

    def put(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        body: BytesLike | Callable[[], BytesLike],
    ) -> concurrent.futures.Future[ReplicaRecord]:
        """Store a block (BL7) from a pool thread: ``body`` (or what
        ``build()`` returns, built there) is sent where it lies, its layer
        digests taken there, and the holder's Replica Record checked against
        them (:class:`DigestMismatch`: the holder stored other octets than
        these). :class:`PreconditionFailed` when the holder has the block."""
        return self._put_pool.submit(self._put, holder, compat_id, scope_id, block_key, body)

    async def aput(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        body: BytesLike | Callable[[], BytesLike],
    ) -> ReplicaRecord:
        return await asyncio.wrap_future(self.put(holder, compat_id, scope_id, block_key, body))

    def _put(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        body: BytesLike | Callable[[], BytesLike],
    ) -> ReplicaRecord:
        data = memoryview(body() if callable(body) else body).cast("B")
        header = kc.decode_header(data, self.limits)
        if header is None or header.total_octets != len(data):
            raise MalformedContainer("PUT: the body is not one whole container")
        target = self._target(holder)
        path = target.path + block_path(
            hex_id(compat_id, 32, "compat_id"),
            hex_id(scope_id, 16, "scope_id"),
            hex_id(block_key, 32, "block_key"),
        )
        url = f"{'https' if target.https else 'http'}://{target.host}:{target.port}{path}"
        sent: bytes | None = None
        for attempt in (0, 1):
            conn, reused = self._connection(target)
            hasher = LayerHasher(limits=self.limits) if sent is None else None
            try:
                conn.putrequest("PUT", path, skip_accept_encoding=True)
                conn.putheader("Content-Type", BLOCK_MEDIA_TYPE)
                conn.putheader("If-None-Match", "*")
                conn.putheader("Content-Length", str(len(data)))
                conn.endheaders()
                for start in range(0, len(data), self.chunk_octets):
                    # Each chunk is hashed while the holder receives the one
                    # before it (the socket's buffer holds it meanwhile).
                    chunk = data[start : start + self.chunk_octets]
                    conn.send(chunk)
                    if hasher is not None:
                        hasher.feed(chunk)
                if hasher is not None:
                    hasher.close()
                    sent = kc.replica_digest(hasher.digests)
                response = conn.getresponse()
                answer = response.read(_ERROR_BODY)
                headers = {k.lower(): v for k, v in response.getheaders()}
            except (OSError, http.client.HTTPException) as exc:
                self._drop(target, conn)
                if _retry(exc, reused, attempt):
                    continue  # a kept-alive connection lost meanwhile (BL7 makes it safe)
                raise unreachable("PUT", url, exc, self.timeout_s) from exc
            if not response.isclosed():
                self._drop(target, conn)
            if response.status != 201:
                raise error_of(response.status, headers, answer)
            assert sent is not None
            stored = ReplicaRecord.from_json(json.loads(answer))
            if bytes.fromhex(stored.digest.removeprefix("sha-256:")) != sent:
                raise DigestMismatch(
                    f"PUT {url}: the holder's record states replica digest "
                    f"{stored.digest}, the octets sent have "
                    f"sha-256:{sent.hex()}"
                )
            return stored
        raise AssertionError("unreachable")


def _stale(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection has something to read: the
    server closed it (or sent what no request asked for); a new one is made."""
    if conn.sock is None:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _retry(exc: BaseException, reused: bool, attempt: int) -> bool:
    """Whether a request that failed on a kept-alive connection is made
    once more on a new one: a connection lost meanwhile, not one that did
    not answer in time (that would double the wait)."""
    return reused and attempt == 0 and not isinstance(exc, TimeoutError)


def _writable(buffer: Any) -> memoryview:
    """A flat, writable octet view of the caller's buffer (a CPU tensor too)."""
    if hasattr(buffer, "untyped_storage") and hasattr(buffer, "is_contiguous"):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("into: a contiguous CPU tensor")
        import ctypes

        octets = buffer.numel() * buffer.element_size()
        array = (ctypes.c_char * octets).from_address(buffer.data_ptr())
        return memoryview(array).cast("B")
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("into: a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


__all__ = ["Batch", "BlockFetcher", "BlockRequest", "Fetched", "Source", "default_threads"]
