"""Incremental container decoding (B4): use layer l as soon as it has arrived.

Bytes in, events out, in h11's manner: the caller feeds whatever octets the
transport delivered and gets back the header once it is complete, then each
layer as soon as its K and V sections are complete::

    decoder = StreamDecoder(descriptor=desc, layer_digests=record_digests)
    async for chunk in response.aiter_bytes():
        for event in decoder.feed(chunk):
            if isinstance(event, Layer):
                load_layer(event.index, event.k, event.v)
    decoder.close()   # raises if the container ended early

Memory is bounded by what was actually received: a section is buffered as its
octets arrive, never preallocated from a (possibly lying) length field, and
each section is copied exactly once, from the transport's chunk into its
layer buffer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ._bytes import BytesLike
from .compat import CompatibilityDescriptor
from .container import (
    DEFAULT_LIMITS,
    FIXED_HEADER_OCTETS,
    LENGTH_ENTRY_OCTETS,
    ContainerHeader,
    Layer,
    Limits,
    decode_header,
)
from .problems import DigestMismatch, MalformedContainer

Event = ContainerHeader | Layer


class StreamDecoder:
    """Push decoder for one container; see the module docstring."""

    def __init__(
        self,
        *,
        descriptor: CompatibilityDescriptor | None = None,
        layer_digests: Sequence[bytes] | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._descriptor = descriptor
        self._digests = layer_digests
        self._limits = limits
        self._head = bytearray()
        self._layer = bytearray()
        self._position = 0  # index into header.lengths of the layer being read
        self._filled = 0  # octets of that layer received so far
        self.header: ContainerHeader | None = None
        self.layers_done = 0

    @property
    def complete(self) -> bool:
        return self.header is not None and self._position == self.header.layer_count

    def feed(self, data: BytesLike) -> list[Event]:
        """Consume ``data``; return the events it completed, in order."""
        events: list[Event] = []
        view = memoryview(data).cast("B")
        if self.header is None:
            view = self._feed_header(view, events)
            if self.header is None:
                return events
        header = self.header
        while view:
            if self._position == header.layer_count:
                raise MalformedContainer("octets after the last layer of the container")
            k_len, v_len = header.lengths[self._position]
            take = view[: k_len + v_len - self._filled]
            self._absorb(take)
            self._filled += len(take)
            view = view[len(take) :]
            if self._filled == k_len + v_len:
                events.append(self._finish_layer(k_len))
        # A layer with empty sections completes without any octets.
        while self._position < header.layer_count and header.lengths[self._position] == (0, 0):
            events.append(self._finish_layer(0))
        return events

    def _feed_header(self, view: memoryview, events: list[Event]) -> memoryview:
        # Take only the header's own octets from the chunk: the fixed part
        # first, then the length table once the fixed part says how long it is.
        while True:
            if len(self._head) < FIXED_HEADER_OCTETS:
                want = FIXED_HEADER_OCTETS
            else:
                want = FIXED_HEADER_OCTETS + LENGTH_ENTRY_OCTETS * int.from_bytes(
                    self._head[12:16], "big"
                )
            take = view[: want - len(self._head)]
            self._head += take
            view = view[len(take) :]
            header = decode_header(self._head, self._limits)
            if header is not None:
                break
            if not view:
                return view
        if self._descriptor is not None:
            header.check_geometry(self._descriptor)
        self.header = header
        events.append(header)
        self._head = bytearray()
        return view

    def _absorb(self, octets: memoryview) -> None:
        self._layer += octets

    def _finish_layer(self, k_len: int) -> Layer:
        assert self.header is not None
        self._filled = 0
        buf = memoryview(self._layer)
        layer = Layer(self.header.first_layer + self._position, buf[:k_len], buf[k_len:])
        if self._digests is not None:
            # BL6/BL8: verify as soon as the layer is complete, before use.
            if layer.index >= len(self._digests):
                raise DigestMismatch(f"no layer digest for layer {layer.index}")
            if layer.digest() != self._digests[layer.index]:
                raise DigestMismatch(f"layer {layer.index} does not match its layer digest")
        self._layer = bytearray()
        self._position += 1
        self.layers_done += 1
        return layer

    def close(self) -> None:
        """Declare the end of input; raises unless exactly one whole container arrived."""
        if self.header is None:
            received = len(self._head)
            raise MalformedContainer(
                f"container ended after {received} octets, inside the header"
                if received
                else "empty container"
            )
        if self._position != self.header.layer_count:
            raise MalformedContainer(
                f"container ended inside layer {self.header.first_layer + self._position}"
            )


class LayerHasher(StreamDecoder):
    """Layer digests (B3) of a container computed as its octets arrive.

    Nothing is buffered or copied: each chunk is hashed where it lies. A
    holder feeds the chunks of a PUT body through it while they arrive, so
    digesting overlaps receiving instead of following it.
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS) -> None:
        super().__init__(limits=limits)
        self._hash = hashlib.sha256()
        self.digests: list[bytes] = []

    def _absorb(self, octets: memoryview) -> None:
        self._hash.update(octets)

    def _finish_layer(self, k_len: int) -> Layer:
        assert self.header is not None
        self.digests.append(self._hash.digest())
        self._hash = hashlib.sha256()
        self._filled = 0
        self._position += 1
        self.layers_done += 1
        empty = memoryview(b"")
        return Layer(self.header.first_layer + self._position - 1, empty, empty)


__all__ = ["Event", "LayerHasher", "StreamDecoder"]
