"""SGLang's v2 batch interface over kvstore (issue 10, SGLang 0.5.23).

Hybrid models keep host pools beside the KV pool: Mamba states, sliding
window (SWA) KV, DeepSeek's indexer. SGLang moves their pages with the v2
methods of :class:`~kvstore.integrations.sglang.KvstoreHiCacheStorage`,
which this module serves, and the KV pages with v1 (``batch_get_v1`` ...)
as before:

* ``batch_exists_v2(keys, pool_transfers)``: the hybrid controller's hit
  query when a request has extra pools: how many of ``keys`` (page hashes)
  are usable, the KV pages and every pool's pages together;
* ``batch_set_v2`` / ``batch_get_v2``: the hybrid controller's backup and
  prefetch of extra pools, and the plain controller's prefetch of
  KV-derived sidecar pools (which use the KV pool's host indices).

Names. A pool's page under SGLang's page hash ``h`` is a chunk of its own,
``h<ranks>`` for the KV pool (v1's name: v1 and v2 find each other's
pages) and ``h<ranks>#<pool>`` or ``h<ranks>#<pool>:<layout>`` for an extra
pool (:attr:`PageFormat.tag`): pools never share a Block Key, and ranks keep
theirs as in v1.

Containers. A KV-shaped extra pool (SGLang's ``MHATokenToKVPoolHost``,
e.g. SWA) is stored like the KV pool: one container layer per layer of the
pool, K then V in ``kvsp-layout-1``, whatever its host layout. Any other
pool's page (Mamba's conv and temporal states of every layer; an indexer's
packed keys and scales) has no K/V/heads shape to describe, so its
container (:class:`FlatPages`) holds one layer whose K section is the page
as SGLang serializes it (``get_data_page(flat=True)``, restored by
``set_from_flat_data_page``) and whose V section is empty; the token count
is the KV page's (the tokens the key names). That is a valid container
(codec raw, digested per layer, BL6) that the holder stores and serves
like any other, but its octets are only meaningful to the same pool class,
so its name carries the host layout, and a read checks the octet count.
A holder configured with the model's descriptor (``[holder] descriptors``)
checks every block of that Compatibility ID against the KV geometry and
refuses such pages (logged; the pool's pages are then never stored).

Hit policies (``batch_exists_v2``, as SGLang's own HiCacheFile and
Mooncake backends count them; p is a prefix length in pages, up to the
KV prefix held):

==============  ========================================================
ALL_PAGES       p is usable when the pool holds every page before p
TRAILING_PAGES  p is usable when the pool holds the last N pages before
                p (N = ``len(transfer.keys)``): a state saved at some
                pages only leaves holes, all reported
                (``restorable_prefix_pages``)
BLOCK_GROUPS    the pool's own verdict only, never gating the KV hit:
                ``block_pages`` pages for each leading group of
                ``group_pages`` of its keys that is held whole (no
                SGLang backend implements it in 0.5.23; this is its
                docstring's reading)
==============  ========================================================

The usable prefix is the longest p every gating pool allows. Failures are
misses, never exceptions into SGLang (STYLE 8): a pool that is not
registered, indices that do not match the keys, a holder that is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

from ..protocol import container as kc
from ..protocol._bytes import BytesLike
from ..protocol.codecs import CODEC_RAW
from ..protocol.problems import KvspError
from .chunks import ChunkStore

log = logging.getLogger(__name__)


class PageFormat(Protocol):
    """How one host pool's pages become containers and back."""

    #: Host slots per page: page ``i`` of a transfer starts at ``host_indices[i * page_size]``.
    page_size: int
    #: Appended to a page's name: "" for the KV pool (v1's names).
    tag: str

    def container_at(self, slot: int) -> bytearray: ...

    def write_at(self, slot: int, body: BytesLike) -> bool:
        """Write a served container into the page at ``slot``; False (the
        page untouched) for one of another shape."""
        ...


class FlatPages:
    """A pool that is not KV-shaped: each page as SGLang's own flat octets,
    the K section of a one-layer container (see the module for why)."""

    def __init__(self, pool: Any, name: str, token_count: int) -> None:
        dummy = pool.get_dummy_flat_data_page()
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.octets = dummy.numel() * dummy.element_size()
        self.token_count = token_count
        self.tag = f"#{name}:{getattr(pool, 'layout', 'flat')}"

    def container_at(self, slot: int) -> bytearray:
        page = self.pool.get_data_page(slot, flat=True).detach().cpu().contiguous()
        octets = page.reshape(-1).view(torch.uint8)
        if octets.numel() != self.octets:
            raise ValueError(f"a page of {octets.numel()} octets, not {self.octets}")
        return kc.encode([(memoryview(octets.numpy()), b"")], token_count=self.token_count)

    def write_at(self, slot: int, body: BytesLike) -> bool:
        try:
            container = kc.decode(body)
        except KvspError as exc:
            log.warning("kvstore: a holder served a page that does not decode: %s", exc.detail)
            return False
        page_octets = [(len(x.k), len(x.v)) for x in container]
        if (
            container.codec != CODEC_RAW
            or container.first_layer != 0
            or container.token_count != self.token_count
            or page_octets != [(self.octets, 0)]
        ):
            log.warning("kvstore: a holder served a %s page of another shape; ignored", self.tag)
            return False
        page = self.pool.get_dummy_flat_data_page()
        # The octets into a page of the pool's own dtype: set_from_flat_data_page
        # would convert the values of a uint8 tensor, not reinterpret them.
        memoryview(page.view(torch.uint8).numpy()).cast("B")[:] = container.layer(0).k
        self.pool.set_from_flat_data_page(slot, page)
        return True


@dataclass(slots=True)
class Batch:
    """The pages of one v2 get or set, every pool's together, so that the
    holders see one batch (one lease per holder for a get, LE1)."""

    names: list[str] = field(default_factory=list)
    #: The format and host slot of each of ``names``.
    pages: list[tuple[PageFormat, int]] = field(default_factory=list)
    #: Per transfer: its name, its page count, its first page in ``names`` (-1: not sent).
    spans: list[tuple[Any, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, transfers: Sequence[Any], formats: Mapping[str, PageFormat], suffix: str) -> Batch:
        batch = cls()
        for transfer in transfers:
            keys = list(transfer.keys or ())
            fmt = formats.get(str(transfer.name))
            indices = transfer.host_indices
            wanted = len(keys) * fmt.page_size if fmt is not None else -1
            if keys and (fmt is None or indices is None or indices.numel() != wanted):
                # What SGLang's own backends refuse too; a miss, not an exception.
                given = 0 if indices is None else indices.numel()
                why = "no registered pool" if fmt is None else f"{given} host indices for {wanted}"
                log.warning("kvstore: %d %s pages not moved: %s", len(keys), transfer.name, why)
                batch.spans.append((transfer.name, len(keys), -1))
                continue
            batch.spans.append((transfer.name, len(keys), len(batch.names)))
            if not keys or fmt is None:
                continue
            slots = indices.tolist()
            for i, key in enumerate(keys):
                batch.names.append(key + suffix + fmt.tag)
                batch.pages.append((fmt, int(slots[i * fmt.page_size])))
        return batch

    def results(self, done: Sequence[bool]) -> dict[Any, list[bool]]:
        """SGLang's answer: per pool, whether each of its pages moved."""
        return {
            name: list(done[start : start + count]) if start >= 0 else [False] * count
            for name, count, start in self.spans
        }


def looked_up(transfer: Any, keys: Sequence[str], kv_pages: int) -> list[str]:
    """The keys of ``transfer``'s pool that its hit policy asks about: the
    pool's page at each KV page held (as HiCacheFile does), or for
    BLOCK_GROUPS the pool's own keys."""
    if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
        return list(transfer.keys or keys)
    return list(keys[:kv_pages])


async def exists(
    store: ChunkStore,
    keys: Sequence[str],
    transfers: Sequence[Any],
    formats: Mapping[str, PageFormat],
    suffix: str,
) -> PoolTransferResult:
    """``batch_exists_v2``: the KV prefix held, then each pool's pages
    (``HEAD`` requests under the store's concurrency limit, like v1's)."""
    kv_pages = await store.contains_prefix([k + suffix for k in keys])
    if not kv_pages:
        return PoolTransferResult(0, {}, [])
    asked = [(formats.get(str(t.name)), looked_up(t, keys, kv_pages)) for t in transfers]
    names = [k + suffix + fmt.tag for fmt, pages in asked if fmt is not None for k in pages]
    found = iter(await asyncio.gather(*(store.contains(n) for n in names)))
    # A pool that is not registered holds nothing: it gates every prefix.
    held = [
        [next(found) for _ in pages] if fmt is not None else [False] * len(pages)
        for fmt, pages in asked
    ]
    return pool_hits(len(keys), kv_pages, transfers, held)


def pool_hits(
    span: int, kv_pages: int, transfers: Sequence[Any], held: Sequence[Sequence[bool]]
) -> PoolTransferResult:
    """The usable prefix (the module's table) from what each pool holds:
    ``held[j][i]`` is whether transfer ``j``'s pool holds the page of its
    ``i``-th looked-up key (:func:`looked_up`)."""
    hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    usable = set(range(1, kv_pages + 1))
    for transfer, have in zip(transfers, held, strict=True):
        policy = transfer.hit_policy
        if policy == PoolHitPolicy.BLOCK_GROUPS:
            covered = _block_groups(transfer, have, span)
            if covered:
                hits[transfer.name] = covered
            continue
        if not usable:
            break  # as SGLang's backends: no verdicts once nothing is usable
        if policy == PoolHitPolicy.ALL_PAGES:
            first_missing = next((i for i in range(kv_pages) if not have[i]), kv_pages)
            allowed = set(range(1, first_missing + 1))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys or ()))
            allowed = {p for p in range(1, kv_pages + 1) if all(have[max(0, p - window) : p])}
        else:
            # A policy this backend does not know: nothing is known usable.
            log.warning(
                "kvstore: hit policy %s of pool %s not known; a miss", policy, transfer.name
            )
            allowed = set()
        if allowed:
            hits[transfer.name] = max(allowed)
        usable &= allowed
    restorable = sorted(usable)
    return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)


def _block_groups(transfer: Any, have: Sequence[bool], span: int) -> int:
    group, block = int(transfer.group_pages), int(transfer.block_pages)
    if group < 1 or block < 1:
        return 0  # no geometry given: no verdict
    whole = 0
    while (whole + 1) * group <= len(have) and all(have[whole * group : (whole + 1) * group]):
        whole += 1
    return min(whole * block, span)


__all__: Sequence[str] = ("Batch", "FlatPages", "PageFormat", "exists", "pool_hits")
