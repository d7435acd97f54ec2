"""``remote-storage`` tier: S3 (or any S3-compatible store) through aiobotocore.

Bucket, prefix, endpoint URL, region and credentials come from configuration
or the standard AWS environment and files. The client is created on first
use. ``NoSuchKey`` is a miss; connection failures and 5xx answers are
:class:`TierUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.protocol._bytes import BytesLike
from kvstore.storage.errors import TierUnavailable
from kvstore.storage.owner import stale
from kvstore.storage.tier import StorageInUse, Tier

from ..logs import describe

_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
#: A conditional write lost its race (If-Match / If-None-Match).
_CONDITION = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def _translated(where: str) -> Iterator[None]:
    # STYLE 6: botocore's and aiohttp's exceptions stop here (aiobotocore
    # lets some aiohttp errors through, e.g. a body cut short).
    try:
        yield
    except (ClientError, BotoCoreError, aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise TierUnavailable(f"S3 {where}: {describe(exc)}", tier="remote-storage") from exc


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
        #: ETag of the owner record this tier wrote last (its claim), or None.
        self._owner_etag: str | None = None

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
                            extra = (
                                {}
                                if region in (None, "us-east-1")
                                else {"CreateBucketConfiguration": {"LocationConstraint": region}}
                            )
                            await client.create_bucket(Bucket=self.bucket, **extra)
                    except BaseException:
                        await context.__aexit__(None, None, None)
                        raise
                self._client = client
                self._context = context
        return self._client

    async def claim(self, owner: str, ttl_s: float) -> None:
        """``<prefix>owner``, an object written only if absent (If-None-Match)
        or if it is still the one this holder wrote (If-Match), holding its
        owner and when it expires; one expired (a crashed owner, by the wall
        clock) is taken over, conditionally too."""
        key = self.prefix + "owner"
        body = json.dumps({"owner": owner, "expires_at": time.time() + ttl_s}).encode()
        with _translated(self._where):
            client = await self._s3()
            condition = (
                {"IfMatch": self._owner_etag}
                if self._owner_etag is not None
                else {"IfNoneMatch": "*"}
            )
            try:
                answer = await client.put_object(
                    Bucket=self.bucket, Key=key, Body=body, **condition
                )
            except ClientError as exc:
                if _code(exc) not in _CONDITION | _MISSING:
                    raise
                answer = await self._take_over(client, key, owner, body, ttl_s)
            self._owner_etag = answer["ETag"]

    async def _take_over(self, client: Any, key: str, owner: str, body: bytes, ttl_s: float) -> Any:
        try:
            found = await client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) not in _MISSING:
                raise
            return await client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
        async with found["Body"] as stream:
            raw = await stream.read()
        try:
            record = json.loads(raw)
            held, expires_at = str(record["owner"]), float(record["expires_at"])
        except (ValueError, KeyError, TypeError):
            held, expires_at = "an unreadable owner record", 0.0
        if held != owner and expires_at > time.time() and not stale(held):
            raise StorageInUse(
                f"{self._where} is in use by {held} (free {ttl_s:g} s after that holder stops)"
            )
        try:
            return await client.put_object(
                Bucket=self.bucket, Key=key, Body=body, IfMatch=found["ETag"]
            )
        except ClientError as exc:
            if _code(exc) in _CONDITION | _MISSING:
                raise StorageInUse(f"{self._where} was just claimed by another holder") from exc
            raise

    async def release(self, owner: str) -> None:
        if self._owner_etag is None:
            return
        key = self.prefix + "owner"
        with _translated(self._where):
            client = await self._s3()
            try:
                head = await client.head_object(Bucket=self.bucket, Key=key)
                if head["ETag"] == self._owner_etag:
                    await client.delete_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _code(exc) not in _MISSING:
                    raise
        self._owner_etag = None

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
        async for key, _ in self.sized_keys():
            yield key

    async def sized_keys(self) -> AsyncIterator[tuple[str, int | None]]:
        with _translated(self._where):
            client = await self._s3()
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents", ()):
                    yield item["Key"][len(self.prefix) :], int(item["Size"])

    async def close(self) -> None:
        if self._context is not None:
            await self._context.__aexit__(None, None, None)
            self._context = self._client = None
