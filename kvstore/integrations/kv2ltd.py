"""LMCache's KV chunks as KVSP block containers, both ways (issue 10, 21).

LMCache keeps a chunk of KV as one buffer of shape ``[2, layers, tokens,
hidden]`` (``MemoryFormat.KV_2LTD`` in its in-process mode; the same shape
for an MP-mode object group of one kernel group): all K rows, layer by
layer, then all V rows. Per layer, those rows are exactly ``kvsp-layout-1``
(tokens slowest, elements little-endian), so a chunk is one container of
codec raw with one container layer per model layer, and each direction is
one copy: LMCache's buffer into the container on a put, the container into
LMCache's buffer on a get. The in-process plug-in and the MP-mode L2
adapter write the same containers, so either reads what the other stored.
"""

from __future__ import annotations

import logging

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.codecs import CODEC_RAW
from ..protocol.problems import KvspError

log = logging.getLogger("kvstore.integrations")


def chunk_container(buf: memoryview, layers: int, tokens: int, row_octets: int) -> bytearray:
    """The container of a ``[2, layers, tokens, hidden]`` buffer (octets)."""
    section = tokens * row_octets
    if len(buf) != 2 * layers * section:
        raise ValueError(
            f"a chunk of {len(buf)} octets is not 2 x {layers} layers x "
            f"{tokens} tokens x {row_octets} octets"
        )
    return kc.encode(
        [
            (
                buf[i * section : (i + 1) * section],
                buf[(layers + i) * section : (layers + i + 1) * section],
            )
            for i in range(layers)
        ],
        token_count=tokens,
    )


def chunk_of(body: BytesLike, layers: int, row_octets: int, max_tokens: int) -> kc.Container | None:
    """The container a holder served, if it is a chunk of this geometry:
    codec raw, every layer from the first, at most ``max_tokens`` tokens,
    each layer's K and V ``tokens x row_octets``. None (and a warning)
    otherwise: a miss, never an exception into the engine."""
    try:
        container = kc.decode(body)
    except KvspError as exc:
        log.warning("kvstore: a holder served a chunk that does not decode: %s", exc.detail)
        return None
    section = container.token_count * row_octets
    shape_ok = (
        container.codec == CODEC_RAW
        and container.first_layer == 0
        and len(container) == layers
        and 0 < container.token_count <= max_tokens
    )
    if not shape_ok or any(len(x.k) != section or len(x.v) != section for x in container):
        log.warning("kvstore: a holder served a chunk of another geometry; ignored")
        return None
    return container


def copy_chunk(container: kc.Container, buf: memoryview, layers: int, row_octets: int) -> None:
    """Write a checked container (:func:`chunk_of`) into a ``[2, layers,
    tokens, hidden]`` buffer (octets) of its token count."""
    section = container.token_count * row_octets
    if len(buf) != 2 * layers * section:
        raise ValueError(
            f"a buffer of {len(buf)} octets for a chunk of {container.token_count} tokens"
        )
    for i, layer in enumerate(container):
        buf[i * section : (i + 1) * section] = layer.k
        buf[(layers + i) * section : (layers + i + 1) * section] = layer.v
