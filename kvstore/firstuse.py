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
    "model": "kvstore-example",
    "model_digest": "sha-256:" + "0" * 64,
    "tokenizer_digest": "sha-256:" + "1" * 64,
    "layers": 2,
    "kv_heads": 1,
    "head_dim": 8,
    "kv_dtype": "fp16",
    "positional": "none",
    "block_tokens": 4,
    "layout": "kvsp-layout-1",
}
EXAMPLE_TOKENS = [128000, 791, 6460, 374]


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8443
#: Set in the image (docker/Dockerfile): the banner then says how to take the
#: certificates out of the container and prints commands for the host.
CONTAINER_ENV = "KVSTORE_CONTAINER"


class FirstUseError(ValueError):
    """The directory cannot be used as asked; the message says what to do."""


@dataclass(frozen=True, slots=True)
class FirstUse:
    root: Path
    config: Path
    base: str
    block_url: str
    created: bool
    note: str = ""

    def banner(self, container: str | None = None) -> str:
        """What to try first. ``container``: the container this runs in
        (its host name), whose files a user on the host reads by ``docker cp``."""
        certs, example = self.root / "certs", self.root / "example"
        take_out: list[str] = []
        if container is not None:
            # Neither /data/... (not on the host) nor curl (not in the image):
            # the files copied out, and commands run from the host's shell.
            take_out = [
                f"  certificates      {certs} in the container; copy them to the host:",
                f"    docker cp {container}:{certs} ./kvstore-certs",
                f"    docker cp {container}:{example} ./kvstore-example",
                "  (below, the port is the container's: use the one it is published on)",
            ]
            certs, example = Path("kvstore-certs"), Path("kvstore-example")
        tls = (
            f"--cacert {certs / 'ca.pem'} --cert {certs / 'client-client.pem'} "
            f"--key {certs / 'client-client.key'}"
        )
        block = example / "block.kvb"
        first = "made" if self.created else "reused"
        return "\n".join(
            [
                f"kvstore: development server ({first} {self.root})",
                *([f"  {self.note}"] if self.note else []),
                f"  holder            {self.base}/kvsp/",
                f"  index service     {self.base}/is/",
                f"  controller        {self.base}/pc/",
                f"  health            {self.base}/healthz  {self.base}/readyz",
                *(
                    take_out
                    or [f"  certificates      {certs} (CA ca.pem; you are client-client.pem/.key)"]
                ),
                f"  configuration     {self.config}",
                *(
                    []
                    if container is not None
                    else [
                        f"  what it holds     {_command()} status {self.base}/kvsp/ {self.base}/pc/"
                    ]
                ),
                "",
                "  store a block (201; 412 once it is there: the key names the prefix, the",
                "  holder keeps its copy), then fetch it back and compare:",
                f"    curl {tls} -X PUT -H 'If-None-Match: *' \\",
                f"      -H 'Content-Type: application/kvsp-block' --data-binary @{block} \\",
                f"      {self.block_url}",
                f"    curl {tls} -o /tmp/fetched.kvb \\",
                f"      {self.block_url} && cmp /tmp/fetched.kvb {block}",
                "",
            ]
        )


def _command() -> str:
    """How this shell runs ``kvstore``: by name when it is on the PATH, else by
    the path of the script beside this Python (``make run``: .venv/bin/kvstore)."""
    import shutil
    import sys

    script = Path(sys.executable).parent / "kvstore"
    found = shutil.which("kvstore")
    if found is not None and Path(found).resolve() == script.resolve():
        return "kvstore"
    if script.exists():
        try:
            return str(script.relative_to(Path.cwd()))
        except ValueError:
            return str(script)
    return "kvstore"


def container_name() -> str | None:
    """The container's name for ``docker cp`` (its host name, which Docker
    sets to the container ID), when running in the image."""
    import socket

    return socket.gethostname() if os.environ.get(CONTAINER_ENV) else None


def prepare(
    root: str | Path = DIRECTORY, port: int | None = None, host: str | None = None
) -> FirstUse:
    """Make what is missing under ``root`` (nothing that exists is changed,
    but for a new host or port in files still as they were made).

    ``host``/``port``: where to serve; None keeps what ``root`` was made
    with (or the defaults)."""
    root = Path(root).resolve()
    try:
        return _prepare(root, port, host)
    except PermissionError as exc:
        # A bind-mounted host directory owned by another user (root): one
        # line naming who must be able to write it, not a traceback.
        where = exc.filename or root
        raise FirstUseError(
            f"{where}: permission denied: {root} must be writable by uid {os.getuid()} "
            f"(a host directory for the image: chown -R {os.getuid()}:{os.getgid()} it, "
            "or use a named volume)"
        ) from exc


def _public_base(host: str, port: int) -> str:
    # Listening on every address (a container): the roles reach each other,
    # and a published port reaches them, on loopback.
    public = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    public = f"[{public}]" if ":" in public else public
    return f"https://{public}:{port}"


def _policy(base: str) -> str:
    return (
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:client": {
                        "roles": ["admin", "metrics"],
                        "read_scopes": ["*"],
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:holder": {
                        "roles": ["holder"],
                        "holder": f"{base}/kvsp/",
                        "write_scopes": ["*"],
                    },
                    "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
                }
            },
            indent=2,
        )
        + "\n"
    )


def _moved(root: Path, host: str | None, port: int | None) -> tuple[str, str]:
    """Reused: the base URI to serve under, and a note. A new host or port
    rewrites kvstore.toml and policy.json if they are as they were made (the
    URIs in them follow the listener); edited ones are the user's."""
    import tomllib

    config, policy = root / "kvstore.toml", root / "policy.json"
    text = config.read_text()
    saved = tomllib.loads(text)
    server = saved.get("server", {})
    was = (str(server.get("host", DEFAULT_HOST)), int(server.get("port", DEFAULT_PORT)))
    uri = str(saved.get("holder", {}).get("uri", _public_base(*was) + "/kvsp/"))
    base = uri.removesuffix("/").removesuffix("/kvsp")
    wanted = (host or was[0], port or was[1])
    if wanted == was:
        return base, ""
    made = _public_base(*was)
    unedited = text == _config(made, *was) and (
        not policy.exists() or policy.read_text() == _policy(made)
    )
    if not unedited:
        raise FirstUseError(
            f"{config} serves on {was[0]}:{was[1]}, not {wanted[0]}:{wanted[1]} as asked, "
            "and it was edited: change server.host/port and the role URIs there, "
            "or use another --directory"
        )
    new = _public_base(*wanted)
    public = new.removeprefix("https://").rsplit(":", 1)[0].strip("[]")
    if public not in _certificate_hosts(root / "certs" / "server.pem"):
        raise FirstUseError(
            f"{root / 'certs' / 'server.pem'} is not for {public}: use another --directory "
            "(a new one makes certificates for its host)"
        )
    config.write_text(_config(new, *wanted))
    policy.write_text(_policy(new))
    return new, f"(moved from {was[0]}:{was[1]} to {wanted[0]}:{wanted[1]})"


def _certificate_hosts(path: Path) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in names.get_values_for_type(x509.IPAddress)} | set(
        names.get_values_for_type(x509.DNSName)
    )


def _prepare(root: Path, port: int | None, host: str | None) -> FirstUse:
    from .security import create_dev_certificates

    root.mkdir(parents=True, exist_ok=True)
    created = not (root / "kvstore.toml").exists()
    note = ""
    if not created:
        base, note = _moved(root, host, port)
    host, port = host or DEFAULT_HOST, port or DEFAULT_PORT
    if created:
        base = _public_base(host, port)
    if not (root / "certs" / "ca.pem").exists():
        create_dev_certificates(
            root / "certs",
            ["client", "holder", "pc"],
            hosts=("localhost", "127.0.0.1", "::1", host),
        )
    if not (root / "storage.key").exists():
        fd = os.open(root / "storage.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(32))
    if not (root / "policy.json").exists():
        (root / "policy.json").write_text(_policy(base))
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
    client = 'client_certfile = "certs/client-{0}.pem"\nclient_keyfile = "certs/client-{0}.key"\n'
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
