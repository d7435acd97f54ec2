"""The checks that need an accelerator, as figures: ``python -m
kvstore.bench.device --device cuda`` (scripts/device-check.sh runs it on a
GPU machine, one section a process). Sections:

* ``holder``: 2 MiB blocks of 32 layers fetched verified (BL6) from a holder
  process over mutual TLS by :class:`kvstore.fetch.BlockFetcher` into pinned
  host buffers, each copied to device memory the moment it is verified
  (``non_blocking``): GB/s into device memory beside the same fetch into the
  host buffers alone, and the host-to-device copy alone; the octets on the
  device are checked against the blocks stored.
* ``paged``: the vLLM connector's gather and scatter
  (:mod:`kvstore.integrations.paged`) on a paged cache of an 8B-class
  model (32 layers, 16-token pages, 8 KV heads of 128, bf16) in two of
  vLLM's GPU layouts: GB/s of a gather to host memory and of a scatter back
  (containers in between), beside one contiguous copy of the same octets
  each way; the pages scattered are checked against those gathered.
* ``engine``: the reference engine (:mod:`kvstore.instance.reference`) on
  the device: a prompt's blocks stored at a holder, then the prompt loaded
  (fetch, decode, prefill of the last token) against the same prompt
  recomputed, with the logits of both compared.

On ``cpu`` the same code runs (its figures then say nothing of a GPU): how it
is tried on a machine without one.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..cores import available_cores
from ..fetch import BlockFetcher, BlockRequest
from ..protocol.records import ReplicaRecord
from . import Result, best_seconds, format_table
from .fetch import _measure
from .holder import COMPAT, SCOPE, Servers, _blocks

if TYPE_CHECKING:
    import ssl

    import torch

SECTIONS = ("holder", "paged", "engine")
#: The paged cache of an 8B-class model (Llama 3 8B): per layer, pages of
#: 16 tokens of 8 KV heads of 128, bf16.
LAYERS, PAGE_TOKENS, KV_HEADS, HEAD_DIM = 32, 16, 8, 128


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: str) -> str:
    """The device and the software, one line."""
    import torch

    where = torch.device(device)
    text = f"device {device}, torch {torch.__version__}"
    if where.type == "cuda":
        props = torch.cuda.get_device_properties(where)
        text += (
            f", {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
            f", {available_cores()} cores"
        )
    return text


@contextmanager
def _holder() -> Iterator[tuple[ssl.SSLContext, str]]:
    """A holder process (host tier, mutual TLS) and a client context for it."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-device-"))
    servers = Servers(root)
    try:
        yield servers.client_ssl(), servers.holder("host", True)
    finally:
        servers.close()
        shutil.rmtree(root, ignore_errors=True)


def _store(
    fetcher: BlockFetcher, holder: str, compat: str, blocks: list[tuple[str, bytes]]
) -> list[ReplicaRecord]:
    futures = [fetcher.put(holder, compat, SCOPE, key, data) for key, data in blocks]
    return [future.result() for future in futures]


def holder_into_device(device: str, quick: bool = False) -> list[Result]:
    import torch

    where = torch.device(device)
    pinned = where.type == "cuda"
    seconds = 0.5 if quick else 2.0
    blocks = _blocks(8 if quick else 32, 2 << 20)
    size = len(blocks[0][1])
    ks = sorted({1, min(available_cores(), 16)})
    results: list[Result] = []
    with _holder() as (context, uri):
        with BlockFetcher(context, threads=max(ks)) as fetcher:
            records = _store(fetcher, uri, COMPAT, blocks)
        host = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in blocks]
        on_device = torch.empty((len(blocks), size), dtype=torch.uint8, device=where)
        requests = [
            BlockRequest(COMPAT, SCOPE, r.block_key, [r], into=buffer)
            for r, buffer in zip(records, host, strict=True)
        ]

        def to_host(fetcher: BlockFetcher) -> Callable[[], int]:
            def round_trip() -> int:
                for done in fetcher.fetch(requests):
                    if not done.ok:
                        raise RuntimeError(f"block {done.request.block_key}: {done.errors}")
                return size * len(requests)

            return round_trip

        def to_device(fetcher: BlockFetcher) -> Callable[[], int]:
            def round_trip() -> int:
                for done in fetcher.fetch(requests):
                    if not done.ok:
                        raise RuntimeError(f"block {done.request.block_key}: {done.errors}")
                    on_device[done.index].copy_(host[done.index], non_blocking=True)
                _sync(where)  # the buffers are refilled by the next round
                return size * len(requests)

            return round_trip

        for k in ks:
            with BlockFetcher(context, threads=k) as fetcher:
                plain = _measure(to_host(fetcher), seconds)
                into = _measure(to_device(fetcher), seconds)
            results.append(
                Result(
                    f"holder GET verified into {where.type} memory, K={k}",
                    "GB/s",
                    into.gbs,
                    "into pinned host buffers only" if pinned else "into host buffers only",
                    plain.gbs,
                )
            )
        for i, (_, data) in enumerate(blocks):
            if not torch.equal(
                on_device[i].cpu(), torch.frombuffer(bytearray(data), dtype=torch.uint8)
            ):
                raise RuntimeError(f"block {i}: the octets in {device} memory are not those stored")
        octets = size * len(blocks)

        def copy() -> None:
            for i, buffer in enumerate(host):
                on_device[i].copy_(buffer, non_blocking=True)
            _sync(where)

        copy_s = best_seconds(copy, repeat=5)
        results.append(
            Result(
                f"host-to-{where.type} copy of the same blocks"
                + (" from pinned memory" if pinned else ""),
                "GB/s",
                octets / copy_s / 1e9,
            )
        )
    return results


def _paged_cache(layout: str, pages: int, where: torch.device) -> list[torch.Tensor]:
    """One tensor a layer in ``layout`` (random bf16, drawn on the device)."""
    import torch

    n, h, d = PAGE_TOKENS, KV_HEADS, HEAD_DIM
    shape = (2, pages, n, h, d) if layout == "kv-first" else (pages, h, n, 2 * d)
    generator = torch.Generator(device=where).manual_seed(0)
    return [
        torch.randn(shape, generator=generator, device=where, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]


def paged_gather_scatter(device: str, quick: bool = False) -> list[Result]:
    import torch

    where = torch.device(device)
    cuda = where.type == "cuda"
    # 2048 pages of 32 layers on a GPU: 4 GiB a cache, two caches; on the
    # CPU a tenth of that. A gather of 128 pages is a 2048-token prompt.
    pages = 2048 if cuda else 160
    count = 32 if quick else 128
    repeat = 3 if quick else 5
    octets = LAYERS * 2 * count * PAGE_TOKENS * KV_HEADS * HEAD_DIM * 2
    down_gbs, up_gbs = _contiguous_copies(where, octets, repeat)
    results: list[Result] = []
    for layout in ("kv-first", "content"):
        gather_gbs, encode_gbs, scatter_gbs = _paged_layout(layout, where, pages, count, repeat)
        what = f"{count} pages x {LAYERS} layers, {layout}, {where.type}"
        results += [
            Result(
                f"gather {what} -> host",
                "GB/s",
                gather_gbs,
                "one contiguous copy to host, same octets",
                down_gbs,
            ),
            Result(f"encode_block of the gathered pages ({layout})", "GB/s", encode_gbs),
            Result(
                f"scatter_layer host -> {what}",
                "GB/s",
                scatter_gbs,
                "one contiguous copy from host, same octets",
                up_gbs,
            ),
        ]
        if cuda:
            torch.cuda.empty_cache()
    return results


def _contiguous_copies(where: torch.device, octets: int, repeat: int) -> tuple[float, float]:
    """GB/s of one contiguous copy of ``octets`` from the device to (pageable)
    host memory and back: what a gather and a scatter are measured against."""
    import torch

    on_device = torch.empty(octets, dtype=torch.uint8, device=where)
    on_host = torch.empty(octets, dtype=torch.uint8)

    def down() -> None:
        on_host.copy_(on_device)
        _sync(where)

    def up() -> None:
        on_device.copy_(on_host)
        _sync(where)

    return (
        octets / best_seconds(down, repeat=repeat) / 1e9,
        octets / best_seconds(up, repeat=repeat) / 1e9,
    )


def _paged_layout(
    layout: str, where: torch.device, pages: int, count: int, repeat: int
) -> tuple[float, float, float]:
    """GB/s of a gather of ``count`` pages of every layer to host memory,
    of their containers' encoding, and of their scatter into another
    cache (checked: the pages scattered are those gathered)."""
    import torch

    from ..integrations.paged import encode_block, gather, layer_views, scatter_layer
    from ..protocol import container as kc

    octets = LAYERS * 2 * count * PAGE_TOKENS * KV_HEADS * HEAD_DIM * 2
    chosen = random.Random(0).sample(range(pages), count)  # scattered, as an engine's are
    moved_to = chosen[1:] + chosen[:1]  # each block into another page of the second cache
    source = _paged_cache(layout, pages, where)
    views = [
        layer_views(
            t,
            block_tokens=PAGE_TOKENS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            backend="FLASH_ATTN",
            layout=layout,
        )
        for t in source
    ]
    gathered: list[torch.Tensor] = []

    def gather_all() -> None:
        nonlocal gathered
        gathered = gather(views, chosen)  # copies in host memory: synchronous

    gather_s = best_seconds(gather_all, repeat=repeat)
    start = time.perf_counter()
    bodies = [encode_block(gathered, j, PAGE_TOKENS) for j in range(count)]
    encode_s = time.perf_counter() - start
    containers = [kc.decode(body) for body in bodies]
    targets = [
        layer_views(
            torch.zeros_like(t),
            block_tokens=PAGE_TOKENS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            layout=layout,
        )
        for t in source
    ]
    per_layer = [
        [(dest, c.layer(i).k, c.layer(i).v) for dest, c in zip(moved_to, containers, strict=True)]
        for i in range(LAYERS)
    ]

    def scatter_all() -> None:
        for view, pages_of_layer in zip(targets, per_layer, strict=True):
            scatter_layer(view, pages_of_layer)
        _sync(where)

    scatter_s = best_seconds(scatter_all, repeat=repeat)
    src = torch.tensor(chosen, device=where)
    dst = torch.tensor(moved_to, device=where)
    for view, copy in zip(views, targets, strict=True):
        for a, b in ((view.k, copy.k), (view.v, copy.v)):
            if not torch.equal(a.index_select(0, src), b.index_select(0, dst)):
                raise RuntimeError(f"{layout}: the pages scattered are not those gathered")
    return octets / gather_s / 1e9, octets / encode_s / 1e9, octets / scatter_s / 1e9


def engine_fetch_or_recompute(device: str, quick: bool = False) -> list[Result]:
    import torch

    from ..instance.engine import block_container, load_blocks
    from ..instance.reference import BOS, ReferenceEngine

    where = torch.device(device)
    prompt_tokens = 1024 if quick else 4096
    repeat = 3 if quick else 5
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-engine-"))
    try:
        engine = ReferenceEngine(root / "engine", block_tokens=16, device=device)
        draw = random.Random(0)
        tokens = [BOS, *(draw.randrange(256) for _ in range(prompt_tokens - 1))]
        engine.prefill(tokens[:64])  # the device's first kernels, outside the timing
        recompute_s = best_seconds(lambda: engine.prefill(tokens), repeat=repeat)
        full = engine.prefill(tokens)  # its logits are on the host: synchronous
        blocks = [
            (random.Random(b).randbytes(32).hex(), bytes(block_container(engine, full, b)))
            for b in range(prompt_tokens // 16)
        ]
        compat = engine.descriptor.compat_id_hex
        size = len(blocks[0][1])
        with (
            _holder() as (context, uri),
            BlockFetcher(context, threads=min(available_cores(), 16)) as fetcher,
        ):
            records = _store(fetcher, uri, compat, blocks)
            buffers = [bytearray(size) for _ in blocks]
            requests = [
                BlockRequest(compat, SCOPE, r.block_key, [r], into=buffer)
                for r, buffer in zip(records, buffers, strict=True)
            ]
            best = (float("inf"), 0.0, 0.0, 0.0)
            for _ in range(repeat):
                start = time.perf_counter()
                for done in fetcher.fetch_all(requests):
                    if not done.ok:
                        raise RuntimeError(f"block {done.request.block_key}: {done.errors}")
                fetched = time.perf_counter()
                loaded = load_blocks(buffers, engine.descriptor)
                decoded = time.perf_counter()
                reused = engine.prefill(tokens, loaded)
                end = time.perf_counter()
                if end - start < best[0]:
                    best = (end - start, fetched - start, decoded - fetched, end - decoded)
        if reused.computed != 1:
            raise RuntimeError(f"the loaded prompt computed {reused.computed} tokens, not 1")
        difference = float((reused.logits - full.logits).abs().max())
        same = int(reused.logits.argmax()) == int(full.logits.argmax())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total, fetch_s, load_s, prefill_s = best
    what = f"reference engine on {where.type}, {prompt_tokens}-token prompt"
    return [
        Result(
            f"{what}: loaded from a holder",
            "s",
            total,
            f"recomputed on {where.type}",
            recompute_s,
        ),
        Result(f"  of which fetch, {len(blocks)} blocks of {size} octets, verified", "s", fetch_s),
        Result("  of which decode into tensors (load_blocks)", "s", load_s),
        Result("  of which prefill of the last token on the loaded KV", "s", prefill_s),
        Result(
            f"{what}: logits loaded vs recomputed, max |difference|"
            + ("" if same else " (another greedy token!)"),
            "1e-6",
            difference * 1e6,
            goal=1000.0,
            direction="lower",
        ),
    ]


RUNS: dict[str, Callable[[str, bool], list[Result]]] = {
    "holder": holder_into_device,
    "paged": paged_gather_scatter,
    "engine": engine_fetch_or_recompute,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.device", description=__doc__)
    parser.add_argument("--device", default="cuda", help="a torch device (default cuda)")
    parser.add_argument(
        "--section", action="append", choices=SECTIONS, help="only these (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer blocks, shorter runs")
    parser.add_argument("--append", type=Path, help="also append the table to this file")
    args = parser.parse_args(argv)
    import torch

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"{args.device}: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    header = describe(args.device)
    print(header, flush=True)
    results: list[Result] = []
    failed = []
    for section in args.section or SECTIONS:
        start = time.perf_counter()
        try:
            results += RUNS[section](args.device, args.quick)
        except Exception as exc:
            failed.append(f"{section}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        print(f"[{section}: {time.perf_counter() - start:.1f} s]", file=sys.stderr, flush=True)
    table = format_table(results) if results else "(no figures)"
    text = "\n".join([header, table, *(f"FAILED {line}" for line in failed)]) + "\n"
    print(text, end="", flush=True)
    if args.append is not None:
        with args.append.open("a") as out:
            out.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
