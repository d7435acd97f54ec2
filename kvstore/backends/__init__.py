"""Storage tier backends, one module per tier, each a :class:`kvstore.storage.Tier`.

The registry maps a backend name to ``module:class``; the module is imported
only when that backend is configured, so optional dependencies (torch, redis,
aiobotocore) are needed only by the tiers that use them (STYLE 9).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.storage.tier import Tier

BACKENDS: dict[str, str] = {
    "device": "kvstore.backends.device:DeviceTier",
    "host": "kvstore.backends.host:HostTier",
    "lmdb": "kvstore.backends.lmdb:LmdbTier",
    "redis": "kvstore.backends.redis:RedisTier",
    "s3": "kvstore.backends.s3:S3Tier",
}


def create_tier(backend: str, **options: Any) -> Tier:
    """Build the tier registered as ``backend`` with its options."""
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"backend {backend!r} needs an optional dependency: {exc.name} "
            f"(pip install 'kvsp-kvstore[{backend}]')"
        ) from exc
    tier: Tier = getattr(module, class_name)(**options)
    return tier
