"""KV Block Container (B1-B4): encode, decode, slice, digest.

Wire layout, all integers in network byte order (B1)::

    offset  size  field
    0       4     magic "KVB1" (0x4B564231)
    4       1     version = 1
    5       1     flags = 0 (reserved)
    6       2     codec (KVSP Codecs registry)
    8       4     first layer
    12      4     layer count
    16      4     token count
    20      16*n  n entries of { K length u64, V length u64 }
    ...           for each layer ascending: K octets, V octets

Decoding never copies section data: a :class:`Container` is a view of the
buffer it was decoded from (memoryview slices). Every length is checked
against the octets actually present before anything is sized from it, so a
lying header costs an exception, never an allocation (STYLE 3).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ._bytes import BytesLike
from .codecs import CODEC_RAW, get_codec
from .compat import CompatibilityDescriptor
from .problems import DigestMismatch, LayersUnavailable, MalformedContainer

MAGIC = 0x4B564231
VERSION = 1
MEDIA_TYPE = "application/kvsp-block"

_FIXED = struct.Struct("!IBBHIII")
_LENGTHS = struct.Struct("!QQ")
FIXED_HEADER_OCTETS = _FIXED.size  # 20
LENGTH_ENTRY_OCTETS = _LENGTHS.size  # 16


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a decoder enforces before trusting a header (hostile input)."""

    #: Most layers one container may carry (largest models have ~128).
    max_layers: int = 4096
    #: Most octets one K or V section may claim.
    max_section: int = 1 << 30
    #: Most octets a whole container may claim.
    max_total: int = 1 << 34


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class ContainerHeader:
    """The header of a container: everything before the first K section."""

    codec: int
    first_layer: int
    token_count: int
    #: (K length, V length) of each layer, ascending.
    lengths: tuple[tuple[int, int], ...]

    @property
    def layer_count(self) -> int:
        return len(self.lengths)

    @property
    def last_layer(self) -> int:
        """Inclusive last layer index (first_layer - 1 when empty)."""
        return self.first_layer + len(self.lengths) - 1

    @property
    def header_octets(self) -> int:
        return FIXED_HEADER_OCTETS + LENGTH_ENTRY_OCTETS * len(self.lengths)

    @property
    def data_octets(self) -> int:
        return sum(k + v for k, v in self.lengths)

    @property
    def total_octets(self) -> int:
        return self.header_octets + self.data_octets

    def pack(self) -> bytes:
        """The header's octets (B1)."""
        out = bytearray(self.header_octets)
        _FIXED.pack_into(
            out,
            0,
            MAGIC,
            VERSION,
            0,
            self.codec,
            self.first_layer,
            len(self.lengths),
            self.token_count,
        )
        offset = FIXED_HEADER_OCTETS
        for k_len, v_len in self.lengths:
            _LENGTHS.pack_into(out, offset, k_len, v_len)
            offset += LENGTH_ENTRY_OCTETS
        return bytes(out)

    def check_geometry(self, descriptor: CompatibilityDescriptor) -> None:
        """Check the header against a Compatibility Descriptor (B2).

        The layer range must lie inside the model, the container must hold one
        whole block, and for codec raw every section must be exactly
        token_count x kv_heads x head_dim elements.
        """
        if self.first_layer + len(self.lengths) > descriptor.layers:
            raise MalformedContainer(
                f"layers {self.first_layer}-{self.last_layer} exceed the model's "
                f"{descriptor.layers} layers"
            )
        if self.token_count != descriptor.block_tokens:
            raise MalformedContainer(
                f"token count {self.token_count} is not the block size {descriptor.block_tokens}"
            )
        if self.codec == CODEC_RAW:
            want = descriptor.section_length(self.token_count)
            for index, (k_len, v_len) in enumerate(self.lengths):
                if k_len != want or v_len != want:
                    raise MalformedContainer(
                        f"layer {self.first_layer + index}: raw sections of {k_len}/{v_len} "
                        f"octets, geometry needs {want}"
                    )


def _parse_fixed(buf: memoryview, limits: Limits) -> tuple[int, int, int, int]:
    """Validate the 20 fixed octets; return (codec, first_layer, layer_count, token_count)."""
    magic, version, flags, codec, first, count, tokens = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise MalformedContainer(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x} ('KVB1')")
    if version != VERSION:
        raise MalformedContainer(f"unsupported container version {version}")
    if flags != 0:
        raise MalformedContainer(f"reserved flags must be zero, got 0x{flags:02x}")
    get_codec(codec)
    if count > limits.max_layers:
        raise MalformedContainer(f"layer count {count} exceeds the limit {limits.max_layers}")
    if first + count > 2**32:
        raise MalformedContainer("first layer + layer count overflows 32 bits")
    return codec, first, count, tokens


def _parse_lengths(buf: memoryview, count: int, limits: Limits) -> tuple[tuple[int, int], ...]:
    lengths = tuple(
        struct.iter_unpack(
            "!QQ", buf[FIXED_HEADER_OCTETS : FIXED_HEADER_OCTETS + LENGTH_ENTRY_OCTETS * count]
        )
    )
    total = 0
    for index, (k_len, v_len) in enumerate(lengths):
        if k_len > limits.max_section or v_len > limits.max_section:
            raise MalformedContainer(
                f"layer entry {index}: section length exceeds the limit {limits.max_section}"
            )
        total += k_len + v_len
    if total > limits.max_total:
        raise MalformedContainer(
            f"sections total {total} octets, over the limit {limits.max_total}"
        )
    return lengths


def decode_header(data: BytesLike, limits: Limits = DEFAULT_LIMITS) -> ContainerHeader | None:
    """Decode the header from the start of ``data``; None if more octets are needed."""
    buf = memoryview(data).cast("B")
    if len(buf) < FIXED_HEADER_OCTETS:
        # Fail fast on a stream that is not a container at all.
        if len(buf) >= 4 and int.from_bytes(buf[:4], "big") != MAGIC:
            raise MalformedContainer("bad magic, expected 'KVB1'")
        return None
    codec, first, count, tokens = _parse_fixed(buf, limits)
    if len(buf) < FIXED_HEADER_OCTETS + LENGTH_ENTRY_OCTETS * count:
        return None
    return ContainerHeader(codec, first, tokens, _parse_lengths(buf, count, limits))


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer of a container: views of its K and V sections, as encoded."""

    index: int
    k: memoryview
    v: memoryview

    def digest(self) -> bytes:
        """Layer digest: SHA-256 of K then V (B3)."""
        return layer_digest(self.k, self.v)


def layer_digest(k: BytesLike, v: BytesLike) -> bytes:
    """SHA-256 of a layer's K section followed by its V section (B3)."""
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Sequence[bytes]) -> bytes:
    """SHA-256 of the concatenated layer digests of all layers, ascending (B3)."""
    return hashlib.sha256(b"".join(layer_digests)).digest()


@dataclass(frozen=True, slots=True)
class Container:
    """A decoded container: a header and zero-copy views of its sections."""

    header: ContainerHeader
    data: memoryview
    #: Offset of each layer's K section in ``data``.
    _offsets: tuple[int, ...]

    @property
    def codec(self) -> int:
        return self.header.codec

    @property
    def first_layer(self) -> int:
        return self.header.first_layer

    @property
    def last_layer(self) -> int:
        return self.header.last_layer

    @property
    def token_count(self) -> int:
        return self.header.token_count

    def __len__(self) -> int:
        return self.header.layer_count

    def layer(self, index: int) -> Layer:
        """The layer with absolute index ``index``."""
        pos = index - self.header.first_layer
        if not 0 <= pos < self.header.layer_count:
            raise LayersUnavailable(f"layer {index} is not in {self.first_layer}-{self.last_layer}")
        k_len, v_len = self.header.lengths[pos]
        start = self._offsets[pos]
        return Layer(
            index,
            self.data[start : start + k_len],
            self.data[start + k_len : start + k_len + v_len],
        )

    def __iter__(self) -> Iterator[Layer]:
        for index in range(self.first_layer, self.last_layer + 1):
            yield self.layer(index)

    def layer_digests(self) -> list[bytes]:
        return [layer.digest() for layer in self]

    def verify(self, layer_digests: Sequence[bytes], digest: bytes | None = None) -> None:
        """BL6: check each layer against ``layer_digests`` (indexed by absolute layer).

        When ``digest`` is given and this container holds every layer, also
        check the replica digest. Raises :class:`DigestMismatch`.
        """
        if self.last_layer >= len(layer_digests):
            raise DigestMismatch(
                f"record lists {len(layer_digests)} layer digests, container reaches layer "
                f"{self.last_layer}"
            )
        for layer in self:
            if layer.digest() != layer_digests[layer.index]:
                raise DigestMismatch(f"layer {layer.index} does not match its layer digest")
        whole = self.first_layer == 0 and len(self) == len(layer_digests)
        if digest is not None and whole and replica_digest(layer_digests) != digest:
            raise DigestMismatch("layer digests do not match the replica digest")

    def span(self, first: int, last: int) -> memoryview:
        """The sections of layers ``first..last`` as one view: they are contiguous."""
        if first > last or first < self.first_layer or last > self.last_layer:
            raise LayersUnavailable(f"layers {first}-{last} are not within this container")
        start = self._offsets[first - self.first_layer]
        k_len, v_len = self.header.lengths[last - self.first_layer]
        return self.data[start : self._offsets[last - self.first_layer] + k_len + v_len]

    def slice(self, first: int, last: int) -> ContainerParts:
        """Layers ``first..last`` (inclusive) as a new container, without copying data."""
        if first > last or first < self.first_layer or last > self.last_layer:
            raise LayersUnavailable(
                f"layers {first}-{last} are not within {self.first_layer}-{self.last_layer}",
                held=[self.first_layer, self.last_layer],
            )
        layers = [self.layer(index) for index in range(first, last + 1)]
        return ContainerParts.build(self.codec, first, self.token_count, layers)

    def parts(self) -> ContainerParts:
        """This container as parts (header, then sections), for streaming."""
        return ContainerParts.build(self.codec, self.first_layer, self.token_count, list(self))


@dataclass(frozen=True, slots=True)
class ContainerParts:
    """A container as a gather list: header octets, then K, V views per layer.

    A server writes the parts one after the other (B4: ascending layers, so a
    reader can start on the first layer at once); ``tobytes()`` joins them
    with a single copy when one buffer is needed.
    """

    header: ContainerHeader
    chunks: tuple[BytesLike, ...]

    @classmethod
    def build(
        cls, codec: int, first_layer: int, token_count: int, layers: Sequence[Layer]
    ) -> ContainerParts:
        header = ContainerHeader(
            codec, first_layer, token_count, tuple((len(x.k), len(x.v)) for x in layers)
        )
        chunks: list[BytesLike] = [header.pack()]
        for layer in layers:
            chunks.append(layer.k)
            chunks.append(layer.v)
        return cls(header, tuple(chunks))

    def __len__(self) -> int:
        return self.header.total_octets

    def __iter__(self) -> Iterator[BytesLike]:
        return iter(self.chunks)

    def tobytes(self) -> bytes:
        return b"".join(self.chunks)


def decode(
    data: BytesLike,
    *,
    descriptor: CompatibilityDescriptor | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Container:
    """Decode a whole container held in ``data`` without copying its sections.

    Raises :class:`MalformedContainer` on any inconsistency: short or trailing
    octets, bad magic/version/flags, reserved or unknown codec, lengths beyond
    the buffer or the limits, or (with ``descriptor``) a geometry mismatch.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < FIXED_HEADER_OCTETS:
        raise MalformedContainer(
            f"container of {len(buf)} octets is shorter than the {FIXED_HEADER_OCTETS}-octet header"
        )
    codec, first, count, tokens = _parse_fixed(buf, limits)
    table_end = FIXED_HEADER_OCTETS + LENGTH_ENTRY_OCTETS * count
    if len(buf) < table_end:
        raise MalformedContainer(
            f"header announces {count} layers but the container ends at octet {len(buf)}"
        )
    header = ContainerHeader(codec, first, tokens, _parse_lengths(buf, count, limits))
    if header.total_octets != len(buf):
        raise MalformedContainer(
            f"lengths announce {header.total_octets} octets, container has {len(buf)}"
        )
    if descriptor is not None:
        header.check_geometry(descriptor)
    offsets = []
    offset = table_end
    for k_len, v_len in header.lengths:
        offsets.append(offset)
        offset += k_len + v_len
    return Container(header, buf, tuple(offsets))


def encode(
    sections: Sequence[tuple[BytesLike, BytesLike]],
    *,
    first_layer: int = 0,
    token_count: int,
    codec: int = CODEC_RAW,
) -> bytearray:
    """Build a container from already-encoded (K, V) sections, one copy of the data."""
    get_codec(codec)
    if first_layer < 0 or first_layer + len(sections) > 2**32 or not 0 <= token_count < 2**32:
        raise ValueError("first_layer, layer count and token_count must fit in 32 bits")
    views = [(memoryview(k).cast("B"), memoryview(v).cast("B")) for k, v in sections]
    header = ContainerHeader(
        codec, first_layer, token_count, tuple((len(k), len(v)) for k, v in views)
    )
    out = bytearray(header.total_octets)
    # Through a memoryview: a bytearray's slice assigned from a view would
    # first copy the view into a temporary bytearray (fresh pages, each one
    # faulted in: an order of magnitude over the copy itself).
    target = memoryview(out)
    target[: header.header_octets] = header.pack()
    offset = header.header_octets
    for k, v in views:
        target[offset : offset + len(k)] = k
        offset += len(k)
        target[offset : offset + len(v)] = v
        offset += len(v)
    target.release()
    return out


def transcode(container: Container, codec: int, descriptor: CompatibilityDescriptor) -> bytearray:
    """Re-encode every section of ``container`` with ``codec`` (BL3)."""
    source, target = get_codec(container.codec), get_codec(codec)
    raw_length = descriptor.section_length(container.token_count)
    sections = [
        (
            target.encode_section(source.decode_section(layer.k, raw_length)),
            target.encode_section(source.decode_section(layer.v, raw_length)),
        )
        for layer in container
    ]
    return encode(
        sections, first_layer=container.first_layer, token_count=container.token_count, codec=codec
    )
