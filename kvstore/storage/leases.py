"""Leases (LE1-LE4): commitments not to evict blocks, with per-client quotas.

There is no timer per lease: a lease holds an expiry instant, and expired
leases are dropped lazily whenever a block's protection or a client's quota
is looked at, so an abandoned lease simply stops protecting at its deadline.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..protocol.problems import LeaseQuota, NotFound
from .types import BlockRef


@dataclass(slots=True)
class Lease:
    id: str
    client: str
    #: The leased blocks and the octets each counts against the client's quota.
    sizes: dict[BlockRef, int]
    expires_at: float
    ttl_ms: int

    @property
    def blocks(self) -> tuple[BlockRef, ...]:
        return tuple(self.sizes)

    @property
    def octets(self) -> int:
        return sum(self.sizes.values())


@dataclass(frozen=True, slots=True)
class LeaseLimits:
    """Per-client quotas (LE3, SEC3)."""

    #: Most octets of held blocks one client may have under unexpired leases.
    max_octets_per_client: int = 8 << 30
    #: Longest TTL a lease may ask for, in milliseconds.
    max_ttl_ms: int = 60_000
    #: Most unexpired leases per client (bounds the table itself).
    max_leases_per_client: int = 10_000


@dataclass(slots=True)
class LeaseTable:
    limits: LeaseLimits = field(default_factory=LeaseLimits)
    clock: Callable[[], float] = time.monotonic
    _leases: dict[str, Lease] = field(default_factory=dict)
    _by_block: dict[BlockRef, set[str]] = field(default_factory=dict)
    _by_client: dict[str, set[str]] = field(default_factory=dict)
    rejections: int = 0

    def _drop(self, lease: Lease) -> None:
        self._leases.pop(lease.id, None)
        for ref in lease.blocks:
            ids = self._by_block.get(ref)
            if ids is not None:
                ids.discard(lease.id)
                if not ids:
                    del self._by_block[ref]
        ids = self._by_client.get(lease.client)
        if ids is not None:
            ids.discard(lease.id)
            if not ids:
                del self._by_client[lease.client]

    def _live(self, lease_id: str, now: float) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires_at <= now:
            self._drop(lease)
            return None
        return lease

    def is_leased(self, ref: BlockRef) -> bool:
        """True while any unexpired lease covers ``ref`` (LE2)."""
        now = self.clock()
        return any(self._live(i, now) for i in list(self._by_block.get(ref, ())))

    def client_octets(self, client: str) -> int:
        now = self.clock()
        return sum(
            lease.octets
            for i in list(self._by_client.get(client, ()))
            if (lease := self._live(i, now)) is not None
        )

    def check_ttl(self, ttl_ms: int) -> None:
        if ttl_ms > self.limits.max_ttl_ms:
            self.rejections += 1
            raise LeaseQuota(
                f"lease TTL {ttl_ms} ms exceeds the limit of {self.limits.max_ttl_ms} ms",
                max_ttl_ms=self.limits.max_ttl_ms,
            )

    def grant(self, client: str, blocks: Iterable[tuple[BlockRef, int]], ttl_ms: int) -> Lease:
        """Create a lease on ``blocks`` (ref, octets); raises :class:`LeaseQuota` (LE3)."""
        self.check_ttl(ttl_ms)
        sizes = dict(blocks)
        octets = sum(sizes.values())
        held = self.client_octets(client)
        if held + octets > self.limits.max_octets_per_client:
            self.rejections += 1
            raise LeaseQuota(
                f"client would hold {held + octets} leased octets, over the quota of "
                f"{self.limits.max_octets_per_client}",
                max_octets=self.limits.max_octets_per_client,
            )
        if len(self._by_client.get(client, ())) >= self.limits.max_leases_per_client:
            self.rejections += 1
            raise LeaseQuota(f"client holds {self.limits.max_leases_per_client} leases already")
        lease = Lease(
            id=secrets.token_urlsafe(16),
            client=client,
            sizes=sizes,
            expires_at=self.clock() + ttl_ms / 1000,
            ttl_ms=ttl_ms,
        )
        self._leases[lease.id] = lease
        for ref in lease.blocks:
            self._by_block.setdefault(ref, set()).add(lease.id)
        self._by_client.setdefault(client, set()).add(lease.id)
        return lease

    def _own(self, client: str, lease_id: str) -> Lease:
        lease = self._live(lease_id, self.clock())
        # Another client's lease is reported exactly like an unknown one.
        if lease is None or lease.client != client:
            raise NotFound(f"lease {lease_id} is unknown or expired")
        return lease

    def lookup(self, client: str, lease_id: str) -> Lease:
        """The client's live lease ``lease_id``; raises :class:`NotFound`."""
        return self._own(client, lease_id)

    def renew(self, client: str, lease_id: str, ttl_ms: int) -> Lease:
        """Extend a live lease to ``ttl_ms`` from now (LE1)."""
        self.check_ttl(ttl_ms)
        lease = self._own(client, lease_id)
        lease.expires_at = self.clock() + ttl_ms / 1000
        lease.ttl_ms = ttl_ms
        return lease

    def release(self, client: str, lease_id: str) -> None:
        """Drop a lease (LE1)."""
        self._drop(self._own(client, lease_id))

    def forget_block(self, ref: BlockRef) -> None:
        """A block left the holder by a fault (LE4): its leases no longer cover it."""
        for lease_id in list(self._by_block.pop(ref, ())):
            lease = self._leases.get(lease_id)
            if lease is not None:
                # Its octets stop counting against the quota (LE3) ...
                lease.sizes.pop(ref, None)
                if not lease.sizes:
                    # ... and a lease left covering nothing is gone.
                    self._drop(lease)

    def __len__(self) -> int:
        return len(self._leases)
