"""The seams between the parts of kvstore: small Protocols, in one neutral module.

A role is given its collaborators (STYLE 10). Where one part only needs a
few methods of another, it names them here rather than taking ``Any`` or
importing the other part's class, so that mypy checks the call and the
import graph stays ``protocol`` <- ``storage`` <- roles <- ``serve``: a role
never reaches into another role (the holder's publisher hears of blocks
through the store's events, :class:`~kvstore.storage.StoreListener`).
"""

from __future__ import annotations

from typing import Protocol

from .storage import StoreSnapshot


class Snapshots(Protocol):
    """What ``/metrics`` and ``/readyz`` read of a store."""

    def snapshot(self) -> StoreSnapshot: ...


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
