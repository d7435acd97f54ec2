"""``host`` tier: process memory. Reads return the stored object, no copy."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvstore.protocol._bytes import BytesLike
from kvstore.storage.tier import Tier


class HostTier(Tier):
    kind = "host"

    def __init__(self, read_mbit_per_s: float | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self.read_mbit_per_s = read_mbit_per_s

    async def get(self, key: str) -> BytesLike | None:
        return self._data.get(key)

    async def put(self, key: str, value: BytesLike) -> None:
        # One copy when the caller's buffer is mutable; bytes are kept as-is.
        self._data[key] = value if isinstance(value, bytes) else bytes(value)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def keys(self) -> AsyncIterator[str]:
        for key in list(self._data):
            yield key
