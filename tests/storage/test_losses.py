"""A tier that lost what it acknowledged (LE4) is one WARNING with a count,
not a line per block; a client's DELETE is not counted as a fault."""

from __future__ import annotations

import logging

import pytest

from kvstore.backends.lmdb import LmdbTier
from kvstore.protocol.problems import NotFound
from kvstore.storage import TieredStore

from .helpers import block, ref, size_of

LOST = "no longer holds the segments of"


async def test_a_tier_s_losses_are_one_warning_with_a_count(
    lmdb_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = LmdbTier(lmdb_path)
    store = TieredStore([(tier, 100 * size_of())])
    await store.open()
    for n in range(21):
        await store.put(ref(n), block())
    for n in range(20):  # behind the store's back, as a replaced file would
        for segment in store.info(ref(n)).segments:
            await tier.delete(segment.key)
    with caplog.at_level(logging.DEBUG, logger="kvstore.storage"):
        for n in range(20):
            with pytest.raises(NotFound):
                await store.get(ref(n))
            assert ref(n) not in store  # LE4: it left
        warned = [r for r in caplog.records if LOST in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "tier local-storage" in warned[0].getMessage()
        assert "of 1 block(s)" in warned[0].getMessage()
        assert "lost layers 0-7" in warned[0].getMessage()
        await store.delete(ref(20))  # a client's DELETE: not a fault
        assert store.stats.fault_evictions == 20
        await store.close()  # the window's count is logged at the stop
    warned = [r.getMessage() for r in caplog.records if LOST in r.getMessage()]
    assert len(warned) == 2 and "of 19 block(s)" in warned[1]
    # Each eviction is a DEBUG line, never an INFO one per block.
    assert not [
        r for r in caplog.records if r.levelno == logging.INFO and "evicted" in r.getMessage()
    ]
