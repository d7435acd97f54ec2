"""The seams between the parts of kvstore: small Protocols, in one neutral module.

A role is given its collaborators (STYLE 10). Where one part only needs a
few methods of another, it names them here rather than taking ``Any`` or
importing the other part's class, so that mypy checks the call and the
import graph stays ``protocol`` <- ``storage`` <- roles <- ``serve``: a role
never reaches into another role (the holder's publisher hears of blocks
through the store's events, :class:`~kvstore.storage.StoreListener`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .protocol._bytes import BytesLike
from .protocol.control import InstanceStatus, ReshardMessage, ResumeRequest, SessionCheckpoint
from .protocol.records import (
    LeaseGrant,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    ReplicaRecord,
)
from .storage import RecoveryProgress, StoreSnapshot, TierSnapshot


class Snapshots(Protocol):
    """What ``/metrics`` (the whole snapshot) and ``/readyz`` and status
    reports (the tiers only: cheap) read of a store."""

    def snapshot(self) -> StoreSnapshot: ...

    def tier_snapshots(self) -> tuple[TierSnapshot, ...]: ...

    def recovery_progress(self) -> RecoveryProgress: ...


class PublisherCounts(Protocol):
    @property
    def published(self) -> int: ...

    @property
    def withdrawn(self) -> int: ...

    @property
    def errors(self) -> int: ...


class PublisherStatsSource(Protocol):
    """What ``/metrics`` and ``/readyz`` read of the holder's publisher."""

    @property
    def stats(self) -> PublisherCounts: ...

    @property
    def index_reachable(self) -> bool: ...

    @property
    def pending(self) -> int: ...


class Lookups(Protocol):
    """An Index Service as the PC's placer and the instance's prefetcher ask it (L1)."""

    async def lookup(self, request: LookupRequest) -> LookupResponse: ...


class Holders(Protocol):
    """Holders as an instance loads from them (LE1, BL6) and stores into them
    (:class:`kvstore.client.HolderClient`)."""

    async def lease(
        self,
        holder: str,
        block_keys: Sequence[str],
        ttl_ms: int,
        *,
        scope_id: str | None = None,
        compat_id: str | None = None,
    ) -> LeaseGrant: ...

    async def release_lease(self, holder: str, lease_id: str) -> None: ...

    async def get_block(
        self,
        holder: str,
        compat_id: str,
        scope_id: str,
        block_key: str,
        *,
        layers: tuple[int, int] | None = None,
        codec: int | None = None,
        record: ReplicaRecord | None = None,
    ) -> bytes: ...

    async def put_block(
        self, holder: str, compat_id: str, scope_id: str, block_key: str, data: BytesLike
    ) -> ReplicaRecord: ...

    async def shards(self, holder: str) -> list[str]: ...


class Instances(Protocol):
    """Inference instances as the PC drives them
    (:class:`kvstore.client.InstanceClient`): PF1, CK5, RS2, S3."""

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str: ...

    async def resume(self, instance: str, request: ResumeRequest) -> None: ...

    async def reshard(self, instance: str, message: ReshardMessage) -> None: ...

    async def set_state(self, instance: str, state: str) -> None: ...


class Controller(Protocol):
    """The PC as an instance reports to it (S1, CK1, CK3)
    (:class:`kvstore.client.ControllerClient`)."""

    async def put_status(self, status: InstanceStatus) -> str: ...

    async def put_checkpoint(self, checkpoint: SessionCheckpoint) -> int: ...

    async def end_session(self, session: str) -> None: ...
