"""An engine's paged KV cache as KVSP blocks, both ways (issue 34).

No engine import here: the same gather and scatter run under vLLM (the
connector of :mod:`kvstore.integrations.vllm`) and on a machine with torch
alone (tests on a GPU without vLLM).

A paged cache keeps, per attention layer, ``num_blocks`` pages of
``block_tokens`` tokens. Engines lay a page out in several ways; each layer
is reduced here to two views, K and V, shaped ``[num_blocks, block_tokens,
kv_heads, head_dim]``, without copying. One page of such a view, made
contiguous, is exactly a ``kvsp-layout-1`` section (tokens slowest, then
heads, then elements), so a block's container is its pages' K and V, layer
by layer, one copy each way.

Layouts (:func:`layer_views`):

* ``cpu``: vLLM's CPU attention, ``[blocks, heads, tokens, 2*head_dim]``,
  whose memory is per (block, head) all K rows then all V rows (the backend
  reads it as ``[blocks, heads, 2*tokens, head_dim]``);
* ``content``: vLLM's GPU backends from 0.32 (FlashAttention, FlashInfer,
  Triton), the logical ``[blocks, heads, tokens, 2*head_dim]`` with K and V
  side by side in the last dimension, whatever the strides;
* ``kv-first``: ``[2, blocks, tokens, heads, head_dim]`` (FlashAttention
  before 0.32);
* ``kv-second``: ``[blocks, 2, tokens, heads, head_dim]`` (FlashInfer NHD)
  and ``kv-second-hnd``: ``[blocks, 2, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.codecs import CODEC_RAW

#: torch dtypes and the "KVSP Element Types" they are.
KV_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8-e4m3",
    torch.float8_e5m2: "fp8-e5m2",
}
LAYOUTS = ("cpu", "content", "kv-first", "kv-second", "kv-second-hnd")


class LayoutError(ValueError):
    """A paged tensor this module cannot read (its shape, dtype, layout)."""


def kv_dtype(dtype: torch.dtype) -> str:
    try:
        return KV_DTYPES[dtype]
    except KeyError:
        raise LayoutError(
            f"KV cache dtype {dtype} has no KVSP element type "
            f"(known: {', '.join(map(str, KV_DTYPES))})"
        ) from None


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """K and V of one layer, each ``[num_blocks, block_tokens, kv_heads, head_dim]``
    (views of the engine's tensor: writes land in its cache)."""

    k: torch.Tensor
    v: torch.Tensor
    layout: str

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[0])


def guess_layout(
    shape: Sequence[int], *, block_tokens: int, kv_heads: int, head_dim: int, backend: str = ""
) -> str:
    """The layout of a paged tensor of ``shape``, from its shape and the
    attention backend's name (vLLM's ``get_name()``: ``CPU_ATTN``,
    ``FLASH_ATTN``, ...); :class:`LayoutError` when none fits."""
    n, h, d = block_tokens, kv_heads, head_dim
    dims = tuple(int(x) for x in shape)
    if len(dims) == 4 and dims[1:] == (h, n, 2 * d):
        return "cpu" if backend.upper().startswith("CPU") else "content"
    if len(dims) == 5 and dims[0] == 2 and dims[2:] == (n, h, d):
        return "kv-first"
    if len(dims) == 5 and dims[1] == 2 and dims[4] == d:
        if dims[2:4] == (n, h):
            return "kv-second"  # also where n == h: NHD is FlashInfer's default
        if dims[2:4] == (h, n):
            return "kv-second-hnd"
    raise LayoutError(
        f"a paged KV tensor of shape {list(dims)} is none of the layouts known "
        f"for {n} tokens a block, {h} KV heads of {d} "
        f"(backend {backend or '?'})"
    )


def layer_views(
    tensor: torch.Tensor,
    *,
    block_tokens: int,
    kv_heads: int,
    head_dim: int,
    backend: str = "",
    layout: str | None = None,
) -> PagedLayer:
    """K and V views of one layer's paged tensor (no copy)."""
    n, h, d = block_tokens, kv_heads, head_dim
    layout = layout or guess_layout(
        tensor.shape, block_tokens=n, kv_heads=h, head_dim=d, backend=backend
    )
    if layout == "cpu":
        if not tensor.is_contiguous():
            raise LayoutError("the CPU layout needs a contiguous tensor")
        both = tensor.view(tensor.shape[0], h, 2, n, d)
        k, v = both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)
    elif layout == "content":
        k, v = tensor[..., :d].transpose(1, 2), tensor[..., d:].transpose(1, 2)
    elif layout == "kv-first":
        k, v = tensor[0], tensor[1]
    elif layout == "kv-second":
        k, v = tensor[:, 0], tensor[:, 1]
    elif layout == "kv-second-hnd":
        k, v = tensor[:, 0].transpose(1, 2), tensor[:, 1].transpose(1, 2)
    else:
        raise LayoutError(f"layout {layout!r}: not one of {', '.join(LAYOUTS)}")
    if tuple(k.shape[1:]) != (n, h, d) or k.shape != v.shape:
        raise LayoutError(f"layout {layout}: views {list(k.shape)}, not [blocks, {n}, {h}, {d}]")
    return PagedLayer(k, v, layout)


#: An integer type of each element size (octets), for moving elements as bits.
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _octets(t: torch.Tensor) -> memoryview:
    """The octets of a contiguous CPU tensor (bf16 and fp8 included)."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def gather(layers: Sequence[PagedLayer], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Copies of the pages ``block_ids`` of every layer, on the CPU: one
    tensor ``[2, len(block_ids), block_tokens, heads, head_dim]`` a layer
    (owned: the engine may reuse its pages at once)."""
    if not block_ids:
        return []
    device = layers[0].k.device
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    cuda = device.type == "cuda"
    out = []
    for layer in layers:
        # Both sides selected straight into one buffer (no stack, a copy less),
        # as integers of the element's size (every dtype has that kernel).
        bits = _SAME_SIZE[layer.k.element_size()]
        shape = (2, len(block_ids), *layer.k.shape[1:])
        pair = torch.empty(shape, dtype=layer.k.dtype, device=device)
        for side, src in enumerate((layer.k, layer.v)):
            torch.index_select(src.view(bits), 0, index, out=pair[side].view(bits))
        if cuda:
            # Into pinned memory (torch keeps it cached), every layer's copy
            # queued before one wait: the transfers run back to back.
            host = torch.empty(shape, dtype=pair.dtype, pin_memory=True)
            host.copy_(pair, non_blocking=True)
            out.append(host)
        else:
            out.append(pair.to("cpu") if device.type != "cpu" else pair)
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return out


def gather_layer(layer: PagedLayer, block_ids: Sequence[int]) -> torch.Tensor:
    """:func:`gather` of one layer (vLLM hands its layers over one at a time)."""
    return gather([layer], block_ids)[0]


def encode_block(gathered: Sequence[torch.Tensor], i: int, block_tokens: int) -> bytearray:
    """The container of the ``i``-th block of :func:`gather`'s copies: codec
    raw, one container layer per layer, from layer 0."""
    sections = [(_octets(pair[0, i]), _octets(pair[1, i])) for pair in gathered]
    return kc.encode(sections, token_count=block_tokens, codec=CODEC_RAW)


def check_block(container: kc.Container, layers: int, section: int, block_tokens: int) -> None:
    """Refuse a container that is not a whole block of this geometry."""
    if container.codec != CODEC_RAW or container.first_layer != 0 or len(container) != layers:
        raise LayoutError(
            f"a container of codec {container.codec:#06x}, layers "
            f"{container.first_layer}-{container.last_layer}: not a raw block "
            f"of {layers} layers"
        )
    if container.token_count != block_tokens:
        raise LayoutError(f"a container of {container.token_count} tokens, not {block_tokens}")
    for layer in container:
        if len(layer.k) != section or len(layer.v) != section:
            raise LayoutError(
                f"a container layer of {len(layer.k)}+{len(layer.v)} octets, "
                f"not {section}+{section}"
            )


def scatter_layer(
    layer: PagedLayer,
    pages: Sequence[tuple[int, BytesLike, BytesLike]],
    staged: bool | None = None,
) -> None:
    """Write container layers, each ``(block_id, K section, V section)`` in
    ``kvsp-layout-1``, into those pages of ``layer``.

    On the CPU each section is copied into its page. On a GPU (``staged``,
    by default when the cache is not on the CPU) the sections are first laid
    side by side in one host buffer, sent in one host-to-device copy and put
    in their pages by one indexed copy on the device: a copy per page waits
    for each of its small transfers (measured on an H200, 128 pages of 32
    layers: 0.9-1.1 GB/s per page, 6.5-7.1 staged, against 7.6 for one
    contiguous copy from pageable memory)."""
    if not pages:
        return
    if staged is None:
        staged = layer.k.device.type != "cpu"
    shape = layer.k.shape[1:]
    with warnings.catch_warnings():  # read-only octets are only read from
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        if not staged:
            for block_id, k, v in pages:
                for dst, src in ((layer.k, k), (layer.v, v)):
                    values = torch.frombuffer(src, dtype=torch.uint8).view(dst.dtype).view(shape)
                    dst[block_id].copy_(values)
            return
    device, n = layer.k.device, len(pages)
    section = layer.k[0].numel() * layer.k.element_size()
    cuda = device.type == "cuda"
    # Pinned on CUDA (torch keeps it cached and holds it until the copy is
    # done): the transfer runs at the bus's rate and queues without a wait.
    host = torch.empty((2, n, section), dtype=torch.uint8, pin_memory=cuda)
    # Filled by memoryview slices: a torch call per section costs more than
    # its 32 KiB copy.
    array: Any = host.numpy()
    flat = memoryview(array).cast("B")
    for i, (_, k, v) in enumerate(pages):
        flat[i * section : (i + 1) * section] = memoryview(k).cast("B")
        flat[(n + i) * section : (n + i + 1) * section] = memoryview(v).cast("B")
    # Moved as integers of the element's size: the indexed copy has a kernel
    # for those on every device, not for every float type (fp8).
    bits = _SAME_SIZE[layer.k.element_size()]
    sent = host.to(device, non_blocking=cuda).view(bits).view(2, n, *shape)
    index = torch.tensor([p[0] for p in pages], dtype=torch.long, device=device)
    for side, dst in enumerate((layer.k, layer.v)):
        dst.view(bits).index_copy_(0, index, sent[side])
