"""Names the storage layer shares: block references and segment keys."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..protocol.wire import block_resource_name

_SEGMENT_KEY = re.compile(
    r"([0-9a-f]{64})/([0-9a-f]{64})/([0-9a-f]{32})/(?:(\d{1,10})-(\d{1,10})|meta)"
)
_HEX32 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block resource: ``blocks/{compat}/{scope}/{block_key}`` (BL1)."""

    compat_id: str
    scope_id: str
    block_key: str

    def __post_init__(self) -> None:
        if not (
            _HEX32.fullmatch(self.compat_id)
            and _HEX16.fullmatch(self.scope_id)
            and _HEX32.fullmatch(self.block_key)
        ):
            raise ValueError(
                f"not a block reference: {self.compat_id}/{self.scope_id}/{self.block_key}"
            )

    @property
    def resource(self) -> bytes:
        return block_resource_name(self.compat_id, self.scope_id, self.block_key)

    def segment_key(self, first: int, last: int) -> str:
        """Tier key of layers first..last: the Block Key leads (see Tier)."""
        return f"{self.block_key}/{self.compat_id}/{self.scope_id}/{first}-{last}"

    @property
    def meta_key(self) -> str:
        """Tier key of the block's layer table (beside its segments)."""
        return f"{self.block_key}/{self.compat_id}/{self.scope_id}/meta"

    @property
    def meta_name(self) -> bytes:
        return self.resource + b"?meta"

    def segment_name(self, first: int, last: int) -> bytes:
        """Associated data binding a sealed segment to its place (SEC4)."""
        return self.resource + f"?layers={first}-{last}".encode()


def parse_segment_key(key: str) -> tuple[BlockRef, tuple[int, int] | None] | None:
    """Inverse of :meth:`BlockRef.segment_key` (span) and :attr:`BlockRef.meta_key`
    (None); None for keys that are not ours."""
    match = _SEGMENT_KEY.fullmatch(key)
    if match is None:
        return None
    ref = BlockRef(match[2], match[3], match[1])
    if match[4] is None:
        return ref, None
    first, last = int(match[4]), int(match[5])
    if first > last:
        return None
    return ref, (first, last)
