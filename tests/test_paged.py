"""Paged KV caches as KVSP blocks (kvstore.integrations.paged, issue 34): the
vLLM connector's gather and scatter, without vLLM, on CPU tensors in every
layout it reads (vLLM's CPU layout and the GPU ones, allocated on the CPU;
on ``KVSTORE_TEST_DEVICE``, e.g. ``cuda``, where that is set).

The expected octets are taken element by element from each layout's
definition, not from the views under test."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.integrations.paged import (  # noqa: E402
    LayoutError,
    check_block,
    encode_block,
    gather,
    guess_layout,
    layer_views,
    scatter_layer,
)
from kvstore.protocol import container as kc  # noqa: E402

from .conftest import TEST_DEVICE  # noqa: E402

BLOCKS, N, H, D = 6, 4, 3, 8  # pages, tokens a page, KV heads, head_dim
SHAPES = {
    "cpu": (BLOCKS, H, N, 2 * D),
    "content": (BLOCKS, H, N, 2 * D),
    "kv-first": (2, BLOCKS, N, H, D),
    "kv-second": (BLOCKS, 2, N, H, D),
    "kv-second-hnd": (BLOCKS, 2, H, N, D),
}


def element(t: torch.Tensor, layout: str, side: int, b: int, n: int, h: int) -> torch.Tensor:
    """K (side 0) or V (side 1) of page b, token n, head h: head_dim elements."""
    if layout == "cpu":  # per (page, head): all K rows, then all V rows
        return t[b, h].reshape(2 * N, D)[side * N + n]
    if layout == "content":  # K and V side by side in the last dimension
        return t[b, h, n, side * D : (side + 1) * D]
    if layout == "kv-first":
        return t[side, b, n, h]
    if layout == "kv-second":
        return t[b, side, n, h]
    return t[b, side, h, n]  # kv-second-hnd


def expected_section(t: torch.Tensor, layout: str, side: int, b: int) -> bytes:
    """kvsp-layout-1: tokens slowest, then heads, then elements (read on the CPU)."""
    t = t.cpu()
    rows = [element(t, layout, side, b, n, h) for n in range(N) for h in range(H)]
    return torch.stack(rows).contiguous().view(torch.uint8).numpy().tobytes()


def paged(layout: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPES[layout], generator=g).to(dtype).to(TEST_DEVICE)


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("staged", [False, True], ids=["per-page", "staged"])
def test_round_trip_is_octet_exact(layout: str, dtype: torch.dtype, staged: bool) -> None:
    layers = [paged(layout, dtype, seed) for seed in range(3)]
    backend = "CPU" if layout == "cpu" else "FLASH_ATTN"
    hnd = layout == "kv-second-hnd"
    views = [
        layer_views(
            t,
            block_tokens=N,
            kv_heads=H,
            head_dim=D,
            backend=backend,
            layout="kv-second-hnd" if hnd else None,
        )
        for t in layers
    ]
    assert {v.layout for v in views} == {layout}
    ids = [4, 1, 5]
    gathered = gather(views, ids)
    bodies = [bytes(encode_block(gathered, j, N)) for j in range(len(ids))]
    for j, b in enumerate(ids):
        container = kc.decode(bodies[j])
        assert (container.first_layer, len(container), container.token_count) == (0, 3, N)
        for i, t in enumerate(layers):
            assert bytes(container.layer(i).k) == expected_section(t, layout, 0, b)
            assert bytes(container.layer(i).v) == expected_section(t, layout, 1, b)

    # Into an empty cache of the same layout: those pages, octet for octet,
    # and nothing else written.
    empty = [torch.zeros_like(t) for t in layers]
    targets = [
        layer_views(t, block_tokens=N, kv_heads=H, head_dim=D, layout=views[0].layout)
        for t in empty
    ]
    moved = {4: 0, 1: 2}  # page 4's block into page 0, page 1's into page 2
    for i, target in enumerate(targets):
        pages = []
        for source, dest in moved.items():
            layer = kc.decode(bodies[ids.index(source)]).layer(i)
            pages.append((dest, layer.k, layer.v))
        scatter_layer(target, pages, staged=staged)
    for i, t in enumerate(empty):
        for source, dest in moved.items():
            for side in (0, 1):
                assert expected_section(t, layout, side, dest) == expected_section(
                    layers[i], layout, side, source
                )
        for b in set(range(BLOCKS)) - set(moved.values()):
            assert not any(expected_section(t, layout, side, b).strip(b"\0") for side in (0, 1))


def test_gather_owns_its_copies() -> None:
    t = paged("cpu")
    view = layer_views(t, block_tokens=N, kv_heads=H, head_dim=D, backend="CPU")
    (copy,) = gather([view], [2])
    before = bytes(encode_block([copy], 0, N))
    t.zero_()  # the engine reuses its pages at once
    assert bytes(encode_block([copy], 0, N)) == before


def test_layouts_are_told_by_shape_and_backend() -> None:
    assert (
        guess_layout((9, H, N, 2 * D), block_tokens=N, kv_heads=H, head_dim=D, backend="CPU_ATTN")
        == "cpu"
    )
    assert (
        guess_layout((9, H, N, 2 * D), block_tokens=N, kv_heads=H, head_dim=D, backend="FLASHINFER")
        == "content"
    )
    assert guess_layout((2, 9, N, H, D), block_tokens=N, kv_heads=H, head_dim=D) == "kv-first"
    assert guess_layout((9, 2, N, H, D), block_tokens=N, kv_heads=H, head_dim=D) == "kv-second"
    assert guess_layout((9, 2, H, N, D), block_tokens=N, kv_heads=H, head_dim=D) == (
        "kv-second-hnd"
    )
    with pytest.raises(LayoutError, match=r"shape \[9, 3, 4, 8\]"):
        guess_layout((9, H, N, D), block_tokens=N, kv_heads=H, head_dim=D)
    with pytest.raises(LayoutError, match="contiguous"):
        layer_views(
            paged("cpu").transpose(1, 2).contiguous().transpose(1, 2),
            block_tokens=N,
            kv_heads=H,
            head_dim=D,
            backend="CPU",
        )


def test_a_container_of_another_geometry_is_refused() -> None:
    section = N * H * D * 2
    good = kc.decode(bytes(kc.encode([(b"\1" * section, b"\2" * section)] * 2, token_count=N)))
    check_block(good, 2, section, N)
    with pytest.raises(LayoutError, match="not a raw block of 3 layers"):
        check_block(good, 3, section, N)
    with pytest.raises(LayoutError, match="tokens"):
        check_block(good, 2, section, N + 1)
    short = kc.decode(bytes(kc.encode([(b"\1" * 8, b"\2" * 8)] * 2, token_count=N)))
    with pytest.raises(LayoutError, match="octets"):
        check_block(short, 2, section, N)
