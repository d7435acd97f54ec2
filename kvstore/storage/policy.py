"""Eviction ordering policies. One policy instance orders the segments of one tier.

The manager asks a policy only for an order; whether a candidate may leave
(leases, in-flight reads) is decided by the manager (STYLE 5).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def add(self, item: Hashable) -> None:
        """A segment arrived in the tier."""

    def touch(self, item: Hashable) -> None:
        """A segment was read."""

    def remove(self, item: Hashable) -> None:
        """A segment left the tier."""

    def candidates(self) -> Iterator[Hashable]:
        """Segments in the order they should leave the tier (first = first to go)."""


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, item: Hashable) -> None:
        self._order[item] = None
        self._order.move_to_end(item)

    def touch(self, item: Hashable) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def remove(self, item: Hashable) -> None:
        self._order.pop(item, None)

    def candidates(self) -> Iterator[Hashable]:
        # A snapshot: the manager mutates the order while walking it.
        return iter(list(self._order))


class FIFO(LRU):
    """First in, first out: reads do not refresh a segment."""

    def touch(self, item: Hashable) -> None:
        pass


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "fifo": FIFO}
