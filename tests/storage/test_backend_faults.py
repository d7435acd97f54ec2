"""Backends translate every foreign failure into TierUnavailable/TierFull/CorruptData (STYLE 6)."""

from __future__ import annotations

import os
import struct

import pytest
import zstandard
from aiohttp import web

from kvstore.backends.device import DeviceTier
from kvstore.backends.s3 import S3Tier
from kvstore.storage.crypto import MAGIC, SegmentSealer
from kvstore.storage.errors import CorruptData, TierUnavailable

from ..conftest import free_port


async def test_s3_body_cut_short_is_tier_unavailable() -> None:
    # A real HTTP server that promises 100000 octets, sends 10 and hangs up.
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "100000"})
        await response.prepare(request)
        await response.write(b"x" * 10)
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tier = S3Tier(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        access_key_id="a",
        secret_access_key="b",
        timeout_s=5,
    )
    try:
        with pytest.raises(TierUnavailable):
            await tier.get("k" * 64 + "/x")
    finally:
        await tier.close()
        await runner.cleanup()


async def test_device_fault_on_read_is_tier_unavailable() -> None:
    class Broken:
        def cpu(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    tier = DeviceTier("cpu")
    tier._data["k"] = Broken()  # type: ignore[assignment]
    with pytest.raises(TierUnavailable):
        await tier.get("k")


def test_forged_zstd_size_is_corrupt_data_not_memory_error() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"a" * 10)
    forged = frame[:4] + b"\xe0" + struct.pack("<Q", 1 << 45) + frame[6:]
    with pytest.raises(CorruptData):
        SegmentSealer(compress=True).open(b"x", MAGIC + b"\x01" + bytes(12) + forged)


def test_decompression_is_bounded() -> None:
    sealer = SegmentSealer(compress=True, max_plain_octets=1 << 20)
    stored = sealer.seal(b"x", bytes(2 << 20))
    with pytest.raises(CorruptData, match="size"):
        sealer.open(b"x", stored)


def test_truncated_sealed_segment() -> None:
    sealer = SegmentSealer(bytes(32))
    stored = bytes(sealer.seal(b"x", b"data"))
    for cut in (0, 10, 20, len(stored) - 1):
        with pytest.raises(CorruptData):
            sealer.open(b"x", stored[:cut])


def test_checksummed_segments_use_xxh3_and_older_crc32_ones_still_open() -> None:
    """Unencrypted segments carry an XXH3-64 of name, flags and body
    (``KVC2``); those written before it (``KVC1``, a CRC-32) still open. A
    flipped octet, another name or a truncated segment fails either way."""
    import zlib

    from kvstore.storage.crypto import CHECKED, CHECKED_CRC32, CHECKSUM_OVERHEAD

    sealer = SegmentSealer()
    body = os.urandom(5000)
    stored = bytes(sealer.seal(b"name", body))
    assert stored[:4] == CHECKED and len(stored) == len(body) + CHECKSUM_OVERHEAD == len(body) + 13
    assert bytes(sealer.open(b"name", stored)) == body
    crc = zlib.crc32(body, zlib.crc32(b"name" + b"\x00"))
    older = CHECKED_CRC32 + b"\x00" + struct.pack("!I", crc) + body
    assert bytes(sealer.open(b"name", older)) == body
    for form in (stored, older):
        flipped = bytearray(form)
        flipped[-7] ^= 0x10
        for name, octets in ((b"name", bytes(flipped)), (b"other", form), (b"name", form[:8])):
            with pytest.raises(CorruptData):
                sealer.open(name, octets)
