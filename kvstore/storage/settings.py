"""The store's settings: one definition (STYLE 16).

:class:`StoreSettings` is at once what a :class:`.TieredStore` takes whole
and the ``[storage]`` keys of the configuration file that say how the store
behaves (the file's section adds what is not the store's: the tiers, the
encryption key's file, the owner record's TTL). As in the file, 0 means
off where a field says so, so a value read from TOML needs no mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

from .leases import LeaseLimits


@dataclass(frozen=True, slots=True)
class StoreSettings:
    #: Keep layers [0, n) of a new block in the first tier and the rest in
    #: the second (the draft's device 0-15 / host 16-31 split). 0: no split.
    fast_layers: int = 0
    #: Copy a segment read from a lower tier up to the first (on hit).
    promote: bool = True
    #: Re-check layer digests on every read of a persistent tier. Off, reads
    #: are checked by what is cheap: the AES-GCM tag when encryption is on,
    #: else the XXH3-64 stored with the segment when it was written.
    verify_reads: bool = False
    #: A PUT is acknowledged once every layer is also in the first
    #: persistent tier below the one serving it (survives a crash).
    write_through: bool = False
    #: The high watermark: once a tier above the last is fuller than this
    #: fraction of its capacity, it drains in the background (0: off; a PUT
    #: that needs room then moves a victim down itself).
    demote_above: float = 0.9
    #: The low watermark: a drain stops there (0: 0.9 of ``demote_above``).
    demote_to: float = 0.0
    #: Longest TTL a lease may ask for, in milliseconds (LE3).
    lease_max_ttl_ms: int = 60_000
    #: Most octets of held blocks one client may have under leases (LE3, SEC3).
    lease_max_octets_per_client: int = 8 << 30
    #: Blocks stored longer ago than this leave every tier (SEC4; 0: kept).
    retention_s: float = 0.0
    #: How long a tier that failed is skipped before it is asked again (P4).
    retry_after_s: float = 5.0

    def problems(self) -> list[str]:
        """What is wrong with these values, one line each, naming the key."""
        out = []
        if not 0 <= self.demote_above < 1:
            out.append("demote_above: a fraction of a tier's capacity, 0 <= x < 1 (0: off)")
        elif self.demote_to and not (self.demote_above and 0 < self.demote_to < self.demote_above):
            out.append(
                "demote_to: a fraction of a tier's capacity below demote_above (0: 0.9 of it)"
            )
        if self.fast_layers < 0:
            out.append("fast_layers: a number of layers, 0 or more (0: no split)")
        if self.retention_s < 0:
            out.append("retention_s: seconds, 0 or more (0: kept)")
        if self.retry_after_s < 0:
            out.append("retry_after_s: seconds, 0 or more")
        return out

    @property
    def high_watermark(self) -> float | None:
        """``demote_above``, None when background demotion is off."""
        return self.demote_above or None

    @property
    def low_watermark(self) -> float:
        """Where a drain stops: ``demote_to``, or 0.9 of the high watermark."""
        return self.demote_to or 0.9 * (self.demote_above or 1.0)

    @property
    def lease_limits(self) -> LeaseLimits:
        return LeaseLimits(
            max_octets_per_client=self.lease_max_octets_per_client,
            max_ttl_ms=self.lease_max_ttl_ms,
        )
