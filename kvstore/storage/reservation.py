"""One write into room reserved for it: reserve, write, then keep it or
give it back (and undo what a write cut short may still land). PUT,
demotion and promotion all write through it (:mod:`.placement`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..protocol._bytes import BytesLike
from .errors import TierFull, TierUnavailable
from .table import BlockTable
from .tierio import TierIO


class Reservation:
    """Room reserved in one tier for one write: the write protocol, once.

    Taken (by :meth:`.Placement.make_room` or :meth:`.BlockTable.reserve`)
    before the write, then ``async with`` it: :meth:`write` stores the
    items, :meth:`keep` says the segment written is attached (with no await
    in between). Leaving the block without :meth:`keep` gives the room back;
    leaving it on an exception (a cancel) after the write began also deletes
    what that write may still land, before the caller lets go of the block
    (its claim, or its WRITING state), so that no newer write of those keys
    comes between."""

    def __init__(
        self,
        table: BlockTable,
        io: TierIO,
        index: int,
        octets: int,
        undo: Callable[..., Awaitable[None]],
    ) -> None:
        """``undo(index, *keys)``: delete what a write cut short may land."""
        self.table, self.io, self.index, self.octets = table, io, index, octets
        self._undo = undo
        self.kept = False
        #: Why the tier refused the write (TierUnavailable, TierFull).
        self.refused: str | None = None
        self._writing: list[str] = []

    async def write(self, items: list[tuple[str, BytesLike]]) -> bool:
        """Store ``items`` in the tier (one batch call for several: one LMDB
        transaction, one Redis pipeline). False when the tier refused them."""
        slot = self.table.slots[self.index]
        self._writing = [key for key, _ in items]
        try:
            if len(items) == 1:
                await self.io.call(slot, slot.tier.put(*items[0]), self._writing)
            else:
                await self.io.call(slot, slot.tier.put_many(items), self._writing)
        except (TierUnavailable, TierFull) as exc:
            self._writing = []  # refused: nothing of it lands (TierIO's late calls)
            self.refused = f"{slot.kind}: {exc.detail}"
            return False
        return True

    def keep(self) -> None:
        """The written segment is the table's now (attached, replaced or kept
        as a copy): the room is counted there."""
        self.kept = True

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.kept:
            return
        self.table.unreserve(self.index, self.octets)
        if kind is not None and self._writing:
            await self._undo(self.index, *self._writing)
