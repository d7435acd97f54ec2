"""Build every tier kind for parametrized tests (STYLE 11)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kvstore.backends import create_tier
from kvstore.storage.tier import Tier

from ..conftest import S3_CREDENTIALS, TEST_DEVICE

KINDS = [
    "device",
    "host",
    "host-arena",
    "local-storage",
    "remote-memory",
    "remote-memory-cluster",
    "remote-storage",
]


def make_tier(kind: str, request: pytest.FixtureRequest, **options: Any) -> Tier:
    """A fresh tier of ``kind``; repeated calls with the same options reopen the same data."""
    if kind == "device":
        return create_tier("device", device=TEST_DEVICE, **options)
    if kind == "host":
        return create_tier("host", **options)
    if kind == "host-arena":  # as a store provisions it: blocks in its arena
        host = create_tier("host", **options)
        host.provision(64 << 20)
        return host
    if kind == "local-storage":
        options.setdefault("path", request.getfixturevalue("lmdb_path"))
        return create_tier("lmdb", **options)
    if kind in ("remote-memory", "remote-memory-cluster"):
        cluster = kind == "remote-memory-cluster"
        server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
        options.setdefault("prefix", f"t{uuid.uuid4().hex[:12]}:")
        return create_tier("redis", url=server.url, cluster=cluster, **options)
    if kind == "remote-storage":
        options.setdefault("bucket", request.getfixturevalue("s3_bucket"))
        return create_tier(
            "s3", endpoint_url=request.getfixturevalue("s3_endpoint"), **S3_CREDENTIALS, **options
        )
    raise ValueError(kind)
