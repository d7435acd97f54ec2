"""A real holder: ``kvstore serve`` under uvicorn, TLS 1.3 with client certificates.

The holder runs as its own process (killed with SIGKILL in the restart test);
the client is kvstore.client over real sockets on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.client import HolderClient
from kvstore.protocol import container as kc
from kvstore.protocol.problems import (
    DigestMismatch,
    KvspError,
    PreconditionFailed,
    ScopeDenied,
)
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..storage.helpers import SCOPE, block

COMPAT = hashlib.sha256(b"integration").hexdigest()
OTHER = "e" * 32


def key(n: int) -> str:
    return hashlib.sha256(f"it-{n}".encode()).hexdigest()


class ThreadedIndex:
    """The stand-in IS on its own event loop in a thread (the holder is a process)."""

    def __init__(self) -> None:
        from ..holder.stand_in_index import StandInIndex

        self.index = StandInIndex()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.index.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.index.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Holder:
    def __init__(self, root: Path, index_uri: str) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"https://127.0.0.1:{self.port}/kvsp/"
        self.process: subprocess.Popen[bytes] | None = None
        certs = root / "certs"
        create_dev_certificates(certs, ["alice", "bob"])
        create_dev_certificates(root / "rogue", ["alice"])  # same name, another CA
        (root / "key.bin").write_bytes(os.urandom(32))
        (root / "policy.json").write_text(
            json.dumps(
                {
                    "principals": {
                        "urn:kvstore:alice": {"read_scopes": [SCOPE], "write_scopes": [SCOPE]},
                        "urn:kvstore:bob": {"read_scopes": [OTHER], "write_scopes": [OTHER]},
                    }
                }
            )
        )
        (root / "holder.toml").write_text(f"""
[server]
host = "127.0.0.1"
port = {self.port}
certfile = "certs/server.pem"
keyfile = "certs/server.key"
cafile = "certs/ca.pem"

[holder]
uri = "{self.uri}"
policy = "policy.json"
index_uri = "{index_uri}"

[storage]
encryption_key_file = "key.bin"
fast_layers = 4

[[storage.tiers]]
backend = "host"
capacity = {3 * len(block())}

[[storage.tiers]]
backend = "lmdb"
capacity = 67108864
path = "lmdb"
map_size = 268435456
""")

    def start(self) -> None:
        log = (self.root / "holder.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--config", str(self.root / "holder.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout=30)
        except RuntimeError:
            self.stop()
            raise RuntimeError((self.root / "holder.log").read_text()) from None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.send_signal(sig)
            self.process.wait(timeout=20)
            self.process = None

    def context(self, name: str, ca: str = "certs") -> ssl.SSLContext:
        certs = self.root / ca
        return client_context(
            str(self.root / "certs" / "ca.pem"),
            str(certs / f"client-{name}.pem"),
            str(certs / f"client-{name}.key"),
        )


@pytest.fixture(scope="module")
def index() -> Iterator[ThreadedIndex]:
    stand_in = ThreadedIndex()
    yield stand_in
    stand_in.stop()


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, index: ThreadedIndex) -> Iterator[Holder]:
    server = Holder(tmp_path_factory.mktemp("holder"), index.index.uri)
    server.start()
    yield server
    server.stop()


async def eventually(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def alice(holder: Holder) -> AsyncIterator[HolderClient]:
    async with HolderClient(holder.context("alice")) as client:
        yield client


async def test_put_get_and_layer_range_across_two_tiers(
    holder: Holder, alice: HolderClient
) -> None:
    data = block()
    record = await alice.put_block(holder.uri, COMPAT, SCOPE, key(1), data)
    assert [(r.tier, r.first, r.last) for r in record.residency] == [
        ("host", 0, 3),
        ("local-storage", 4, 7),
    ]
    # BL6: the client verifies Repr-Digest, the layer digests and the replica digest.
    assert await alice.get_block(holder.uri, COMPAT, SCOPE, key(1), record=record) == data
    part = await alice.get_block(holder.uri, COMPAT, SCOPE, key(1), layers=(2, 5), record=record)
    assert (kc.decode(part).first_layer, kc.decode(part).last_layer) == (2, 5)


async def test_replicas_are_published_to_the_index(
    holder: Holder, alice: HolderClient, index: ThreadedIndex
) -> None:
    # P1: the holder process publishes what it stores, with its residency.
    record = await alice.put_block(holder.uri, COMPAT, SCOPE, key(6), block())
    await eventually(lambda: key(6) in index.index.records)
    published = index.index.records[key(6)]
    assert published.holder == holder.uri
    assert published.layer_digests == record.layer_digests
    assert [r.tier for r in published.residency] == ["host", "local-storage"]


async def test_existing_replica_keeps_the_old_copy(holder: Holder, alice: HolderClient) -> None:
    first = block()
    await alice.put_block(holder.uri, COMPAT, SCOPE, key(2), first)
    with pytest.raises(PreconditionFailed):
        await alice.put_block(holder.uri, COMPAT, SCOPE, key(2), block())
    assert await alice.get_block(holder.uri, COMPAT, SCOPE, key(2)) == first


async def test_scope_isolation_over_tls(holder: Holder, alice: HolderClient) -> None:
    # SEC1: the principal comes from the certificate the TLS layer verified
    # (this fails if uvicorn stops carrying our ASGI tls extension).
    await alice.put_block(holder.uri, COMPAT, SCOPE, key(3), block())
    async with HolderClient(holder.context("bob")) as bob:
        with pytest.raises(ScopeDenied):
            await bob.get_block(holder.uri, COMPAT, SCOPE, key(3))
        record = await bob.put_block(holder.uri, COMPAT, OTHER, key(3), block())
        assert record.scope_id == OTHER


async def test_no_certificate_is_refused(holder: Holder) -> None:
    context = client_context(str(holder.root / "certs" / "ca.pem"))  # trusts, but no cert
    async with HolderClient(context) as anonymous:
        with pytest.raises(KvspError):
            await anonymous.get_block(holder.uri, COMPAT, SCOPE, key(1))


async def test_certificate_from_another_ca_is_refused(holder: Holder) -> None:
    async with HolderClient(holder.context("alice", ca="rogue")) as rogue:
        with pytest.raises(KvspError):
            await rogue.get_block(holder.uri, COMPAT, SCOPE, key(1))


async def test_tls_12_is_refused(holder: Holder) -> None:
    # H1: TLS 1.3 or later.
    context = holder.context("alice")
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    async with HolderClient(context) as old:
        with pytest.raises(KvspError):
            await old.get_block(holder.uri, COMPAT, SCOPE, key(1))


async def test_corrupted_segment_is_detected(holder: Holder, alice: HolderClient) -> None:
    # BL8, SEC4: a byte flipped on disk behind the holder's back is never served.
    record = await alice.put_block(holder.uri, COMPAT, SCOPE, key(4), block())
    env = lmdb.open(str(holder.root / "lmdb"), map_size=268435456)
    with env.begin(write=True) as txn:
        segment = f"{key(4)}/{COMPAT}/{SCOPE}/4-7".encode()
        stored = bytearray(txn.get(segment))
        stored[-20] ^= 0x01
        txn.put(segment, bytes(stored))
    env.close()
    with pytest.raises(DigestMismatch):
        await alice.get_block(holder.uri, COMPAT, SCOPE, key(4), record=record)
    reported: list[str] = []

    async def report(bad: object, error: DigestMismatch) -> None:
        reported.append(error.detail)

    # The fall-back helper treats it as a miss and reports it (P4, BL8).
    assert await alice.fetch_first([record], on_digest_failure=report) is None


async def test_restart_after_kill_recovers_lmdb_segments(
    holder: Holder, index: ThreadedIndex
) -> None:
    async with HolderClient(holder.context("alice")) as client:
        data = block()
        await client.put_block(holder.uri, COMPAT, SCOPE, key(5), data)
    holder.stop(signal.SIGKILL)  # no shutdown code runs
    index.index.records.clear()
    holder.start()
    # The restarted holder republishes what it found in LMDB.
    await eventually(lambda: key(5) in index.index.records)
    async with HolderClient(holder.context("alice")) as client:
        # Layers 0-3 were in host memory and are gone; 4-7 are back from LMDB.
        part = await client.get_block(holder.uri, COMPAT, SCOPE, key(5), layers=(4, 7))
        whole = kc.decode(data)
        assert [bytes(x.k) for x in kc.decode(part)] == [
            bytes(whole.layer(i).k) for i in range(4, 8)
        ]


async def test_producer_pinning_skips_other_digests(holder: Holder, alice: HolderClient) -> None:
    # SEC2: with the producer's digest pinned, a record stating another digest
    # (a holder publishing something else for the key) is never used.
    record = await alice.put_block(holder.uri, COMPAT, SCOPE, key(7), block())
    liar = dataclasses.replace(record, digest="sha-256:" + "0" * 64, layer_digests=None)
    unpinned = await alice.fetch_first([liar, record])
    assert unpinned is not None and unpinned[1] is liar
    pinned = await alice.fetch_first([liar, record], producer_digest=record.digest)
    assert pinned is not None and pinned[1] is record
