"""Build every tier kind for parametrized tests (STYLE 11)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from backends import create_tier
from kvstore.storage.tier import Tier

from ..conftest import S3_CREDENTIALS

KINDS = ["device", "host", "local-storage", "remote-memory", "remote-storage"]


def make_tier(kind: str, request: pytest.FixtureRequest, **options: Any) -> Tier:
    """A fresh tier of ``kind``; repeated calls with the same options reopen the same data."""
    if kind == "device":
        return create_tier("device", device="cpu", **options)
    if kind == "host":
        return create_tier("host", **options)
    if kind == "local-storage":
        options.setdefault("path", request.getfixturevalue("lmdb_path"))
        return create_tier("lmdb", **options)
    if kind == "remote-memory":
        server = request.getfixturevalue("redis_server")
        options.setdefault("prefix", f"t{uuid.uuid4().hex[:12]}:")
        return create_tier("redis", url=server.url, **options)
    if kind == "remote-storage":
        options.setdefault("bucket", request.getfixturevalue("s3_bucket"))
        return create_tier(
            "s3", endpoint_url=request.getfixturevalue("s3_endpoint"), **S3_CREDENTIALS, **options
        )
    raise ValueError(kind)
