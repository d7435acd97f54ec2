"""kvsp-layout-1 <-> torch tensors (B2), zero-copy where the layout allows."""

from __future__ import annotations

import struct

import pytest
import torch

from kvstore.protocol import container as kc
from kvstore.protocol.compat import parse_descriptor
from kvstore.protocol.tensors import (
    container_tensors,
    kv_dtype_of,
    section_to_tensor,
    tensor_to_section,
    torch_dtype,
)

from .vectors import DESCRIPTOR

DTYPES = ["bf16", "fp16", "fp32", "fp8-e4m3", "fp8-e5m2"]


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_round_trip_every_element_type(kv_dtype: str) -> None:
    dtype = torch_dtype(kv_dtype)
    tensor = torch.randn(4, 3, 5).to(dtype)
    section = tensor_to_section(tensor)
    assert len(section) == 4 * 3 * 5 * tensor.element_size()
    back = section_to_tensor(section, kv_dtype, 3, 5)
    assert back.shape == (4, 3, 5)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    assert kv_dtype_of(dtype) == kv_dtype


def test_layout_is_little_endian_token_slowest() -> None:
    # B2: token index slowest, dimension fastest, each element little-endian.
    tensor = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    section = bytes(tensor_to_section(tensor))
    assert section == struct.pack("<12f", *range(12))
    assert section_to_tensor(section, "fp32", 2, 3)[1, 0, 2].item() == 8.0


def test_section_to_tensor_is_zero_copy() -> None:
    buf = bytearray(struct.pack("<4e", 1.0, 2.0, 3.0, 4.0))
    tensor = section_to_tensor(buf, "fp16", 2, 1)
    buf[0:2] = struct.pack("<e", 9.0)
    assert tensor[0, 0, 0].item() == 9.0  # the tensor views the buffer


def test_tensor_to_section_is_zero_copy_and_keeps_tensor_alive() -> None:
    tensor = torch.zeros(2, 2, 2, dtype=torch.float16)
    section = tensor_to_section(tensor)
    tensor[0, 0, 0] = 1.0
    assert bytes(section[:2]) == struct.pack("<e", 1.0)
    del tensor
    assert len(bytes(section)) == 16


def test_non_contiguous_tensor_is_copied_correctly() -> None:
    base = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    sliced = base.transpose(0, 1)  # [3, 2, 4], not contiguous
    section = tensor_to_section(sliced)
    assert torch.equal(section_to_tensor(section, "fp32", 2, 4), sliced)


def test_read_only_buffers_are_wrapped() -> None:
    data = struct.pack("<2f", 1.5, 2.5)
    assert section_to_tensor(data, "fp32", 1, 2).tolist() == [[[1.5, 2.5]]]


def test_bad_geometry_and_types() -> None:
    with pytest.raises(ValueError, match="whole number"):
        section_to_tensor(bytes(10), "fp32", 1, 2)
    with pytest.raises(ValueError):
        tensor_to_section(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        tensor_to_section(torch.zeros(1, 1, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        torch_dtype("int4")


def test_container_tensors() -> None:
    desc = parse_descriptor(DESCRIPTOR)
    ks = [torch.randn(4, 8, 128).to(torch.bfloat16) for _ in range(2)]
    vs = [torch.randn(4, 8, 128).to(torch.bfloat16) for _ in range(2)]
    blob = kc.encode(
        [(tensor_to_section(k), tensor_to_section(v)) for k, v in zip(ks, vs, strict=True)],
        first_layer=30,
        token_count=4,
    )
    pairs = container_tensors(kc.decode(blob), desc)
    assert len(pairs) == 2
    for (k, v), (k0, v0) in zip(pairs, zip(ks, vs, strict=True), strict=True):
        assert torch.equal(k, k0)
        assert torch.equal(v, v0)
