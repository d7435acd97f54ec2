"""One owner per storage (issue 33), the tiers' claims in process: a second
claim of the same storage is refused naming the first owner; a release, or
a lapsed TTL (a crashed owner), frees it; a store whose claim failed gives
back what it took. Real processes: tests/integration/test_one_owner.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.backends.lmdb import LmdbTier
from kvstore.storage import TieredStore
from kvstore.storage.owner import Ownership, owner_name, stale
from kvstore.storage.tier import StorageInUse

from .tiers import make_tier

# LMDB's lock is per process (one environment per path and process): its
# second claim is another process's, in test_one_owner and below.
SHARED = ["remote-memory", "remote-memory-cluster", "remote-storage"]


def same_storage(kind: str, tier: Any) -> dict[str, Any]:
    if kind == "remote-storage":
        return {"bucket": tier.bucket, "prefix": tier.prefix}
    return {"prefix": tier.prefix}


@pytest.mark.parametrize("kind", SHARED)
async def test_a_second_claim_is_refused_until_the_first_is_released(
    kind: str, request: pytest.FixtureRequest
) -> None:
    first = make_tier(kind, request)
    second = make_tier(kind, request, **same_storage(kind, first))
    a, b = owner_name("holder A"), owner_name("holder B")
    await first.claim(a, 30.0)
    await first.claim(a, 30.0)  # kept: renewing is claiming again
    with pytest.raises(StorageInUse, match=r"is in use by pid .*holder A"):
        await second.claim(b, 30.0)
    await first.release(a)
    await second.claim(b, 30.0)
    with pytest.raises(StorageInUse, match="holder B"):
        await first.claim(a, 30.0)
    await second.release(b)
    await first.close()
    await second.close()


@pytest.mark.parametrize("kind", ["remote-memory", "remote-storage"])
async def test_a_crashed_owners_record_lapses_with_its_ttl(
    kind: str, request: pytest.FixtureRequest
) -> None:
    first = make_tier(kind, request)
    second = make_tier(kind, request, **same_storage(kind, first))
    # A TTL of 3 s: the second claim must come before it lapses, even on two
    # loaded cores where a moto round trip can take a second.
    await first.claim("crashed", 3.0)  # never renewed, never released
    with pytest.raises(StorageInUse, match="crashed"):
        await second.claim("next", 3.0)
    await asyncio.sleep(3.3)
    await second.claim("next", 30.0)  # taken over
    with pytest.raises(StorageInUse, match="next"):
        await first.claim("crashed", 1.0)  # came back: it is no longer the owner
    await second.release("next")
    await first.close()
    await second.close()


async def test_a_refused_store_gives_back_the_claims_it_took(
    request: pytest.FixtureRequest,
) -> None:
    lmdb = make_tier("local-storage", request)
    redis = make_tier("remote-memory", request)
    rival = make_tier("remote-memory", request, prefix=redis.prefix)  # type: ignore[attr-defined]
    await rival.claim("rival", 30.0)
    store = TieredStore([(HostTier(), 1 << 20), (lmdb, 1 << 20), (redis, 1 << 20)])
    with pytest.raises(StorageInUse, match="rival"):
        await Ownership([s.tier for s in store.slots], "me").claim()
    # The LMDB lock was given back: another process takes it at once.
    lock = Path(lmdb.path) / LmdbTier.OWNER_FILE  # type: ignore[attr-defined]
    take = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"
    )
    assert subprocess.run([sys.executable, "-c", take, str(lock)]).returncode == 0
    await rival.release("rival")
    await rival.close()
    await store.close()


async def test_a_second_process_is_refused_the_lmdb_directory(lmdb_path: str) -> None:
    tier = LmdbTier(lmdb_path)
    await Ownership([tier], "pid 1 on here").claim()
    other = (
        "import asyncio, sys; from kvstore.backends.lmdb import LmdbTier; "
        "asyncio.run(LmdbTier(sys.argv[1]).claim('two', 30.0))"
    )
    refused = subprocess.run(
        [sys.executable, "-c", other, lmdb_path], capture_output=True, text=True
    )
    assert refused.returncode != 0
    assert f"StorageInUse: {lmdb_path} is in use by pid 1 on here" in refused.stderr
    await tier.close()  # closing lets go
    assert subprocess.run([sys.executable, "-c", other, lmdb_path]).returncode == 0


@pytest.mark.parametrize("kind", ["remote-memory", "remote-storage"])
async def test_a_record_of_a_process_of_this_host_that_is_gone_is_taken_over(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # A holder restarted after a SIGKILL is not refused for owner_ttl_s.
    gone = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvstore.storage.owner import owner_name; print(owner_name('holder X'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert stale(gone)  # its pid is no more
    first = make_tier(kind, request)
    second = make_tier(kind, request, **same_storage(kind, first))
    await first.claim(gone, 600.0)  # as the crashed process wrote it
    await second.claim(owner_name("holder Y"), 600.0)  # at once, not in 600 s
    live = owner_name("holder Z")  # another store of this very process: alive
    assert not stale(live)
    with pytest.raises(StorageInUse, match="holder Y"):
        await first.claim(live, 600.0)
    await first.close()
    await second.close()
