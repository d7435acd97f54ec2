"""A holder behind a real nginx doing mutual TLS (docs/proxy.md): nginx
verifies client certificates and passes each on in ``X-Client-Cert`` over
the holder's unix socket; the holder authorizes by that forwarded identity
(SEC1). A direct TLS client sending the header is refused, whichever
certificate it names, and a client cannot smuggle one through nginx."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest

from kvstore.client import HolderClient
from kvstore.protocol.problems import ScopeDenied
from kvstore.security import create_dev_certificates
from kvstore.tls import client_context

from ..conftest import free_port, wait_for_port
from ..storage.helpers import COMPAT, SCOPE, block, ref
from .test_index import SERVER, Process

OTHER_SCOPE = "0" * 32


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None
    )
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nginx is not installed (.ci/run installs Debian's nginx)")
        pytest.skip("nginx is not installed (apt-get install nginx)")
    return found


NGINX = """
user root; worker_processes 1; daemon off; pid {root}/nginx.pid;
error_log {root}/nginx-error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  upstream kvstore {{ server unix:{socket}; keepalive 16; }}
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {certs}/server.pem; ssl_certificate_key {certs}/server.key;
    ssl_client_certificate {certs}/ca.pem; ssl_verify_client on; ssl_protocols TLSv1.3;
    client_max_body_size 64m;
    location / {{
      proxy_pass http://kvstore;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Client-Cert $ssl_client_escaped_cert;
      proxy_set_header X-Forwarded-Client-Cert "";  # never a client's own
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


@dataclass
class Proxied:
    root: Path
    via_nginx: str
    direct: str
    socket: Path

    def context(self, name: str) -> ssl.SSLContext:
        certs = self.root / "certs"
        return client_context(
            str(certs / "ca.pem"),
            str(certs / f"client-{name}.pem"),
            str(certs / f"client-{name}.key"),
        )


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    binary = nginx_binary()
    root = tmp_path_factory.mktemp("proxy")
    create_dev_certificates(root / "certs", ["alice", "bob"])
    direct_port, nginx_port = free_port(), free_port()
    via_nginx = f"https://127.0.0.1:{nginx_port}/kvsp/"
    sock = root / "kvstore.sock"
    (root / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:alice": {"read_scopes": [SCOPE], "write_scopes": [SCOPE]},
                    "urn:kvstore:bob": {
                        "read_scopes": [OTHER_SCOPE],
                        "write_scopes": [OTHER_SCOPE],
                    },
                }
            }
        )
    )
    holder = Process(
        root,
        "holder",
        SERVER.format(port=direct_port)
        + f'unix_socket = "{sock}"\ntrusted_proxy = "unix"\n'
        + f'[holder]\nuri = "{via_nginx}"\npolicy = "policy.json"\n'
        + '[[storage.tiers]]\nbackend = "host"\ncapacity = 67108864\n',
        "holder",
    )
    holder.start(direct_port)
    (root / "nginx.conf").write_text(
        NGINX.format(root=root, socket=sock, port=nginx_port, certs=root / "certs")
    )
    nginx = subprocess.Popen(
        [binary, "-p", str(root), "-c", str(root / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(nginx_port)
        yield Proxied(root, via_nginx, f"https://127.0.0.1:{direct_port}/kvsp/", sock)
    finally:
        nginx.terminate()
        nginx.wait(10)
        holder.stop()
    assert not sock.exists()  # removed at the stop


async def test_authorized_by_the_identity_nginx_forwards(proxied: Proxied) -> None:
    mode = stat.S_IMODE(proxied.socket.stat().st_mode)
    assert mode == 0o660, oct(mode)  # not every local user's to connect to
    key = ref(1).block_key
    body = block()
    async with HolderClient(proxied.context("alice")) as alice:
        record = await alice.put_block(proxied.via_nginx, COMPAT, SCOPE, key, body)
        assert record.holder == proxied.via_nginx
        assert await alice.get_block(proxied.via_nginx, COMPAT, SCOPE, key, record=record) == body
    async with HolderClient(proxied.context("bob")) as bob:
        with pytest.raises(ScopeDenied):
            await bob.get_block(proxied.via_nginx, COMPAT, SCOPE, key)
        with pytest.raises(ScopeDenied):
            await bob.put_block(proxied.via_nginx, COMPAT, SCOPE, ref(2).block_key, block())
    # The same holder, directly over its own TLS: alice as before.
    async with HolderClient(proxied.context("alice")) as alice:
        assert await alice.get_block(proxied.direct, COMPAT, SCOPE, key) == body


async def test_a_forwarded_identity_from_anyone_else_is_refused(proxied: Proxied) -> None:
    key = ref(1).block_key
    alice_pem = (proxied.root / "certs" / "client-alice.pem").read_text()
    forged = {"X-Client-Cert": quote(alice_pem)}
    url = f"blocks/{COMPAT}/{SCOPE}/{key}"
    # bob, directly over TLS, claims alice's certificate: refused (403),
    # and so is an Envoy-style header.
    connector = aiohttp.TCPConnector(ssl=proxied.context("bob"))
    async with aiohttp.ClientSession(connector=connector) as http:
        for headers in (forged, {"X-Forwarded-Client-Cert": "URI=urn:kvstore:alice"}):
            async with http.get(proxied.direct + url, headers=headers) as response:
                assert response.status == 403
                problem = await response.json(content_type=None)
                assert "trusted proxy" in problem["detail"]
        # Through nginx the header is nginx's own, and a client's XFCC is
        # dropped there: bob stays bob.
        for headers in (forged, {"X-Forwarded-Client-Cert": "URI=urn:kvstore:alice"}):
            async with http.get(proxied.via_nginx + url, headers=headers) as response:
                assert response.status == 403
                problem = await response.json(content_type=None)
                assert problem["type"].endswith("scope-denied")


async def test_a_proxy_over_loopback_tcp_as_an_istio_sidecar(tmp_path: Path) -> None:
    # server.proxy_port: plain HTTP on loopback for a proxy that connects
    # over TCP. The test plays the sidecar from 127.0.0.2 (Istio's is
    # 127.0.0.6), sending XFCC with the client workload's URI; any other
    # local peer gets no identity there and may not forward one.
    create_dev_certificates(tmp_path / "certs", ["alice"])
    port, proxy_port = free_port(), free_port()
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "principals": {
                    "urn:kvstore:alice": {"read_scopes": [SCOPE], "write_scopes": [SCOPE]},
                    "spiffe://cluster.local/ns/llm/sa/engine": {"read_scopes": [SCOPE]},
                }
            }
        )
    )
    holder = Process(
        tmp_path,
        "holder",
        SERVER.format(port=port)
        + f'trusted_proxy = "127.0.0.2"\nproxy_port = {proxy_port}\n'
        + f"trusted_proxy_uid = {os.getuid()}\n"  # the test is the proxy
        + 'trusted_proxy_header = "x-forwarded-client-cert"\n'
        + f'[holder]\nuri = "https://127.0.0.1:{port}/kvsp/"\n'
        + 'policy = "policy.json"\n'
        + '[[storage.tiers]]\nbackend = "host"\ncapacity = 67108864\n',
        "holder",
    )
    holder.start(port)
    try:
        wait_for_port(proxy_port)
        url = f"http://127.0.0.1:{proxy_port}/kvsp/blocks/{COMPAT}/{SCOPE}/{ref(1).block_key}"
        body = block()
        sidecar = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=sidecar) as http:
            put = {
                "If-None-Match": "*",
                "X-Forwarded-Client-Cert": "By=spiffe://cluster.local/ns/kv/sa/kvstore;URI=urn:kvstore:alice",
            }
            async with http.put(url, data=body, headers=put) as response:
                assert response.status == 201, await response.text()
            engine = {"X-Forwarded-Client-Cert": "URI=spiffe://cluster.local/ns/llm/sa/engine"}
            async with http.get(url, headers=engine) as response:
                assert response.status == 200 and await response.read() == body
            async with http.put(
                url.replace(ref(1).block_key, ref(2).block_key),
                data=body,
                headers={**engine, "If-None-Match": "*"},
            ) as response:
                assert response.status == 403  # the engine may read, not write
            async with http.get(url) as response:
                assert response.status == 401  # no header: no identity
            async with http.get(url, headers={"X-Client-Cert": "x", **engine}) as response:
                assert response.status == 400  # the other header too: refused
        direct = aiohttp.TCPConnector(local_addr=("127.0.0.1", 0))
        async with aiohttp.ClientSession(connector=direct) as http:
            async with http.get(url, headers=engine) as response:
                assert response.status == 403  # a forged identity from another peer
                assert "trusted proxy" in (await response.json(content_type=None))["detail"]
            async with http.get(url) as response:
                assert response.status == 401
        # Only on loopback: the proxy port is not bound on any other address.
        assert (tmp_path / "holder.log").read_text().count(f"127.0.0.1:{proxy_port}") == 1
    finally:
        holder.stop()
    assert holder.process is not None and holder.process.returncode == 0
