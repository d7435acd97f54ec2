"""Integrity at rest over the real wire (issue 33): a holder process over one
persistent tier (LMDB, Redis, S3 through moto's server), with and without
encryption at rest, is stopped; one octet of what it stored is flipped
behind its back (bit rot, a bad disk, a careless copy): at the first, the
middle or the last octet of a segment, or in a block's layer table. After
the restart, not one GET answers 200 with altered octets: each altered block
is an error or a miss, each untouched one is served whole. The same flip
while the holder runs is refused too (every read of a persistent tier is
checked against what was stored with the segment, never against values
re-derived from what was read)."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvstore.backends.lmdb import LmdbTier
from kvstore.backends.redis import RedisTier
from kvstore.backends.s3 import S3Tier
from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.protocol.problems import KvspError
from kvstore.storage.tier import Tier

from ..conftest import S3_CREDENTIALS, RedisServer
from ..storage.helpers import COMPAT, SCOPE, ref
from .test_holder_crash import holder_over

#: Where one octet is flipped, per block; block 6 is left alone.
FLIPS = {
    0: ("segment", 0),
    1: ("segment", "middle"),
    2: ("segment", -1),
    3: ("meta", "middle"),
    4: ("meta", 0),
    5: ("segment", 17),
}
BLOCKS = 7


def body_of(n: int) -> bytes:
    rng = random.Random(f"integrity-{n}")
    return bytes(
        kc.encode(
            [(rng.randbytes(16 << 10), rng.randbytes(16 << 10)) for _ in range(8)], token_count=4
        )
    )


def tier_config(kind: str, tmp_path: Path, redis_url: str, s3: dict[str, str]) -> str:
    if kind == "lmdb":
        return (
            f'[[storage.tiers]]\nbackend = "lmdb"\ncapacity = 67108864\n'
            f'path = "{tmp_path / "lmdb"}"\nmap_size = 134217728\n'
        )
    if kind == "redis":
        return (
            f'[[storage.tiers]]\nbackend = "redis"\ncapacity = 67108864\n'
            f'url = "{redis_url}"\nprefix = "{s3["prefix"]}:"\n'
        )
    return (
        f'[[storage.tiers]]\nbackend = "s3"\ncapacity = 67108864\nbucket = "{s3["bucket"]}"\n'
        f'prefix = "{s3["prefix"]}/"\nendpoint_url = "{s3["endpoint"]}"\nregion = "us-east-1"\n'
        'access_key_id = "testing"\nsecret_access_key = "testing"\n'
    )


def open_tier(kind: str, tmp_path: Path, redis_url: str, s3: dict[str, str]) -> Tier:
    """The holder's tier, opened by the test (a bad disk's view of it)."""
    if kind == "lmdb":
        return LmdbTier(str(tmp_path / "lmdb"), map_size=134217728)
    if kind == "redis":
        return RedisTier(url=redis_url, prefix=s3["prefix"] + ":")
    return S3Tier(
        bucket=s3["bucket"],
        prefix=s3["prefix"] + "/",
        endpoint_url=s3["endpoint"],
        **S3_CREDENTIALS,
    )


async def flip(tier: Tier, key: str, where: int | str) -> None:
    stored = await tier.get(key)
    assert stored is not None, key
    data = bytearray(stored)
    offset = len(data) // 2 if where == "middle" else int(where)
    data[offset] ^= 0x01
    await tier.put(key, bytes(data))


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
@pytest.mark.parametrize("kind", ["lmdb", "redis", "s3"])
async def test_no_altered_octet_is_ever_served(
    kind: str,
    encrypted: bool,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_bucket: str,
    s3_endpoint: str,
) -> None:
    s3 = {"bucket": s3_bucket, "endpoint": s3_endpoint, "prefix": f"at-rest-{uuid.uuid4().hex[:8]}"}
    tiers = tier_config(kind, tmp_path, redis_server.url, s3)
    if encrypted:
        (tmp_path / "at-rest.key").write_bytes(os.urandom(32))
        tiers = f'[storage]\nencryption_key_file = "{tmp_path / "at-rest.key"}"\n' + tiers
    holder, port, uri, context, _ = holder_over(tmp_path, tiers)
    (tmp_path / "holder.toml").write_text(
        (tmp_path / "holder.toml").read_text().replace("map_size = 536870912\n", "")
    )
    bodies = {n: body_of(n) for n in range(BLOCKS + 1)}
    tier: Tier | None = None
    try:
        holder.start(port)
        async with HolderClient(context, timeout_s=10) as client:
            for n in range(BLOCKS + 1):
                await client.put_block(uri, COMPAT, SCOPE, ref(n).block_key, bodies[n])
        holder.stop()  # SIGTERM: a graceful stop, which says what it did
        stopped = (tmp_path / "holder.log").read_text()
        assert f"stopped: 0 segments spilled to persistent tiers; {BLOCKS + 1} blocks kept" in (
            stopped
        ), stopped[-2000:]

        tier = open_tier(kind, tmp_path, redis_server.url, s3)  # a bad disk's view
        keys = [key async for key in tier.keys()]
        for n, (what, where) in FLIPS.items():
            r = ref(n)
            key = r.meta_key if what == "meta" else r.segment_key(0, 7)
            assert key in keys, (key, keys)
            await flip(tier, key, where)
        await tier.close()
        tier = None

        holder.start(port)
        async with HolderClient(context, timeout_s=10) as client:
            outcomes: dict[int, Any] = {}
            for n in range(BLOCKS):
                try:
                    body = await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                    outcomes[n] = "served altered" if body != bodies[n] else "served"
                except KvspError as exc:
                    outcomes[n] = exc.status
            # A flipped layer table: the block is not adopted (404). A flipped
            # segment: adopted unchecked (the restart reads no segment), then
            # refused by its first read, which checks it whole (422), and
            # gone from then on (404).
            assert {n: o for n, o in outcomes.items() if n in FLIPS and o not in (404, 422)} == {}
            assert {n for n, o in outcomes.items() if o == 422} <= {
                n for n, (what, _) in FLIPS.items() if what == "segment"
            }
            for n in FLIPS:
                with pytest.raises(KvspError) as gone:
                    await client.get_block(uri, COMPAT, SCOPE, ref(n).block_key)
                assert gone.value.status == 404
            assert outcomes[6] == "served"  # what nobody touched is still there

            # Live: block 7 was served once; its segment then rots under the
            # running holder. Refused (not a 200), and gone from then on.
            assert await client.get_block(uri, COMPAT, SCOPE, ref(7).block_key) == bodies[7]
            tier = open_tier(kind, tmp_path, redis_server.url, s3)
            await flip(tier, ref(7).segment_key(0, 7), "middle")
            for _ in range(2):
                with pytest.raises(KvspError) as refused:
                    await client.get_block(uri, COMPAT, SCOPE, ref(7).block_key)
                assert refused.value.status in (404, 422)
    finally:
        holder.stop()
        if tier is not None:
            await tier.close()
    # Each altered octet found at the restart is logged once, by its key.
    log = (tmp_path / "holder.log").read_text()
    for n in FLIPS:
        assert log.count(f"integrity: {ref(n).block_key}/") == 1, log[-3000:]
    assert log.count(f"integrity: {ref(7).segment_key(0, 7)} in ") == 1  # the live one, once
    assert "corrupt segment" in log
