"""The storage's own errors: a tier down, a tier full, a stored segment that
fails its check. Each is a :class:`~kvstore.protocol.problems.KvspError`, so
a role renders it as problem+json like any other."""

from __future__ import annotations

from typing import Any

from ..protocol.problems import DigestMismatch, InsufficientStorage, KvspError


class CorruptData(DigestMismatch):
    title = "Stored data failed its integrity check"


class TierUnavailable(KvspError):
    """A storage backend failed (connection refused, timeout, 5xx)."""

    status = 503
    title = "Storage tier unavailable"

    def __init__(self, detail: str, tier: str = "", **extensions: Any) -> None:
        super().__init__(detail, **extensions)
        self.tier = tier


class TierFull(InsufficientStorage):
    title = "Storage tier full"


class StillRecovering(KvspError):
    """The store is still finding the blocks its persistent tiers hold (a
    restart that serves at once) and could not tell in time whether this
    one is among them: try again (a 503 with Retry-After)."""

    status = 503
    title = "Holder still recovering its stored blocks"
