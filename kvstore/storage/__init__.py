"""The tiered block store: Tier interface, eviction manager, leases, sealing."""

from .blocks import BlockInfo, BlockRead
from .crypto import SegmentSealer
from .events import StoreListener, StoreSnapshot, TierSnapshot
from .leases import Lease, LeaseLimits
from .manager import TieredStore
from .tier import TIER_ORDER, Tier
from .types import BlockRef

__all__ = [
    "TIER_ORDER",
    "BlockInfo",
    "BlockRead",
    "BlockRef",
    "Lease",
    "LeaseLimits",
    "SegmentSealer",
    "StoreListener",
    "StoreSnapshot",
    "Tier",
    "TierSnapshot",
    "TieredStore",
]
