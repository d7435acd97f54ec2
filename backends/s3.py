"""``remote-storage`` tier: S3 (or any S3-compatible store) through aiobotocore.

Bucket, prefix, endpoint URL, region and credentials come from configuration
or the standard AWS environment and files. The client is created on first
use. ``NoSuchKey`` is a miss; connection failures and 5xx answers are
:class:`TierUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.protocol._bytes import BytesLike
from kvstore.protocol.problems import TierUnavailable
from kvstore.storage.tier import Tier

_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})


@contextlib.contextmanager
def _translated(where: str) -> Iterator[None]:
    # STYLE 6: botocore's and aiohttp's exceptions stop here (aiobotocore
    # lets some aiohttp errors through, e.g. a body cut short).
    try:
        yield
    except (ClientError, BotoCoreError, aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise TierUnavailable(f"S3 {where}: {exc!r}", tier="remote-storage") from exc


class S3Tier(Tier):
    kind = "remote-storage"
    persistent = True
    deadline_s = 30.0  # networked storage: retries of a large object included

    def __init__(
        self,
        bucket: str,
        prefix: str = "kvstore/",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        read_mbit_per_s: float | None = None,
        timeout_s: float = 10.0,
        create_bucket: bool = False,
    ) -> None:
        """``create_bucket``: make the bucket on first use when it is missing
        (a development store such as moto or MinIO)."""
        self.bucket = bucket
        self.create_bucket = create_bucket
        self.prefix = prefix
        self.read_mbit_per_s = read_mbit_per_s
        self._options: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region_name": region,
            "aws_access_key_id": access_key_id,
            "aws_secret_access_key": secret_access_key,
            "config": AioConfig(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"max_attempts": 2, "mode": "standard"},
            ),
        }
        self._context: Any = None
        self._client: Any = None
        self._opening = asyncio.Lock()
        self._where = f"s3://{bucket}/{prefix}"

    async def _s3(self) -> Any:
        async with self._opening:  # one client, even when the first calls race
            if self._client is None:
                context = get_session().create_client("s3", **self._options)
                client = await context.__aenter__()
                if self.create_bucket:
                    try:
                        try:
                            await client.head_bucket(Bucket=self.bucket)
                        except ClientError as exc:
                            code = exc.response.get("Error", {}).get("Code")
                            if code not in ("404", "NoSuchBucket", "NotFound"):
                                raise  # denied or failing: not ours to create
                            region = self._options.get("region_name")
                            extra = ({} if region in (None, "us-east-1") else
                                     {"CreateBucketConfiguration":
                                      {"LocationConstraint": region}})  # fmt: skip
                            await client.create_bucket(Bucket=self.bucket, **extra)
                    except BaseException:
                        await context.__aexit__(None, None, None)
                        raise
                self._client = client
                self._context = context
        return self._client

    async def get(self, key: str) -> BytesLike | None:
        with _translated(self._where):
            client = await self._s3()
            try:
                response = await client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _MISSING:
                    return None
                raise
            async with response["Body"] as body:
                data: bytes = await body.read()
                return data

    async def put(self, key: str, value: BytesLike) -> None:
        with _translated(self._where):
            client = await self._s3()
            await client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=bytes(value))

    async def delete(self, key: str) -> None:
        with _translated(self._where):
            client = await self._s3()
            await client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    async def keys(self) -> AsyncIterator[str]:
        with _translated(self._where):
            client = await self._s3()
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents", ()):
                    yield item["Key"][len(self.prefix) :]

    async def close(self) -> None:
        if self._context is not None:
            await self._context.__aexit__(None, None, None)
            self._context = self._client = None
