"""First use: ``kvstore serve`` without ``--config`` (``make run``).

It runs a holder, an Index Service and a Placement Controller on one
listener, with embedded tiers (host memory, then LMDB) and everything under
one directory (``./.kvstore/`` by default), made on the first start and kept
after it:

- ``certs/``: a development CA, the server's certificate and client
  certificates for ``client`` (you), ``holder`` (it publishes to the IS) and
  ``pc`` (it looks prompts up in the IS);
- ``policy.json``: what each of them may do;
- ``storage.key``: 32 random octets, the key blocks are sealed with at rest;
- ``lmdb/``: the blocks that survive a restart;
- ``kvstore.toml``: the configuration all this is wired by, to be edited or
  copied (``kvstore serve --config .kvstore/kvstore.toml`` is the same);
- ``example/``: a descriptor, a scope key and one block, for the ``curl``
  commands it prints.

A second start reuses all of it: the blocks in LMDB are served again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .protocol.compat import parse_descriptor
from .protocol.container import encode
from .protocol.keys import block_keys, scope_id
from .protocol.wire import block_path

DIRECTORY = ".kvstore"
EXAMPLE_DESCRIPTOR = {
    "model": "kvstore-example", "model_digest": "sha-256:" + "0" * 64,
    "tokenizer_digest": "sha-256:" + "1" * 64, "layers": 2, "kv_heads": 1, "head_dim": 8,
    "kv_dtype": "fp16", "positional": "none", "block_tokens": 4, "layout": "kvsp-layout-1",
}  # fmt: skip
EXAMPLE_TOKENS = [128000, 791, 6460, 374]


@dataclass(frozen=True, slots=True)
class FirstUse:
    root: Path
    config: Path
    base: str
    block_url: str
    created: bool
    note: str = ""

    def banner(self) -> str:
        certs = self.root / "certs"
        tls = (f"--cacert {certs / 'ca.pem'} --cert {certs / 'client-client.pem'} "
               f"--key {certs / 'client-client.key'}")  # fmt: skip
        example = self.root / "example" / "block.kvb"
        first = "made" if self.created else "reused"
        return "\n".join([
            f"kvstore: development server ({first} {self.root})",
            *([f"  {self.note}"] if self.note else []),
            f"  holder            {self.base}/kvsp/",
            f"  index service     {self.base}/is/",
            f"  controller        {self.base}/pc/",
            f"  health            {self.base}/healthz  {self.base}/readyz",
            f"  certificates      {certs} (CA ca.pem; you are client-client.pem/.key)",
            f"  configuration     {self.config}",
            "",
            "  store a block (201; 412 once it is there: the key names the prefix, the",
            "  holder keeps its copy), then fetch it back and compare:",
            f"    curl {tls} -X PUT -H 'If-None-Match: *' \\",
            f"      -H 'Content-Type: application/kvsp-block' --data-binary @{example} \\",
            f"      {self.block_url}",
            f"    curl {tls} -o /tmp/fetched.kvb \\",
            f"      {self.block_url} && cmp /tmp/fetched.kvb {example}",
            "",
        ])  # fmt: skip


def prepare(root: str | Path = DIRECTORY, port: int = 8443, host: str = "127.0.0.1") -> FirstUse:
    """Make what is missing under ``root`` (nothing that exists is changed)."""
    from .security import create_dev_certificates

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    created = not (root / "kvstore.toml").exists()
    # Listening on every address (a container): the roles reach each other,
    # and a published port reaches them, on loopback.
    public = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    public = f"[{public}]" if ":" in public else public
    base, note = f"https://{public}:{port}", ""
    if not created:
        # Reused: kvstore.toml says where it serves (it may have been edited).
        import tomllib

        saved = tomllib.loads((root / "kvstore.toml").read_text())
        uri = str(saved.get("holder", {}).get("uri", base + "/kvsp/"))
        base = uri.removesuffix("/").removesuffix("/kvsp")
        where = (saved.get("server", {}).get("host"), saved.get("server", {}).get("port"))
        if where != (host, port):
            note = (f"(--host/--port ignored: {root / 'kvstore.toml'} says "
                    f"{where[0]}:{where[1]}; edit it, or use another --directory)")  # fmt: skip
    if not (root / "certs" / "ca.pem").exists():
        create_dev_certificates(root / "certs", ["client", "holder", "pc"],
                                hosts=("localhost", "127.0.0.1", "::1", host))  # fmt: skip
    if not (root / "storage.key").exists():
        fd = os.open(root / "storage.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(32))
    if not (root / "policy.json").exists():
        (root / "policy.json").write_text(json.dumps({"principals": {
            "urn:kvstore:client": {"roles": ["admin", "metrics"], "read_scopes": ["*"],
                                   "write_scopes": ["*"]},
            "urn:kvstore:holder": {"roles": ["holder"], "holder": f"{base}/kvsp/",
                                   "write_scopes": ["*"]},
            "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
        }}, indent=2) + "\n")  # fmt: skip
    example = root / "example"
    example.mkdir(exist_ok=True)
    if not (example / "descriptor.json").exists():
        (example / "descriptor.json").write_text(json.dumps(EXAMPLE_DESCRIPTOR, indent=2) + "\n")
    if not (example / "scope.key").exists():
        (example / "scope.key").write_text(os.urandom(32).hex() + "\n")
    descriptor = parse_descriptor(json.loads((example / "descriptor.json").read_text()))
    scope_key = bytes.fromhex((example / "scope.key").read_text().strip())
    key = block_keys(scope_key, descriptor.compat_id, EXAMPLE_TOKENS, 4)[0].hex()
    if not (example / "block.kvb").exists():
        section = descriptor.section_length(4)

        def octets(label: bytes) -> bytes:
            return (hashlib.sha256(label).digest() * (section // 32 + 1))[:section]

        sections = [(octets(b"K%d" % i), octets(b"V%d" % i)) for i in range(descriptor.layers)]
        (example / "block.kvb").write_bytes(bytes(encode(sections, token_count=4)))
    if created:
        (root / "kvstore.toml").write_text(_config(base, host, port))
    url = f"{base}/kvsp/" + block_path(descriptor.compat_id_hex, scope_id(scope_key).hex(), key)
    return FirstUse(root, root / "kvstore.toml", base, url, created, note)


def _config(base: str, host: str, port: int) -> str:
    client = ('client_certfile = "certs/client-{0}.pem"\n'
              'client_keyfile = "certs/client-{0}.key"\n')  # fmt: skip
    return f"""# Made by `kvstore serve` on its first start; edit freely.
[server]
host = "{host}"
port = {port}
certfile = "certs/server.pem"
keyfile = "certs/server.key"
cafile = "certs/ca.pem"

[holder]
uri = "{base}/kvsp/"
policy = "policy.json"
index_uri = "{base}/is/"
descriptors = ["example/descriptor.json"]
{client.format("holder")}
[index]
uri = "{base}/is/"
policy = "policy.json"
descriptors = ["example/descriptor.json"]

[controller]
uri = "{base}/pc/"
policy = "policy.json"
index_uri = "{base}/is/"
descriptors = ["example/descriptor.json"]
{client.format("pc")}
[storage]
encryption_key_file = "storage.key"

[[storage.tiers]]
backend = "host"
capacity = 268435456

[[storage.tiers]]
backend = "lmdb"
capacity = 4294967296
path = "lmdb"
map_size = 5368709120
"""
