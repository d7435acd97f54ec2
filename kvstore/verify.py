"""BL6: what a holder sent checked before it is used.

The octets against their ``Repr-Digest``, and, given the block's replica
record, each layer against its layer digest and the layer digests against
the replica digest. The two hashes run in worker threads at the same time
(hashlib releases the GIL), so both cores work. A mismatch raises
:class:`DigestMismatch`.
"""

from __future__ import annotations

import asyncio
import hashlib

from .protocol import container as kc
from .protocol.problems import DigestMismatch, KvspError
from .protocol.records import ReplicaRecord
from .protocol.wire import parse_repr_digest


def _check_repr(body: bytes, field: str) -> None:
    if hashlib.sha256(body).digest() != parse_repr_digest(field):
        raise DigestMismatch("Repr-Digest does not match the octets received")


def _check_layers(body: bytes, record: ReplicaRecord) -> None:
    try:
        container = kc.decode(body)
    except KvspError as exc:
        raise DigestMismatch(f"received container does not decode: {exc.detail}") from exc
    if container.codec != record.codec or record.layer_digests is None:
        return  # transcoded: protected by Repr-Digest only (BL6)
    digests = [bytes.fromhex(d) for d in record.layer_digests]
    container.verify(digests, bytes.fromhex(record.digest.removeprefix("sha-256:")))


async def verify_block(body: bytes, repr_field: str, record: ReplicaRecord | None) -> None:
    """BL6: Repr-Digest, and the record's layer/replica digests, hashed in parallel."""
    checks = [asyncio.to_thread(_check_repr, body, repr_field)]
    if record is not None:
        checks.append(asyncio.to_thread(_check_layers, body, record))
    results = await asyncio.gather(*checks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
