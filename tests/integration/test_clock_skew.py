"""No behaviour depends on wall clocks agreeing between processes (OPS2,
issue 9): holders whose clocks are an hour ahead and an hour behind the
IS's publish, stay published across refreshes, and lease, because every
duration on the wire is a duration (``ttl_ms``), never a timestamp."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.client import HolderClient, IndexClient
from kvstore.protocol.records import LookupRequest
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..storage.helpers import COMPAT, SCOPE, block, ref
from .test_index import SERVER

SKEW = """import time as _time
_real = _time.time
_skew = float(__import__("os").environ.get("SKEW_S", "0"))
_time.time = lambda: _real() + _skew
_time.time_ns = lambda: int((_real() + _skew) * 1e9)
"""


def start(root: Path, name: str, config: str, roles: str, port: int, skew: float) -> Any:
    (root / f"{name}.toml").write_text(config)
    site = root / f"site-{name}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW)
    env = {
        **os.environ,
        "SKEW_S": str(skew),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    with (root / f"{name}.log").open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--roles",
                roles,
                "--config",
                str(root / f"{name}.toml"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    wait_for_port(port, timeout=30)
    return process


async def test_holders_with_skewed_clocks_publish_and_stay_published(tmp_path: Path) -> None:
    create_dev_certificates(tmp_path / "certs", ["ahead", "behind", "alice"])
    ports = {n: free_port() for n in ("index", "ahead", "behind")}
    uris = {
        n: f"https://127.0.0.1:{p}/" + ("is/" if n == "index" else "kvsp/")
        for n, p in ports.items()
    }
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    **{
                        f"urn:kvstore:{n}": {
                            "roles": ["holder"],
                            "holder": uris[n],
                            "write_scopes": ["*"],
                        }
                        for n in ("ahead", "behind")
                    },
                    "urn:kvstore:alice": {"read_scopes": ["*"], "write_scopes": ["*"]},
                }
            }
        )
    )
    processes = [
        start(
            tmp_path,
            "index",
            SERVER.format(port=ports["index"])
            + f'[index]\nuri = "{uris["index"]}"\npolicy = "policy.json"\n'
            "max_ttl_ms = 2000\n",
            "index",
            ports["index"],
            0.0,
        )
    ]
    for name, skew in (("ahead", 3600.0), ("behind", -3600.0)):
        processes.append(
            start(
                tmp_path,
                name,
                SERVER.format(port=ports[name])
                + f'[holder]\nuri = "{uris[name]}"\npolicy = "policy.json"\n'
                f'index_uri = "{uris["index"]}"\nreplica_ttl_ms = 2000\n'
                f'client_certfile = "certs/client-{name}.pem"\n'
                f'client_keyfile = "certs/client-{name}.key"\n'
                '[[storage.tiers]]\nbackend = "host"\ncapacity = 16777216\n',
                "holder",
                ports[name],
                skew,
            )
        )
    certs = tmp_path / "certs"
    context = client_context(
        str(certs / "ca.pem"), str(certs / "client-alice.pem"), str(certs / "client-alice.key")
    )
    try:
        data = block()
        async with HolderClient(context) as holders, IndexClient(uris["index"], context) as ix:
            for name in ("ahead", "behind"):
                await holders.put_block(uris[name], COMPAT, SCOPE, ref(0).block_key, data)
            query = LookupRequest(SCOPE, COMPAT, (ref(0).block_key,))

            async def holders_listed() -> set[str]:
                answer = await ix.lookup(query)
                return {r.holder for r in answer.replicas[0]} if answer.matched else set()

            deadline = time.monotonic() + 15
            while await holders_listed() != {uris["ahead"], uris["behind"]}:
                assert time.monotonic() < deadline, "a skewed holder's record never arrived"
                await asyncio.sleep(0.1)
            # Past two TTLs: refreshed records stay, whatever the clocks say.
            for _ in range(10):
                await asyncio.sleep(0.5)
                assert await holders_listed() == {uris["ahead"], uris["behind"]}
            # Leases are durations too: granted and honoured at both.
            for name in ("ahead", "behind"):
                grant = await holders.lease(uris[name], [ref(0).block_key], 1000)
                assert 0 < grant.ttl_ms <= 1000
                assert await holders.get_block(uris[name], COMPAT, SCOPE, ref(0).block_key) == data
                await holders.release_lease(uris[name], grant.lease)
        # The skew did act in those processes: their log lines carry their time.
        import datetime

        for name, skew in (("ahead", 3600.0), ("behind", -3600.0)):
            first = (tmp_path / f"{name}.log").read_text().splitlines()[0][:19]
            seen = datetime.datetime.strptime(first, "%Y-%m-%d %H:%M:%S").timestamp()
            assert abs(seen - (time.time() + skew)) < 120, (name, first)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)
