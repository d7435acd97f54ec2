"""An engine's own chunk keys as KVSP blocks on kvstore holders (issue 10).

LMCache and SGLang name what they store by their own keys (a hash of a
token prefix in their own scheme), not by KVSP Block Keys. A
:class:`ChunkStore` names each as a block of a configured scope and
Compatibility Descriptor::

    block_key = HMAC-SHA-256( scope_key, "KVSTORE-CHUNK-1" || 0x00 || compat_id
                              || namespace || 0x00 || engine key )

so that only principals of the scope can find or read them (K2), keys of
different models never meet (C2), and LMCache's and SGLang's keys never
collide (the namespace). Such blocks are shared among the users of that
engine under that scope and descriptor; they are not the blocks a
token-keyed KVSP client computes for the same tokens, since the engine's
key is not the KVSP chain (docs/integrations.md).

Each name lives on one of the configured holders, chosen by rendezvous
hashing (:func:`kvstore.holderset.rank`: the same holder for a name from
every client; with one holder down, its names go to the next). A holder
run with ``[server] workers`` counts as all its workers: each configured
URI is asked for its ``shards`` once, at the first call (docs/workers.md).
A holder that fails a request is skipped for ``down_backoff_s``, so a dead
holder makes the engine miss at once rather than wait out a timeout on
every chunk.

Failures become misses here, in one place (STYLE 8): :meth:`ChunkStore.get_many`
answers None for a chunk no holder serves, :meth:`ChunkStore.put` False for
one no holder took; both are counted in :attr:`ChunkStore.stats` and logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..client import HolderClient
from ..fetch import BlockFetcher, BlockRequest, Fetched
from ..holderset import DownHolders, HolderSet, rank
from ..logs import describe
from ..protocol._bytes import BytesLike
from ..protocol.keys import scope_id
from ..protocol.problems import KvspError, NotFound, PreconditionFailed
from ..protocol.records import LeaseGrant
from .options import ChunkSettings, Geometry, options_with_prefix

__all__ = [
    "ChunkSettings",
    "ChunkStats",
    "ChunkStore",
    "Geometry",
    "LoopThread",
    "Pin",
    "options_with_prefix",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

NAME_LABEL = b"KVSTORE-CHUNK-1\x00"
#: Most Block Keys in one ``POST leases`` (a holder's ``max_lease_keys`` is 8192).
LEASE_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Pin:
    """Where a chunk is held, and the lease (LE1) that keeps it there."""

    holder: str
    #: None where the holder has it but granted no lease (its quota, LE3).
    lease: str | None
    ttl_ms: int


@dataclass(slots=True)
class ChunkStats:
    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    #: Requests a holder failed (transport, 5xx): counted, then a miss.
    errors: int = 0
    leases: int = 0
    octets_in: int = 0
    octets_out: int = 0

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class ChunkStore:
    """Chunks of one engine, by its own keys, on kvstore holders.

    Async, bound to the event loop of its first call (its connection pool
    and its gate are); :class:`LoopThread` runs one for synchronous callers.
    At most ``settings.concurrency`` requests are in flight at once, all
    calls together: a batch of a thousand chunks neither opens a thousand
    requests nor builds a thousand containers ahead of sending them."""

    def __init__(self, settings: ChunkSettings) -> None:
        self.settings = settings
        self.scope_id = scope_id(settings.scope_key).hex()
        self.compat_id = settings.descriptor.compat_id_hex
        self._prefix = NAME_LABEL + settings.descriptor.compat_id + settings.namespace.encode()
        self._client: HolderClient | None = None
        self._blocks: BlockFetcher | None = None
        self._gate: asyncio.Semaphore | None = None
        self._down = DownHolders(settings.down_backoff_s)
        #: The configured holders, each one's workers in its place once
        #: discovered (:meth:`_discover`).
        self.holders: tuple[str, ...] = settings.holders
        self._discovery: asyncio.Task[None] | None = None
        self._discover_after = 0.0
        self._warned: dict[tuple[str, int], float] = {}
        self._background: set[asyncio.Future[None]] = set()
        self.stats = ChunkStats()

    def block_key(self, name: str) -> str:
        """The Block Key a chunk of this engine is stored under (see the module)."""
        message = self._prefix + b"\x00" + name.encode()
        return hmac.digest(self.settings.scope_key, message, hashlib.sha256).hex()

    def _http(self) -> HolderClient:
        if self._client is None:
            self._client = HolderClient(
                self.settings.ssl_context, timeout_s=self.settings.timeout_s
            )
        return self._client

    def _fetcher(self) -> BlockFetcher:
        """The pool that receives and verifies blocks (:mod:`kvstore.fetch`)."""
        if self._blocks is None:
            self._blocks = BlockFetcher(
                self.settings.ssl_context,
                threads=self.settings.fetch_threads,
                timeout_s=self.settings.timeout_s,
                down=self._down,
            )
        return self._blocks

    def _slot(self) -> asyncio.Semaphore:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.settings.concurrency)
        return self._gate

    async def _discover(self) -> None:
        """The workers of every configured holder (``GET shards``), asked at
        the first call; asked again at most every 30 s while a holder did
        not answer (one that is not a kvstore holder stands for itself)."""
        discovery = self._discovery
        running = discovery is not None and not discovery.done()
        if not running and time.monotonic() < self._discover_after:
            return  # done (or asked too recently); a call meanwhile waits for it
        if discovery is None or not running:
            self._discover_after = time.monotonic() + 30.0

            async def discover() -> None:
                found = HolderSet(self.settings.holders)
                async with self._slot():
                    self.holders = await found.discover(self._http())
                if found.discovered:
                    self._discover_after = float("inf")

            self._discovery = discovery = asyncio.ensure_future(discover())
        try:
            await asyncio.shield(discovery)
        except Exception as exc:  # a miss later, never the engine's exception
            log.warning(
                "kvstore: holder discovery failed (%s); using the configured URIs", describe(exc)
            )

    def holders_for(self, block_key: str) -> list[str]:
        """Rendezvous order of the holders for a block, those marked down last."""
        return self._down.order(rank(self.holders, block_key))

    def healthy(self) -> bool:
        """Whether some holder is not being skipped for a failure now."""
        return any(self._up(h) for h in self.holders)

    def _up(self, holder: str) -> bool:
        return self._down.up(holder)

    def _failed(self, holder: str, what: str, exc: Exception) -> None:
        """Count a failed request; a holder that fails (5xx, unreachable) is
        skipped for a while; a refusal is logged loudly, once a minute, as
        it means a configuration to fix (the policy, the block size)."""
        self.stats.errors += 1
        if not isinstance(exc, KvspError):
            log.warning("kvstore: %s at %s failed unexpectedly: %s", what, holder, describe(exc))
            return
        if exc.status >= 500 and exc.status != 507:
            self._down.failed(holder)
            log.warning(
                "kvstore holder %s failed (%s: %s); skipped for %.0f s",
                holder,
                what,
                exc.detail,
                self.settings.down_backoff_s,
            )
            return
        now, key = time.monotonic(), (holder, exc.status)
        if now - self._warned.get(key, -60.0) >= 60.0:
            self._warned[key] = now
            log.warning(
                "kvstore holder %s refused %s with %d: %s (scope %s; check its policy "
                "and max_block_octets)",
                holder,
                what,
                exc.status,
                exc.detail,
                self.scope_id,
            )

    async def put(self, name: str, container: BytesLike | Callable[[], BytesLike]) -> bool:
        """Store a chunk (a KVSP container, or a function that builds it,
        called only once a request slot is free) on its holder; False if
        none took it."""
        block_key = self.block_key(name)
        await self._discover()
        async with self._slot():
            data: BytesLike | None = None
            for holder in self.holders_for(block_key):
                if not self._up(holder):
                    continue
                try:
                    if data is None:
                        # Built (a copy, the layer digests) off the loop, which
                        # meanwhile sends other chunks and serves loads.
                        data = (
                            await asyncio.to_thread(container) if callable(container) else container
                        )
                    # Sent from a thread of the fetcher's PUT pool, which
                    # checks the holder's record against what it sent.
                    await self._fetcher().aput(
                        holder, self.compat_id, self.scope_id, block_key, data
                    )
                except PreconditionFailed:
                    pass  # BL7: already held there (the same name is the same chunk)
                except Exception as exc:  # a miss, never the engine's exception
                    self._failed(holder, "a put", exc)
                    continue
                self.stats.puts += 1
                self.stats.octets_out += len(memoryview(data)) if data is not None else 0
                return True
        self.stats.put_failures += 1
        return False

    async def contains(self, name: str) -> bool:
        block_key = self.block_key(name)
        await self._discover()
        for holder in self.holders_for(block_key):
            if self._up(holder) and await self._has(holder, block_key):
                return True
        return False

    async def contains_prefix(self, names: Sequence[str]) -> int:
        """How many of ``names``, from the first, are held (engines load
        prefixes). Asked a window at a time: nothing after the first miss."""
        window = self.settings.concurrency
        count = 0
        for start in range(0, len(names), window):
            found = await asyncio.gather(*(self.contains(n) for n in names[start : start + window]))
            for held in found:
                if not held:
                    return count
                count += 1
        return count

    async def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The containers of ``names`` (None: a miss); see :meth:`fetch_many`."""
        return await self.fetch_many(names, lambda _, body: bytes(body))

    async def fetch_many(
        self,
        names: Sequence[str],
        convert: Callable[[int, BytesLike], T | None],
        release: Callable[[T], None] | None = None,
        pinned: Sequence[Pin | None] | None = None,
    ) -> list[T | None]:
        """``convert(i, container)`` of each chunk as it arrives (None: a
        miss, or ``convert`` refused it), each holder's chunks under one lease for
        the time of the transfer (LE1: not evicted meanwhile). A chunk with
        a lease of :meth:`pin_many` (``pinned[i]``) is read at its holder
        under that lease, and nowhere else. If the call is cancelled, what
        was converted is given to ``release``."""
        keys = [self.block_key(n) for n in names]
        await self._discover()
        found: list[T | None] = [None] * len(keys)
        tried: list[set[str]] = [set() for _ in keys]
        todo = list(range(len(keys)))
        try:
            if pinned is not None:
                at: dict[str, list[int]] = {}
                for i, pin in enumerate(pinned):
                    if pin is not None and pin.lease is not None:
                        at.setdefault(pin.holder, []).append(i)
                await asyncio.gather(
                    *(
                        self._get_from(h, idx, keys, found, convert, lease=False)
                        for h, idx in at.items()
                    )
                )
                done = {i for idx in at.values() for i in idx}
                todo = [i for i in todo if i not in done]
            while todo:
                by_holder = self._next_holders(todo, keys, tried)
                if not by_holder:
                    break
                await asyncio.gather(
                    *(self._get_from(h, idx, keys, found, convert) for h, idx in by_holder.items())
                )
                todo = [i for i in todo if found[i] is None]
        except BaseException:
            if release is not None:
                for obj in found:
                    if obj is not None:
                        release(obj)
            raise
        hits = sum(1 for x in found if x is not None)
        self.stats.hits += hits
        self.stats.misses += len(found) - hits
        return found

    async def pin_many(self, names: Sequence[str], tries: int = 2) -> list[Pin | None]:
        """Where each of ``names`` is held, each under a lease (LE1: not
        evicted while it lasts), one ``POST leases`` per holder and batch;
        None for one no holder has. A chunk is asked at the first ``tries``
        holders of its order (it is at the first unless that one was down
        when it was stored). The caller renews (:meth:`renew`) and releases
        (:meth:`release`) the leases; :attr:`Pin.lease` is None where the
        holder found the chunk but granted no lease (its lease quota, LE3)."""
        keys = [self.block_key(n) for n in names]
        await self._discover()
        found: list[Pin | None] = [None] * len(keys)
        tried: list[set[str]] = [set() for _ in keys]
        todo = list(range(len(keys)))
        for _ in range(tries):
            by_holder = self._next_holders(todo, keys, tried)
            if not by_holder:
                break
            await asyncio.gather(
                *(self._pin_at(h, idx, keys, found) for h, idx in by_holder.items())
            )
            todo = [i for i in todo if found[i] is None]
        return found

    def _next_holders(
        self, todo: list[int], keys: list[str], tried: list[set[str]]
    ) -> dict[str, list[int]]:
        """Each chunk of ``todo`` by the next holder of its order not yet
        asked (a holder that failed meanwhile is skipped, not its turn)."""
        by_holder: dict[str, list[int]] = {}
        for i in todo:
            holder = next(
                (h for h in self.holders_for(keys[i]) if h not in tried[i] and self._up(h)), None
            )
            if holder is not None:
                tried[i].add(holder)
                by_holder.setdefault(holder, []).append(i)
        return by_holder

    async def _pin_at(
        self, holder: str, indices: list[int], keys: list[str], found: list[Pin | None]
    ) -> None:
        at: dict[str, list[int]] = {}
        for i in indices:
            at.setdefault(keys[i], []).append(i)
        wanted = list(at)
        for start in range(0, len(wanted), LEASE_KEYS):  # a holder caps a lease's keys
            part = wanted[start : start + LEASE_KEYS]
            try:
                grant = await self._lease(holder, part)
            except NotFound:
                continue  # none of them is there
            except Exception as exc:
                self._failed(holder, "a lease", exc)
                if not self._up(holder):
                    return
                # Refused (a lease quota): found where a HEAD finds it, unpinned.
                held = await asyncio.gather(*(self._has(holder, k) for k in part))
                unpinned = Pin(holder, None, 0)
                for key in (k for k, h in zip(part, held, strict=True) if h):
                    for i in at[key]:
                        found[i] = unpinned
                continue
            pin = Pin(holder, grant.lease, grant.ttl_ms)
            for key in grant.block_keys or part:
                for i in at.get(key, ()):
                    found[i] = pin

    async def _has(self, holder: str, block_key: str) -> bool:
        try:
            async with self._slot():
                return await self._http().has_block(
                    holder, self.compat_id, self.scope_id, block_key
                )
        except Exception as exc:
            self._failed(holder, "a lookup", exc)
            return False

    async def renew(self, pin: Pin, ttl_ms: int) -> int | None:
        """Extend a lease of :meth:`pin_many` (LE1): its new TTL in ms; 0
        when it is gone (expired, released, its holder restarted); None
        when the holder did not answer (it may still hold it: ask again).
        Not behind the request limit: a flood of puts must not hold a
        renewal back until its lease has expired."""
        if pin.lease is None:
            return 0
        try:
            grant = await self._http().renew_lease(pin.holder, pin.lease, ttl_ms)
        except NotFound:
            return 0
        except Exception as exc:
            self._failed(pin.holder, "a lease renewal", exc)
            return None
        return grant.ttl_ms

    async def release(self, pin: Pin) -> None:
        """Release a lease of :meth:`pin_many`, asking twice; one still not
        released expires by itself (its TTL bounds how long it pins)."""
        for attempt in range(2):
            if pin.lease is None:
                return
            try:
                await self._http().release_lease(pin.holder, pin.lease)
                return
            except NotFound:
                return  # expired meanwhile
            except Exception as exc:
                if attempt:
                    log.info(
                        "lease %s at %s not released (%s); it expires by itself",
                        pin.lease,
                        pin.holder,
                        describe(exc),
                    )
                else:
                    await asyncio.sleep(0.2)

    async def _lease(self, holder: str, wanted: list[str]) -> LeaseGrant:
        """``POST leases`` for ``wanted`` at ``holder`` within the request
        limit. Cancelled while the holder may be granting it, the lease is
        released once granted, not left to pin the chunks (and the quota)
        until it expires."""
        http = self._http()

        async def take_lease() -> LeaseGrant:
            async with self._slot():
                return await http.lease(
                    holder,
                    wanted,
                    self.settings.lease_ms,
                    scope_id=self.scope_id,
                    compat_id=self.compat_id,
                )

        call = asyncio.ensure_future(take_lease())
        try:
            grant = await asyncio.shield(call)
        except asyncio.CancelledError:
            self._later(self._release_when_granted(holder, call))
            raise
        self.stats.leases += 1
        return grant

    async def _get_from(
        self,
        holder: str,
        indices: list[int],
        keys: list[str],
        found: list[T | None],
        convert: Callable[[int, BytesLike], T | None],
        lease: bool = True,
    ) -> None:
        http = self._http()
        grant = None
        if lease:
            try:
                grant = await self._lease(holder, list(dict.fromkeys(keys[i] for i in indices)))
            except NotFound:
                return  # none of them is there
            except Exception as exc:
                # No lease (a quota, a fault): fetch anyway; a miss costs the same.
                self._failed(holder, "a lease", exc)
                if not self._up(holder):
                    return
        leased = set(grant.block_keys) if grant is not None and grant.block_keys else None
        wanted = [i for i in indices if leased is None or keys[i] in leased]
        live = True

        def arrived(result: Fetched) -> None:
            # On this loop, as each block completes (its octets verified in
            # a pool thread, BL6); none once the call has been cancelled.
            if not live:
                return
            i = result.request.tag
            if result.data is not None:
                self.stats.octets_in += len(result.data)
                try:
                    found[i] = convert(i, result.data)
                except Exception as exc:  # a miss, never the engine's exception
                    self._failed(holder, "a get", exc)
            elif result.errors and not isinstance(result.errors[-1], NotFound):
                self._failed(holder, "a get", result.errors[-1])

        requests = [
            BlockRequest(self.compat_id, self.scope_id, keys[i], (holder,), tag=i) for i in wanted
        ]
        try:
            await self._fetcher().afetch(requests, on_done=arrived)
        finally:
            live = False
            if grant is not None:
                try:
                    await http.release_lease(holder, grant.lease)
                except Exception as exc:  # it expires by itself
                    log.info("lease %s at %s not released: %s", grant.lease, holder, describe(exc))

    def _later(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_when_granted(self, holder: str, call: asyncio.Future[LeaseGrant]) -> None:
        try:
            grant = await call
            await self._http().release_lease(holder, grant.lease)
        except Exception as exc:  # not granted, or it expires by itself
            log.info("a cancelled lease at %s not released: %s", holder, describe(exc))

    async def reachable(self) -> bool:
        """True when at least one holder answers (a HEAD of a key nobody has)."""
        for holder in self.settings.holders:
            try:
                await self._http().has_block(holder, self.compat_id, self.scope_id, "0" * 64)
                return True
            except Exception:
                continue
        return False

    async def close(self) -> None:
        if self._background:  # late lease releases, before the pool goes
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._blocks is not None:
            blocks, self._blocks = self._blocks, None
            await asyncio.to_thread(blocks.close)


@dataclass
class LoopThread:
    """An event loop in a daemon thread, for callers that are not async
    (SGLang's storage threads; LMCache's synchronous lookups)."""

    name: str = "kvstore-chunks"
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self.loop.run_forever, name=self.name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()
