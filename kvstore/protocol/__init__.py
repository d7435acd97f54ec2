"""The pure KVSP protocol core: no I/O, no clock, no asyncio.

Modules, in the order a reader meets them in the draft:

* :mod:`.compat`     Compatibility Descriptor and ID (C1-C4)
* :mod:`.keys`       Scope IDs and Block Key chains (K1-K3)
* :mod:`.container`  KV Block Container encode/decode/slice/digests (B1-B3)
* :mod:`.stream`     incremental container decoding, layer by layer (B4)
* :mod:`.codecs`     the codec registry, raw and our private zstd codec (B5)
* :mod:`.records`    replica, lookup, lease and prefetch records (R1, R2, R5)
* :mod:`.control`    status, checkpoint, shard map and reshard records (R3, R4, RS)
* :mod:`.lifecycle`  instance states and every transition between them (S1-S6)
* :mod:`.problems`   the exception hierarchy and problem+json (H3)
* :mod:`.wire`       ids, paths, layer ranges, Repr-Digest (H5, H6, BL1-BL5)
* :mod:`.placement`  the placement cost formulas (PL1)
* :mod:`.tensors`    layout-1 sections <-> torch tensors (needs the torch extra)
"""

from .compat import CompatibilityDescriptor, compat_id, parse_descriptor
from .container import Container, ContainerHeader, ContainerParts, Layer, decode, encode
from .keys import BlockKeyChain, block_keys, scope_id
from .problems import KvspError
from .stream import StreamDecoder

__all__ = [
    "BlockKeyChain",
    "CompatibilityDescriptor",
    "Container",
    "ContainerHeader",
    "ContainerParts",
    "KvspError",
    "Layer",
    "StreamDecoder",
    "block_keys",
    "compat_id",
    "decode",
    "encode",
    "parse_descriptor",
    "scope_id",
]
