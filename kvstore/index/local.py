"""The Index Service asked in process: the PC's placer and an IS in one
``kvstore serve`` (issue 20). A placement then looks up with no HTTP and no
JSON of the request or the answer: the state's shapes are grouped into
:class:`ShapeRuns` here, each distinct group parsed once and kept.

Authorization is the caller's: ``POST place`` has already checked that its
principal may read the scope (the same check the IS makes of a lookup, L3).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from typing import TYPE_CHECKING

from ..protocol.records import LookupRequest, LookupResponse, ReplicaRecord, ReplicaShape, ShapeRuns
from ..protocol.residency import Resident
from ..storage.errors import TierUnavailable
from .state import IndexState

if TYPE_CHECKING:
    from .app import IndexCounters, Residency

#: Distinct replica-shape groups kept parsed (a deployment has few: the
#: holders a prompt's blocks are on, in a handful of combinations).
GROUPS_KEPT = 4096


class LocalIndex:
    """:class:`~kvstore.seams.Lookups` over an IS's state in this process."""

    def __init__(
        self,
        state: IndexState,
        counters: IndexCounters | None = None,
        residency: Residency | None = None,
    ) -> None:
        self.state = state
        self.counters = counters
        self.residency = residency
        self._parsed: dict[bytes, tuple[ReplicaShape, ...]] = {}

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        hits = await self.state.lookup(
            request.scope_id,
            request.compat_id,
            request.block_keys,
            shapes=True,
            records=not request.shapes_only,
        )
        if self.counters is not None:  # the IS's own figures count these too (OPS1)
            self.counters.lookups += 1
            self.counters.lookup_keys += len(request.block_keys)
            self.counters.lookup_matched_keys += hits.matched
        index: dict[bytes, int] = {}
        groups: list[tuple[ReplicaShape, ...]] = []
        runs: list[tuple[int, int]] = []
        # Consecutive keys mostly have equal shapes: groupby compares in C.
        for octets, run in itertools.groupby(hits.shapes or ()):
            number = index.get(octets)
            if number is None:
                number = index[octets] = len(groups)
                groups.append(self._group(octets))
            runs.append((number, len(list(run))))
        replicas: tuple[tuple[ReplicaRecord, ...], ...] = ()
        if not request.shapes_only:
            replicas = tuple(
                tuple(ReplicaRecord.from_json(r) for r in records) for records in hits.records()
            )
        resident: tuple[Resident, ...] = ()
        if self.residency is not None:
            with contextlib.suppress(TierUnavailable):  # advisory (P4): replicas still count
                await self.residency.start()
                keys = request.block_keys
                resident = tuple(self.residency.lookup(request.scope_id, request.compat_id, keys))
        shapes = ShapeRuns(tuple(groups), tuple(runs))
        return LookupResponse(hits.matched, replicas, shapes=shapes, resident=resident)

    def _group(self, octets: bytes) -> tuple[ReplicaShape, ...]:
        found = self._parsed.get(octets)
        if found is None:
            if len(self._parsed) >= GROUPS_KEPT:
                self._parsed.clear()
            found = self._parsed[octets] = tuple(
                ReplicaShape.from_json(item) for item in json.loads(octets)
            )
        return found

    async def close(self) -> None:
        """The state is the IS's, closed with it."""
