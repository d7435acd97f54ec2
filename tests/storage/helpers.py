"""Blocks and stores for storage tests."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from kvstore.backends.host import HostTier
from kvstore.protocol import container as kc
from kvstore.storage import BlockRef
from kvstore.storage.crypto import CHECKSUM_OVERHEAD
from kvstore.storage.tier import Tier

COMPAT = hashlib.sha256(b"compat").hexdigest()
SCOPE = hashlib.sha256(b"scope").hexdigest()[:32]


def ref(n: int) -> BlockRef:
    return BlockRef(COMPAT, SCOPE, hashlib.sha256(f"block {n}".encode()).hexdigest())


def block(layers: int = 8, section: int = 256, first: int = 0) -> bytes:
    """A container of ``layers`` layers with random K/V sections of ``section`` octets."""
    secs = [(os.urandom(section), os.urandom(section)) for _ in range(layers)]
    return bytes(kc.encode(secs, first_layer=first, token_count=4))


def size_of(layers: int = 8, section: int = 256) -> int:
    return 20 + 16 * layers + 2 * section * layers


def stored_size(layers: int = 8, section: int = 256) -> int:
    """Octets a persistent tier holds for such a block, unencrypted (its checksum added)."""
    return size_of(layers, section) + CHECKSUM_OVERHEAD


class Clock:
    """A monotonic clock the test moves (leases, a failed tier's retry
    time) instead of sleeping the time out."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """An on_evict hook that records calls and what the store held at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[BlockRef, str, bool]] = []
        self.store: Any = None

    async def __call__(self, r: BlockRef, reason: str) -> None:
        # P3: the hook runs *before* the block leaves the holder.
        # ``in``: the data is still there (the block is LEAVING, not GONE).
        self.calls.append((r, reason, self.store is not None and r in self.store))


class FlakyTier(Tier):
    """Wraps a tier; ``down = True`` makes every call fail like a dead server."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.persistent = inner.persistent
        self.down = False

    def _check(self) -> None:
        from kvstore.storage.errors import TierUnavailable

        if self.down:
            raise TierUnavailable("injected failure", tier=self.kind)

    async def get(self, key: str) -> Any:
        self._check()
        return await self.inner.get(key)

    async def put(self, key: str, value: Any) -> None:
        self._check()
        await self.inner.put(key, value)

    async def delete(self, key: str) -> None:
        self._check()
        await self.inner.delete(key)

    async def keys(self) -> Any:
        self._check()
        async for key in self.inner.keys():
            yield key

    async def close(self) -> None:
        await self.inner.close()


class GatedTier(HostTier):
    """Memory whose puts wait while ``gate`` is closed, and deletes while
    ``delete_gate`` is (a slow or hung tier); ``kind`` and ``persistent`` as
    given, so it can stand for LMDB below host. ``failures``: how many of the
    next puts fail (after the gate). ``gated``: which keys' puts the gate
    holds (default: all)."""

    def __init__(self, kind: str = "host", persistent: bool = False) -> None:
        super().__init__()
        self.kind, self.persistent = kind, persistent
        self.gate = asyncio.Event()
        self.gate.set()
        self.delete_gate = asyncio.Event()
        self.delete_gate.set()
        self.waiting = 0
        self.deleting = 0
        self.failures = 0
        self.gated: Any = lambda key: True

    async def delete(self, key: str) -> None:
        self.deleting += 1
        try:
            await self.delete_gate.wait()
        finally:
            self.deleting -= 1
        await super().delete(key)

    async def put(self, key: str, value: Any) -> None:
        from kvstore.storage.errors import TierUnavailable

        if self.gated(key):
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        if self.failures:
            self.failures -= 1
            raise TierUnavailable("injected", tier=self.kind)
        await super().put(key, value)


async def until(check: Any) -> None:
    """Wait (at most 5 s) until ``check()`` holds."""
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.005)


async def cancelled(task: Any) -> None:
    """Cancel ``task`` (a client going away) and see it end cancelled."""
    import pytest

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
