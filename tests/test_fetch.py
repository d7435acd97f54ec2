"""kvstore.fetch (issue 35): blocks fetched and verified on a pool of
threads. Digests are checked at every thread count (a flipped octet in one
layer of one of many parallel fetches is caught and named by its layer,
BL6/BL8); buffers the caller gives receive exactly the octets; a holder
killed mid-fetch fails its own blocks only, and costs one timeout;
cancelling leaves no thread working on a buffer the caller got back; a PUT
whose record does not match what was sent is an error."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from kvstore.backends.host import HostTier
from kvstore.fetch import BlockFetcher, BlockRequest, Fetched
from kvstore.holder import HolderSettings, create_app
from kvstore.protocol import container as kc
from kvstore.protocol.problems import (
    DigestMismatch,
    HolderUnavailable,
    NotFound,
    PayloadTooLarge,
    PreconditionFailed,
)
from kvstore.protocol.records import ReplicaRecord
from kvstore.security import Policy
from kvstore.storage import TieredStore
from kvstore.tls import client_context

from .engines.holder import Holder, start_holder
from .storage.helpers import COMPAT, SCOPE, block, ref

OPEN = Policy.from_json(
    {"principals": {"anonymous": {"read_scopes": ["*"], "write_scopes": ["*"]}}}
)
LAYERS, SECTION = 8, 4096


class Tamper:
    """ASGI middleware in front of a holder: flips an octet at an offset of
    a block's GET body, sends a block slowly or not at all, drops its
    Repr-Digest, or rewrites the digest of PUT answers."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.flip: dict[str, int] = {}
        self.slow: set[str] = set()
        self.hang: set[str] = set()
        self.no_digest: set[str] = set()
        self.lie_on_put = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = scope["path"].rstrip("/").rsplit("/", 1)[-1]
        if key in self.hang:
            await asyncio.sleep(3)
        offset = 0
        flip = self.flip.get(key) if scope["method"] == "GET" else None

        async def sending(message: Any) -> None:
            nonlocal offset
            if message["type"] == "http.response.start" and key in self.no_digest:
                message = {
                    **message,
                    "headers": [
                        (k, v) for k, v in message["headers"] if k.lower() != b"repr-digest"
                    ],
                }
            if message["type"] != "http.response.body":
                await send(message)
                return
            body = bytearray(message.get("body", b""))
            if flip is not None and offset <= flip < offset + len(body):
                body[flip - offset] ^= 0x01
            if scope["method"] == "PUT" and self.lie_on_put and body:
                # A record true to itself (its digest made from its layer
                # digests), not to the octets received: one layer digest changed.
                stated = json.loads(body)
                layers = list(stated["layer_digests"])
                layers[0] = ("0" if layers[0][0] != "0" else "1") + layers[0][1:]
                made = kc.replica_digest([bytes.fromhex(d) for d in layers]).hex()
                raw = bytes(body).replace(stated["layer_digests"][0].encode(), layers[0].encode())
                body = bytearray(raw.replace(stated["digest"].encode(), f"sha-256:{made}".encode()))
            offset += len(body)
            if key in self.slow:
                more = message.get("more_body", False)
                for start in range(0, len(body), 4096):
                    await asyncio.sleep(0.05)
                    last = start + 4096 >= len(body)
                    piece = bytes(body[start : start + 4096])
                    await send(
                        {"type": "http.response.body", "body": piece, "more_body": more or not last}
                    )
                return
            await send({**message, "body": bytes(body)})

        await self.app(scope, receive, sending)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Tamper]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{sock.getsockname()[1]}/kvsp/"
    store = TieredStore([(HostTier(), 256 << 20)])
    app = Tamper(create_app(HolderSettings(uri, allow_anonymous=True), store, OPEN))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="error", lifespan="off", timeout_graceful_shutdown=5)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield uri, app
    server.should_exit = True
    await asyncio.wait_for(task, 15)


async def _put_all(
    fetcher: BlockFetcher, uri: str, count: int, section: int = SECTION
) -> list[tuple[ReplicaRecord, bytes]]:
    out = []
    for n in range(count):
        data = block(LAYERS, section)
        record = await fetcher.aput(uri, COMPAT, SCOPE, ref(n).block_key, data)
        out.append((record, data))
    return out


def _layer_offset(data: bytes, layer: int) -> int:
    """An offset inside layer ``layer``'s V section of a container."""
    header = kc.decode_header(data)
    assert header is not None
    offset = header.header_octets
    for k_len, v_len in header.lengths[:layer]:
        offset += k_len + v_len
    k_len, v_len = header.lengths[layer]
    return offset + k_len + v_len // 2


@pytest.mark.parametrize("threads", [1, 2, 4])
async def test_a_flipped_octet_in_one_layer_of_many_parallel_fetches_is_named(
    served: tuple[str, Tamper], threads: int
) -> None:
    uri, tamper = served
    reported: list[tuple[Any, DigestMismatch]] = []
    with BlockFetcher(threads=threads, on_digest_failure=lambda s, e: reported.append((s, e))) as f:
        stored = await _put_all(f, uri, 12)
        bad = stored[7][0]
        tamper.flip[bad.block_key] = _layer_offset(stored[7][1], 5)
        results = await f.afetch([BlockRequest(COMPAT, SCOPE, r.block_key, [r]) for r, _ in stored])
    for (record, data), result in zip(stored, results, strict=True):
        if record is bad:
            assert not result.ok and result.data is None
            (error,) = result.errors
            assert isinstance(error, DigestMismatch) and "layer 5 " in error.detail
        else:
            assert result.ok and bytes(result.data or b"") == data, result.errors
            assert result.holder == uri and result.record == record
    assert [(s, type(e)) for s, e in reported] == [(bad, DigestMismatch)]


async def test_without_a_record_the_repr_digest_still_catches_a_flip(
    served: tuple[str, Tamper],
) -> None:
    uri, tamper = served
    with BlockFetcher(threads=2) as f:
        (record, data), (other, _) = await _put_all(f, uri, 2)
        tamper.flip[record.block_key] = len(data) - 3
        tamper.no_digest.add(other.block_key)
        flipped, undigested = await f.afetch(
            [BlockRequest(COMPAT, SCOPE, r.block_key, [uri]) for r in (record, other)]
        )
    assert not flipped.ok and "Repr-Digest does not match" in flipped.errors[0].detail
    assert not undigested.ok and "no Repr-Digest" in undigested.errors[0].detail


async def test_layers_are_handed_over_verified_as_they_arrive(served: tuple[str, Tamper]) -> None:
    """B4: each layer, verified against the record, before the block ends;
    a layer range is checked against the record's digests of those layers."""
    uri, _ = served
    seen: list[tuple[int, bytes, bytes, bool]] = []
    finished = threading.Event()
    with BlockFetcher(threads=1) as f:
        ((record, data),) = await _put_all(f, uri, 1, section=64 << 10)
        whole = kc.decode(data)

        def on_layer(layer: kc.Layer) -> None:
            seen.append((layer.index, bytes(layer.k), bytes(layer.v), finished.is_set()))

        request = BlockRequest(COMPAT, SCOPE, record.block_key, [record], on_layer=on_layer)
        (result,) = await f.afetch([request], on_done=lambda _: finished.set())
        ranged = BlockRequest(COMPAT, SCOPE, record.block_key, [record], layers=(2, 4))
        (part,) = await f.afetch([ranged])
    assert result.ok
    assert [(i, k, v) for i, k, v, _ in seen] == [
        (layer.index, bytes(layer.k), bytes(layer.v)) for layer in whole
    ]
    assert not any(done for *_, done in seen)  # all before the result
    assert part.ok and [x.index for x in kc.decode(part.data or b"")] == [2, 3, 4]


async def test_buffers_the_caller_gives_receive_exactly_the_octets(
    served: tuple[str, Tamper],
) -> None:
    import torch

    uri, _ = served
    with BlockFetcher(threads=2) as f:
        stored = await _put_all(f, uri, 3)
        size = len(stored[0][1])
        plain = bytearray(size + 100)
        arena = bytearray(3 * size)
        window = memoryview(arena)[size : 2 * size]
        tensor = torch.full((size + 8,), 7, dtype=torch.uint8)
        targets = [plain, window, tensor]
        requests = [
            BlockRequest(COMPAT, SCOPE, r.block_key, [r], into=t)
            for (r, _), t in zip(stored, targets, strict=True)
        ]
        results = await f.afetch(requests)
        small = BlockRequest(COMPAT, SCOPE, stored[0][0].block_key, [uri], into=bytearray(99))
        (too_small,) = await f.afetch([small])
    assert all(r.ok for r in results)
    assert bytes(plain[:size]) == stored[0][1] and plain[size:] == bytes(100)
    assert bytes(arena[size : 2 * size]) == stored[1][1]
    assert arena[:size] == bytes(size) and arena[2 * size :] == bytes(size)  # nothing outside
    assert bytes(tensor[:size].numpy()) == stored[2][1] and bool((tensor[size:] == 7).all())
    assert results[1].data is not None and results[1].data.obj is window.obj  # no copy
    assert not too_small.ok and isinstance(too_small.errors[0], PayloadTooLarge)


async def test_a_missing_block_tries_the_next_source(served: tuple[str, Tamper]) -> None:
    uri, _ = served
    with BlockFetcher(threads=2) as f:
        ((record, data),) = await _put_all(f, uri, 1)
        absent = ref(99).block_key
        missing, found = await f.afetch(
            [
                BlockRequest(COMPAT, SCOPE, absent, [uri, uri]),
                BlockRequest(COMPAT, SCOPE, record.block_key, [uri]),
            ]
        )
    assert not missing.ok and [type(e) for e in missing.errors] == [NotFound, NotFound]
    assert found.ok and bytes(found.data or b"") == data
    # The caller's mistakes are errors of their request, not of a holder.
    with BlockFetcher(threads=1) as f:
        bad_key, bad_source = await f.afetch(
            [
                BlockRequest(COMPAT, SCOPE, "not-hex", [uri]),
                BlockRequest(COMPAT, SCOPE, record.block_key, ["ftp://example/", uri]),
            ]
        )
    assert not bad_key.ok and "block_key" in str(bad_key.errors[0])
    assert bad_source.ok and "not an http(s) holder URI" in str(bad_source.errors[0])


async def test_a_slow_holder_costs_one_timeout_then_is_skipped(
    served: tuple[str, Tamper], tmp_path: Path
) -> None:
    """Every block is at the slow holder (first) and at a real one over
    mutual TLS: each comes from the second, and only one request waits
    out the timeout; the slow holder is skipped meanwhile."""
    uri, tamper = served
    holder = start_holder(tmp_path)
    try:
        context = holder.context()
        scope = _scope(holder)
        with BlockFetcher(context, threads=1, timeout_s=0.5) as f:  # type: ignore[arg-type]
            stored = []
            for n in range(4):
                data = block(LAYERS, SECTION)
                await f.aput(uri, COMPAT, scope, ref(n).block_key, data)
                stored.append(
                    (await f.aput(holder.uri, COMPAT, scope, ref(n).block_key, data), data)
                )
            tamper.hang.update(r.block_key for r, _ in stored)
            started = time.monotonic()
            results = await f.afetch(
                [BlockRequest(COMPAT, scope, r.block_key, [uri, r]) for r, _ in stored]
            )
            took = time.monotonic() - started
    finally:
        holder.stop()
    assert all(r.ok and r.holder == holder.uri for r in results)
    assert [bytes(r.data or b"") for r in results] == [d for _, d in stored]
    waited = [r for r in results if r.errors and "no answer within" in r.errors[0].detail]
    skipped = [r for r in results if r.errors and "skipped" in r.errors[0].detail]
    assert len(waited) == 1 and len(skipped) == 3
    assert took < 2.5


def _scope(holder: Holder) -> str:
    from kvstore.protocol.keys import scope_id

    return scope_id(bytes.fromhex(holder.scope_key_file.read_text())).hex()


async def test_a_holder_killed_mid_fetch_fails_its_own_blocks_only(tmp_path: Path) -> None:
    a = start_holder(tmp_path / "a")
    b = start_holder(tmp_path / "b", like=a)  # the same CA and the same scope
    try:
        context = client_context(
            *(
                str(tmp_path / "a" / "certs" / n)
                for n in ("ca.pem", "client-engine.pem", "client-engine.key")
            )
        )
        scope = _scope(a)
        with BlockFetcher(context, threads=1, timeout_s=5) as f:
            stored: list[tuple[ReplicaRecord, bytes]] = []
            for n in range(12):
                data = block(LAYERS, 64 << 10)
                at = a if n % 2 == 0 else b
                stored.append((await f.aput(at.uri, COMPAT, scope, ref(n).block_key, data), data))
            killed = threading.Event()

            def on_done(result: Fetched) -> None:
                if result.holder == a.uri and not killed.is_set():
                    killed.set()
                    a.kill()  # SIGKILL, while the other blocks are still to come

            results = await f.afetch(
                [BlockRequest(COMPAT, scope, r.block_key, [r]) for r, _ in stored], on_done=on_done
            )
    finally:
        a.stop()
        b.stop()
    assert killed.is_set()
    at_b = [(r, d) for r, (rec, d) in zip(results, stored, strict=True) if rec.holder == b.uri]
    at_a = [r for r, (rec, _) in zip(results, stored, strict=True) if rec.holder == a.uri]
    assert len(at_b) == 6 and all(r.ok and bytes(r.data or b"") == d for r, d in at_b)
    assert at_a[0].ok  # fetched before the kill
    lost = [r for r in at_a if not r.ok]
    assert lost and all(isinstance(r.errors[0], HolderUnavailable) for r in lost)


async def test_cancelling_leaves_no_thread_on_a_buffer(served: tuple[str, Tamper]) -> None:
    """Blocks that take seconds each; cancelled after a moment, the call
    returns promptly, and once it has, no buffer changes any more."""
    uri, tamper = served
    with BlockFetcher(threads=4) as f:
        stored = await _put_all(f, uri, 8, section=32 << 10)
        tamper.slow.update(r.block_key for r, _ in stored)
        buffers = [bytearray(len(d)) for _, d in stored]
        requests = [
            BlockRequest(COMPAT, SCOPE, r.block_key, [r], into=b)
            for (r, _), b in zip(stored, buffers, strict=True)
        ]
        task = asyncio.ensure_future(f.afetch(requests))
        await asyncio.sleep(0.5)
        assert any(any(b) for b in buffers)  # reads were under way
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 2
        before = [bytes(b) for b in buffers]
        await asyncio.sleep(0.5)
        assert [bytes(b) for b in buffers] == before
        # The sync iterator: leaving the loop early cancels and waits too.
        gen = f.fetch(requests)
        first_done = await asyncio.to_thread(next, gen)
        await asyncio.to_thread(gen.close)
        before = [bytes(b) for b in buffers]
        await asyncio.sleep(0.3)
        assert [bytes(b) for b in buffers] == before
        assert first_done.request in requests
        # The fetcher still works afterwards.
        tamper.slow.clear()
        results = await f.afetch(requests)
    assert all(r.ok for r in results)
    assert [bytes(b) for b in buffers] == [d for _, d in stored]


async def test_put_checks_the_holders_record_against_what_was_sent(
    served: tuple[str, Tamper],
) -> None:
    uri, tamper = served
    with BlockFetcher(threads=2) as f:
        data = block(LAYERS, SECTION)
        record = await f.aput(uri, COMPAT, SCOPE, ref(1).block_key, lambda: data)
        made = kc.replica_digest(kc.decode(data).layer_digests())
        assert record.digest == "sha-256:" + made.hex()
        with pytest.raises(PreconditionFailed):
            await f.aput(uri, COMPAT, SCOPE, ref(1).block_key, data)  # BL7
        tamper.lie_on_put = True
        with pytest.raises(DigestMismatch, match="the octets sent have"):
            await f.aput(uri, COMPAT, SCOPE, ref(2).block_key, block(LAYERS, SECTION))
        with pytest.raises(Exception, match="not one whole container"):
            await f.aput(uri, COMPAT, SCOPE, ref(3).block_key, data[:-1])


async def test_a_restarted_holder_is_reached_on_new_connections(tmp_path: Path) -> None:
    """Kept-alive connections to a holder that was killed and started
    again are dead; the next PUT and GET go through on new ones, not fail
    (LMCache's engine stored nothing after a holder restart otherwise)."""
    holder = start_holder(tmp_path)
    try:
        scope = _scope(holder)
        with BlockFetcher(holder.context(), threads=1, timeout_s=5) as f:  # type: ignore[arg-type]
            first = await f.aput(
                holder.uri, COMPAT, scope, ref(1).block_key, block(LAYERS, SECTION)
            )
            (got,) = await f.afetch([BlockRequest(COMPAT, scope, first.block_key, [first])])
            assert got.ok
            holder.kill()
            holder.start()
            data = block(LAYERS, SECTION)
            again = await f.aput(holder.uri, COMPAT, scope, ref(2).block_key, data)
            (got,) = await f.afetch([BlockRequest(COMPAT, scope, again.block_key, [again])])
    finally:
        holder.stop()
    assert got.ok and bytes(got.data or b"") == data, got.errors
