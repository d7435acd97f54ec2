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
from collections.abc import Callable

from .protocol import container as kc
from .protocol.problems import DigestMismatch, KvspError, MalformedContainer
from .protocol.records import ReplicaRecord
from .protocol.stream import LayerHasher
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


class StreamCheck:
    """BL6 as the octets of one answer arrive (:mod:`kvstore.fetch`): the
    Repr-Digest over everything, and with the replica's record each layer
    against its layer digest the moment the layer is complete
    (:class:`LayerHasher`), the replica digest at the end. Nothing is
    copied: each range is hashed where it lies, in the caller's buffer.
    ``repr_field`` None: nothing is checked (benchmarks only)."""

    def __init__(
        self,
        what: str,
        repr_field: str | None,
        record: ReplicaRecord | None,
        length: int,
        on_layer: Callable[[kc.Layer], None] | None = None,
        limits: kc.Limits = kc.DEFAULT_LIMITS,
    ) -> None:
        self.what, self.length, self.limits = what, length, limits
        self.record, self.on_layer = record, on_layer
        self.whole = hashlib.sha256() if repr_field is not None else None
        self.expected = parse_repr_digest(repr_field) if repr_field is not None else None
        self.header: kc.ContainerHeader | None = None
        #: The record's layer digests, while the answer is in the record's codec.
        self.digests = (
            [bytes.fromhex(d) for d in record.layer_digests]
            if record is not None and record.layer_digests is not None
            else None
        )
        self.layers = LayerHasher(limits=limits) if self.digests is not None else None

    def update(self, view: memoryview, start: int, end: int) -> None:
        """``view[start:end]`` arrived (``view`` holds the answer from its start)."""
        chunk = view[start:end]
        if self.whole is not None:
            self.whole.update(chunk)
        if self.header is None and (header := kc.decode_header(view[:end], self.limits)):
            self._start(header)
        self._feed(view, chunk)

    def _start(self, header: kc.ContainerHeader) -> None:
        if header.total_octets != self.length:
            raise MalformedContainer(
                f"{self.what}: the container's header makes {header.total_octets} octets, "
                f"Content-Length {self.length}"
            )
        self.header = header
        if self.digests is None or self.record is None:
            return
        if header.codec != self.record.codec:
            self.digests = self.layers = None  # transcoded: the Repr-Digest alone (BL6)
        elif header.last_layer >= len(self.digests):
            raise DigestMismatch(
                f"{self.what}: the record lists {len(self.digests)} layer digests, the "
                f"container reaches layer {header.last_layer}"
            )

    def _feed(self, view: memoryview, chunk: memoryview) -> None:
        if self.layers is None:
            return
        assert self.digests is not None
        for layer in self.layers.feed(chunk):
            if not isinstance(layer, kc.Layer):
                continue  # the header
            # One chunk may complete several layers: each has its own digest.
            assert self.layers.header is not None
            got = self.layers.digests[layer.index - self.layers.header.first_layer]
            if got != self.digests[layer.index]:
                raise DigestMismatch(
                    f"{self.what}: layer {layer.index} does not match its layer digest "
                    "in the replica record"
                )
            self._hand_over(view, layer.index)

    def _hand_over(self, view: memoryview, index: int) -> None:
        if self.on_layer is None or self.header is None:
            return
        header = self.header
        offset = header.header_octets
        position = index - header.first_layer
        for k_len, v_len in header.lengths[:position]:
            offset += k_len + v_len
        k_len, v_len = header.lengths[position]
        middle = offset + k_len
        self.on_layer(kc.Layer(index, view[offset:middle], view[middle : middle + v_len]))

    def finish(self, view: memoryview) -> None:
        """All of the answer arrived: the Repr-Digest, the replica digest; the
        layers not handed over yet (no record) once those matched."""
        header = self.header
        if header is None:
            raise MalformedContainer(f"{self.what}: the body is not a whole container")
        if self.whole is not None and self.whole.digest() != self.expected:
            raise DigestMismatch(f"{self.what}: Repr-Digest does not match the octets received")
        if self.layers is not None and self.digests is not None and self.record is not None:
            got = self.layers.digests
            every = header.first_layer == 0 and len(got) == len(self.digests)
            stated = bytes.fromhex(self.record.digest.removeprefix("sha-256:"))
            if every and kc.replica_digest(got) != stated:  # all layers came (BL6)
                raise DigestMismatch(
                    f"{self.what}: its layer digests do not make the record's replica digest"
                )
            return
        for index in range(header.first_layer, header.last_layer + 1):
            self._hand_over(view, index)  # no layer digests: handed over once all is checked (B4)
