"""The tiered block store: Tier interface, eviction manager, leases, sealing."""

from .crypto import SegmentSealer
from .events import RecoveryProgress, StoreListener, StoreSnapshot, TierSnapshot
from .leases import Lease, LeaseLimits
from .manager import TieredStore
from .reads import BlockRead
from .records import BlockInfo
from .settings import StoreSettings
from .tier import TIER_ORDER, Tier
from .types import BlockRef

__all__ = [
    "TIER_ORDER",
    "BlockInfo",
    "BlockRead",
    "BlockRef",
    "Lease",
    "LeaseLimits",
    "RecoveryProgress",
    "SegmentSealer",
    "StoreListener",
    "StoreSettings",
    "StoreSnapshot",
    "Tier",
    "TierSnapshot",
    "TieredStore",
]
