"""kvsp-layout-1 sections <-> torch tensors (B2), in the optional ``torch`` extra.

A raw K or V section is ``[tokens, kv_heads, head_dim]`` elements, row-major,
each element little-endian: exactly the memory of a contiguous CPU tensor on
a little-endian machine. So both directions are zero-copy there:

* :func:`section_to_tensor` wraps the octets with ``torch.frombuffer``;
* :func:`tensor_to_section` exposes a contiguous CPU tensor's memory.

Copies happen only where the layout forces them: a tensor on an accelerator
(``.cpu()``), a non-contiguous tensor, or a big-endian host.

torch is imported when a function here is first called, so the protocol core
installs and runs without it.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

from ._bytes import BytesLike
from .compat import ELEMENT_SIZES, CompatibilityDescriptor
from .container import Container

if TYPE_CHECKING:
    import torch

_TORCH_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8-e4m3": "float8_e4m3fn",
    "fp8-e5m2": "float8_e5m2",
}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a "KVSP Element Types" name."""
    import torch

    try:
        return getattr(torch, _TORCH_NAMES[kv_dtype])  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"kv_dtype {kv_dtype!r} has no torch equivalent") from None


def kv_dtype_of(dtype: torch.dtype) -> str:
    """The "KVSP Element Types" name of a torch dtype."""
    import torch

    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr) == dtype:
            return name
    raise ValueError(f"torch dtype {dtype} is not a KVSP element type")


def section_to_tensor(
    section: BytesLike, kv_dtype: str, kv_heads: int, head_dim: int
) -> torch.Tensor:
    """View a raw section as a ``[tokens, kv_heads, head_dim]`` CPU tensor, without copying.

    A read-only buffer (``bytes``) is wrapped as well; the caller must then not
    write to the tensor. Pass a ``bytearray`` (or a view of one) for a
    writable tensor.
    """
    import torch

    view = memoryview(section).cast("B")
    row = kv_heads * head_dim * ELEMENT_SIZES[kv_dtype]
    if row == 0 or len(view) % row:
        raise ValueError(
            f"section of {len(view)} octets is not a whole number of "
            f"{kv_heads}x{head_dim} {kv_dtype} rows"
        )
    dtype = torch_dtype(kv_dtype)
    if len(view) == 0:
        return torch.empty((0, kv_heads, head_dim), dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; documented above.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(view, dtype=torch.uint8)
    if sys.byteorder != "little" and ELEMENT_SIZES[kv_dtype] > 1:
        # B2: elements are little-endian on the wire; swap on big-endian hosts.
        size = ELEMENT_SIZES[kv_dtype]
        flat = flat.view(-1, size).flip(1).reshape(-1).contiguous()
    return flat.view(dtype).view(-1, kv_heads, head_dim)


def tensor_to_section(tensor: torch.Tensor) -> memoryview:
    """The raw section octets of a ``[tokens, kv_heads, head_dim]`` tensor.

    Zero-copy for a contiguous CPU tensor on a little-endian host; the view
    keeps the tensor alive.
    """
    import torch

    kv_dtype_of(tensor.dtype)  # refuse dtypes KVSP has no name for
    if tensor.dim() != 3:
        raise ValueError(f"expected [tokens, kv_heads, head_dim], got shape {tuple(tensor.shape)}")
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little" and tensor.element_size() > 1:
        flat = flat.view(-1, tensor.element_size()).flip(1).reshape(-1).contiguous()
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def container_tensors(
    container: Container, descriptor: CompatibilityDescriptor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) tensors of every layer of a raw container, viewing its buffer."""
    container.header.check_geometry(descriptor)
    if container.codec != 1:
        raise ValueError("only codec raw maps directly onto tensors; transcode first")
    return [
        (
            section_to_tensor(
                layer.k, descriptor.kv_dtype, descriptor.kv_heads, descriptor.head_dim
            ),
            section_to_tensor(
                layer.v, descriptor.kv_dtype, descriptor.kv_heads, descriptor.head_dim
            ),
        )
        for layer in container
    ]
