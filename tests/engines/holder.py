"""A real holder process (``kvstore serve``, uvicorn, mTLS) for the engine tests."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from kvstore.protocol.keys import scope_id
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port
from ..integration.test_index import SERVER, Process


@dataclass
class Holder:
    root: Path
    uri: str
    port: int
    process: Process
    scope_key_file: Path

    def options(self) -> dict[str, str]:
        """The ``kvstore.*`` options an engine's plug-in is configured with."""
        certs = self.root / "certs"
        return {
            "kvstore.holders": self.uri,
            "kvstore.scope_key_file": str(self.scope_key_file),
            "kvstore.cafile": str(certs / "ca.pem"),
            "kvstore.certfile": str(certs / "client-engine.pem"),
            "kvstore.keyfile": str(certs / "client-engine.key"),
            "kvstore.model": "toy-model",
            "kvstore.model_digest": "sha-256:" + "1" * 64,
            "kvstore.tokenizer_digest": "sha-256:" + "2" * 64,
            "kvstore.timeout_s": "2",
            "kvstore.down_backoff_s": "1",
        }

    def context(self) -> object:
        certs = self.root / "certs"
        return client_context(
            str(certs / "ca.pem"),
            str(certs / "client-engine.pem"),
            str(certs / "client-engine.key"),
        )

    def metric(self, name: str, *having: str) -> float:
        """A sample of the holder's ``/metrics`` (the engine's principal may
        read them); with ``having``, the sum of the labelled samples whose
        line has every one of those strings."""
        import ssl
        import urllib.request

        context = self.context()
        assert isinstance(context, ssl.SSLContext)
        with urllib.request.urlopen(self.uri + "metrics", context=context, timeout=10) as answer:
            lines = answer.read().decode().splitlines()
        if having:
            labelled = [x for x in lines if x.startswith(name + "{")]
            return sum(float(x.rsplit(" ", 1)[1]) for x in labelled if all(h in x for h in having))
        for line in lines:
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def kill(self) -> None:
        self.process.stop(signal.SIGKILL)

    def start(self) -> None:
        self.process.start(self.port)

    def stop(self) -> None:
        self.process.stop()


def start_holder(
    root: Path,
    capacity: int = 256 << 20,
    scope_keys: int = 1,
    tiers: str | None = None,
    like: Holder | None = None,
) -> Holder:
    """A holder with ``capacity`` octets of host memory (or ``tiers``, the
    configuration's ``[[storage.tiers]]``); its policy lets the
    engine's principal read and write the scopes of ``scope.key`` (and of
    ``scope-1.key`` ... for ``scope_keys`` above one). ``like``: a second
    holder with that one's certificates and scope keys."""
    root.mkdir(parents=True, exist_ok=True)
    if like is None:
        create_dev_certificates(root / "certs", ["engine"])
    else:
        (root / "certs").symlink_to(like.root / "certs")
    scopes = []
    for i in range(scope_keys):
        name = "scope.key" if i == 0 else f"scope-{i}.key"
        key = bytes.fromhex((like.root / name).read_text()) if like else os.urandom(32)
        (root / name).write_text(key.hex())
        scopes.append(scope_id(key).hex())
    port = free_port()
    uri = f"https://127.0.0.1:{port}/kvsp/"
    (root / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:engine": {
                        "roles": ["client", "metrics"],
                        "read_scopes": scopes,
                        "write_scopes": scopes,
                    }
                }
            }
        )
    )
    tiers = tiers or f'[[storage.tiers]]\nbackend = "host"\ncapacity = {capacity}\n'
    config = SERVER.format(port=port) + f'[holder]\nuri = "{uri}"\npolicy = "policy.json"\n' + tiers
    process = Process(root, "holder", config, "holder")
    process.start(port)
    return Holder(root, uri, port, process, root / "scope.key")
