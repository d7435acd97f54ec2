"""A holder run as two workers (``[server] workers = 2``, docs/workers.md):
real processes over mutual TLS, with an Index Service beside them.

A client configured with one worker's URI finds both (``GET shards``), its
PUTs spread over them by rendezvous hashing and each lands where the IS
then says it is; leases and their quotas are each worker's own; a worker
killed with SIGKILL is restarted by the supervisor with its LMDB blocks
while the other serves on; SIGTERM stops them all with exit status 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvstore.client import HolderClient, IndexClient
from kvstore.holderset import HolderSet, rank
from kvstore.protocol.problems import LeaseQuota, NotFound
from kvstore.protocol.records import LookupRequest
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..storage.helpers import COMPAT, SCOPE, block, ref
from .test_index import SERVER, Process

BLOCK_OCTETS = len(block())


def consecutive_ports(count: int) -> int:
    """A free port whose next ``count - 1`` ports are free too."""
    for _ in range(50):
        first = free_port()
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


@dataclass
class Deployment:
    root: Path
    supervisor: subprocess.Popen[bytes]
    workers: tuple[str, str]
    index: str
    context: ssl.SSLContext

    def log(self) -> str:
        return (self.root / "holder.log").read_text()

    def pid(self, worker: int) -> int:
        """The pid of worker ``worker``'s latest start (the supervisor logs it)."""
        found = re.findall(rf"worker {worker} started: pid (\d+)", self.log())
        return int(found[-1])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("workers")
    create_dev_certificates(root / "certs", ["holder", "alice"])
    port, index_port = consecutive_ports(2), free_port()
    workers = (f"https://127.0.0.1:{port}/kvsp/", f"https://127.0.0.1:{port + 1}/kvsp/")
    index = f"https://127.0.0.1:{index_port}/is/"
    (root / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    # One certificate for the workers: the policy names all their URIs.
                    "urn:kvstore:holder": {
                        "roles": ["holder"],
                        "holder": list(workers),
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:alice": {
                        "roles": ["client", "metrics"],
                        "read_scopes": [SCOPE],
                        "write_scopes": [SCOPE],
                    },
                }
            }
        )
    )
    index_process = Process(
        root,
        "index",
        SERVER.format(port=index_port) + f'[index]\nuri = "{index}"\npolicy = "policy.json"\n',
        "index",
    )
    index_process.start(index_port)
    config = (
        SERVER.format(port=port)
        + "workers = 2\nshutdown_grace_s = 5.0\n"
        + 'unix_socket = "kv.sock"\ntrusted_proxy = "unix"\n'  # one socket per worker
        + f"""
[holder]
uri = "{workers[0]}"
policy = "policy.json"
index_uri = "{index}"
client_certfile = "certs/client-holder.pem"
client_keyfile = "certs/client-holder.key"

[storage]
lease_max_octets_per_client = {BLOCK_OCTETS * 3 // 2}

[[storage.tiers]]
backend = "lmdb"
capacity = 268435456
path = "lmdb"
map_size = 268435456
"""
    )
    (root / "holder.toml").write_text(config)
    log = (root / "holder.log").open("ab")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(root / "holder.toml")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    certs = root / "certs"
    context = client_context(
        str(certs / "ca.pem"), str(certs / "client-alice.pem"), str(certs / "client-alice.key")
    )
    found = Deployment(root, supervisor, workers, index, context)
    try:
        for p in (port, port + 1):
            wait_for_port(p, timeout=30)
        yield found
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(10)
        index_process.stop()


async def _readyz(deployment: Deployment, worker: int) -> dict[str, object]:
    origin = deployment.workers[worker].removesuffix("kvsp/")
    connector = aiohttp.TCPConnector(ssl=deployment.context)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(origin + "readyz") as response,
    ):
        answer: dict[str, object] = await response.json()
        return answer


async def _wait_up(deployment: Deployment, worker: int, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if (await _readyz(deployment, worker)).get("status") == "ok":
                return
        except (aiohttp.ClientError, OSError):
            pass
        assert time.monotonic() < deadline, deployment.log()
        await asyncio.sleep(0.1)


async def test_every_worker_lists_the_set_and_reports_each_state(deployment: Deployment) -> None:
    async with HolderClient(deployment.context) as client:
        for uri in deployment.workers:
            assert await client.shards(uri) == list(deployment.workers)
    for worker in (0, 1):
        await _wait_up(deployment, worker)
    ready = await _readyz(deployment, 1)
    assert ready["workers"] == {
        uri: {"worker": i, "state": "up", "restarts": 0} for i, uri in enumerate(deployment.workers)
    }


async def test_puts_through_the_set_land_where_the_index_finds_them(
    deployment: Deployment,
) -> None:
    async with (
        HolderClient(deployment.context) as client,
        IndexClient(deployment.index, deployment.context) as index,
    ):
        holders = HolderSet([deployment.workers[0]])
        assert await holders.discover(client) == deployment.workers
        keys = [ref(n).block_key for n in range(16)]
        bodies = {k: block() for k in keys}
        for key in keys:
            where, record = await holders.put_block(client, COMPAT, SCOPE, key, bodies[key])
            assert where == rank(deployment.workers, key)[0] and record is not None
            other = next(w for w in deployment.workers if w != where)
            assert await client.has_block(where, COMPAT, SCOPE, key)
            assert not await client.has_block(other, COMPAT, SCOPE, key)
        owners = {rank(deployment.workers, k)[0] for k in keys}
        assert owners == set(deployment.workers)  # both took a share
        # Each worker published its own records under its own URI (P1).
        deadline = time.monotonic() + 20
        for key in keys:
            while True:
                answer = await index.lookup(LookupRequest(SCOPE, COMPAT, (key,)))
                if answer.matched:
                    break
                assert time.monotonic() < deadline, "not published"
                await asyncio.sleep(0.05)
            assert [r.holder for r in answer.replicas[0]] == [rank(deployment.workers, key)[0]]
            fetched = await client.fetch_first(answer.replicas[0])
            assert fetched is not None and fetched[0] == bodies[key]


async def test_leases_and_their_quotas_are_each_workers_own(deployment: Deployment) -> None:
    first, second = deployment.workers
    async with HolderClient(deployment.context) as client:
        holders = HolderSet(deployment.workers)
        on = {first: [], second: []}  # type: dict[str, list[str]]
        n = 100
        while min(len(v) for v in on.values()) < 2:
            key = ref(n).block_key
            where, _ = await holders.put_block(client, COMPAT, SCOPE, key, block())
            on[where].append(key)
            n += 1
        # A worker knows only its own blocks.
        with pytest.raises(NotFound):
            await client.lease(second, [on[first][0]], 5000)
        # The quota (1.5 blocks a client) is each worker's: one block leased
        # at each, and a second one at the first worker is over its quota.
        at_first = await client.lease(first, [on[first][0]], 5000)
        at_second = await client.lease(second, [on[second][0]], 5000)
        with pytest.raises(LeaseQuota):
            await client.lease(first, [on[first][1]], 5000)
        await client.release_lease(first, at_first.lease)
        await client.release_lease(second, at_second.lease)


async def test_a_killed_worker_comes_back_with_its_blocks(deployment: Deployment) -> None:
    first, second = deployment.workers
    async with HolderClient(deployment.context, timeout_s=5) as client:
        holders = HolderSet(deployment.workers)
        keys = {first: [], second: []}  # type: dict[str, list[str]]
        bodies = {}
        n = 200
        while min(len(v) for v in keys.values()) < 3:
            key = ref(n).block_key
            bodies[key] = block()
            where, _ = await holders.put_block(client, COMPAT, SCOPE, key, bodies[key])
            keys[where].append(key)
            n += 1
        victim = deployment.pid(1)
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        # The other worker serves on meanwhile.
        for key in keys[first]:
            assert await client.get_block(first, COMPAT, SCOPE, key) == bodies[key]
        await _wait_up(deployment, 1)
        assert deployment.pid(1) != victim
        for key in keys[second]:  # recovered from its LMDB environment
            assert await client.get_block(second, COMPAT, SCOPE, key) == bodies[key]
    workers = (await _readyz(deployment, 0))["workers"]
    assert isinstance(workers, dict) and workers[second]["restarts"] == 1
    assert f"worker 1 (pid {victim}) exited with -9" in deployment.log()


async def test_status_shows_every_worker_from_one_uri(deployment: Deployment) -> None:
    from kvstore.ops import gather

    views = await gather([deployment.workers[0]], deployment.context)
    assert [v.base for v in views] == list(deployment.workers)
    for i, view in enumerate(views):
        assert not view.error and view.roles == ["holder"]
        assert all(
            dict(k).get("worker") == str(i) for k in view.samples["kvstore_tier_capacity_bytes"]
        )


async def test_each_worker_has_its_own_socket_for_a_proxy(deployment: Deployment) -> None:
    # server.unix_socket = "kv.sock": worker i listens on kv-<i>.sock too,
    # believing the proxy's forwarded identity (docs/proxy.md).
    from urllib.parse import quote

    pem = (deployment.root / "certs" / "client-alice.pem").read_text()
    for i, uri in enumerate(deployment.workers):
        connector = aiohttp.UnixConnector(path=str(deployment.root / f"kv-{i}.sock"))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.get("http://worker/kvsp/shards", headers={"X-Client-Cert": quote(pem)}) as answer,
        ):
            assert answer.status == 200
            assert (await answer.json(content_type=None))["self"] == uri


def test_sighup_has_every_worker_reload_and_the_set_goes_on(deployment: Deployment) -> None:
    # The supervisor passes it on (its default would end it at once).
    pids = [deployment.pid(0), deployment.pid(1)]
    deployment.supervisor.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while deployment.log().count("(SIGHUP)") < 3:  # the supervisor's line, each worker's
        assert time.monotonic() < deadline, deployment.log()
        time.sleep(0.05)
    assert deployment.log().count("reloaded the server certificate and CA") >= 2
    assert deployment.supervisor.poll() is None
    assert [deployment.pid(0), deployment.pid(1)] == pids  # nothing restarted


def test_sigterm_stops_every_worker_with_exit_status_0(deployment: Deployment) -> None:
    pids = [deployment.pid(0), deployment.pid(1)]
    deployment.supervisor.send_signal(signal.SIGTERM)
    assert deployment.supervisor.wait(timeout=30) == 0, deployment.log()
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        )
    for uri in deployment.workers:
        port = int(uri.split(":")[2].split("/")[0])
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert "all 2 workers stopped" in deployment.log()
    assert not list(deployment.root.glob("kv-*.sock"))  # removed at their stops
