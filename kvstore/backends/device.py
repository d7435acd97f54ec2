"""``device`` tier: segments as uint8 torch tensors on a torch device.

``cuda:N`` in production, ``cpu`` in tests: the code path is the same. torch
is imported when the tier is built, not before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvstore.protocol._bytes import BytesLike
from kvstore.storage.errors import TierFull, TierUnavailable
from kvstore.storage.tier import Tier

if TYPE_CHECKING:
    import torch


class DeviceTier(Tier):
    kind = "device"

    def __init__(self, device: str = "cpu", read_mbit_per_s: float | None = None) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._data: dict[str, torch.Tensor] = {}
        self.read_mbit_per_s = read_mbit_per_s

    def tensor(self, key: str) -> torch.Tensor | None:
        """The stored segment as a flat uint8 tensor on the device (for engines)."""
        return self._data.get(key)

    async def get(self, key: str) -> BytesLike | None:
        tensor = self._data.get(key)
        if tensor is None:
            return None
        try:
            host = tensor.cpu()  # a no-op on a cpu device; one copy from an accelerator
        except RuntimeError as exc:  # device fault, ECC error, lost context
            raise TierUnavailable(f"device {self.device}: {exc}", tier=self.kind) from exc
        array: Any = host.numpy()
        return memoryview(array).cast("B")

    async def put(self, key: str, value: BytesLike) -> None:
        torch = self._torch
        staging = bytearray(value)  # a writable host buffer torch may alias
        try:
            tensor = torch.frombuffer(staging, dtype=torch.uint8).to(self.device)
        except RuntimeError as exc:
            if "out of memory" in str(exc):
                raise TierFull(f"device {self.device} is out of memory") from exc
            raise TierUnavailable(f"device {self.device}: {exc}", tier=self.kind) from exc
        self._data[key] = tensor

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def keys(self) -> AsyncIterator[str]:
        for key in list(self._data):
            yield key
