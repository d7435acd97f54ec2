"""kvstore.proxy without a proxy: the identity headers of nginx and Envoy
parsed, believed only from the trusted peer, refused from any other, and
the ``unix_socket`` / ``trusted_proxy`` keys checked (docs/proxy.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest

from kvstore.config import Config, ServerConfig, check
from kvstore.protocol.problems import BadRequest
from kvstore.proxy import ForwardedIdentity, forwarded_principal, principal_of_xfcc
from kvstore.security import create_dev_certificates
from kvstore.tls import PEER, PEER_USER, principal_from_scope


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("certs")
    create_dev_certificates(root, ["alice", "bob"])
    return {n: (root / f"client-{n}.pem").read_text() for n in ("alice", "bob")}


def test_envoy_xfcc_forms(pems: dict[str, str]) -> None:
    cert = quote(pems["alice"])
    assert principal_of_xfcc(f'By=spiffe://proxy;Hash=ab12;Cert="{cert}";URI=urn:x') == (
        "urn:kvstore:alice"  # the certificate wins over the other fields
    )
    assert principal_of_xfcc("Hash=ab;URI=spiffe://cluster.local/ns/a/sa/b") == (
        "spiffe://cluster.local/ns/a/sa/b"
    )
    assert principal_of_xfcc('Hash=ab;Subject="O=Ex\\, Inc.,CN=front end 1"') == "front end 1"
    # Several hops: the last element is the nearest proxy's, the one believed.
    assert principal_of_xfcc('URI=urn:first;Subject="CN=a,O=b",URI=urn:last') == "urn:last"
    assert principal_of_xfcc("Hash=ab") is None
    with pytest.raises(ValueError):
        principal_of_xfcc('URI="urn:unclosed')


def test_nginx_escaped_pem_and_bad_headers(pems: dict[str, str]) -> None:
    nginx, xfcc = b"x-client-cert", b"x-forwarded-client-cert"
    assert forwarded_principal({nginx: quote(pems["bob"]).encode()}) == "urn:kvstore:bob"
    assert forwarded_principal({xfcc: b"URI=urn:x"}, xfcc) == "urn:x"
    for bad in (b"not a certificate", b"x" * (33 << 10), b""):
        with pytest.raises(BadRequest):
            forwarded_principal({nginx: bad})
    with pytest.raises(BadRequest, match="names no principal"):
        forwarded_principal({xfcc: b"Hash=ab"}, xfcc)
    # The proxy sets one header; a client's value of the other, passed on
    # by it, is refused rather than believed.
    with pytest.raises(BadRequest, match="must remove the other"):
        forwarded_principal({nginx: quote(pems["bob"]).encode(), xfcc: b"URI=urn:admin"})
    with pytest.raises(BadRequest, match="must remove the other"):
        forwarded_principal({nginx: quote(pems["bob"]).encode()}, xfcc)


async def _call(
    app: Any,
    peer: str | None,
    headers: list[tuple[bytes, bytes]],
    tls: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[int, Any]:
    extensions: dict[str, Any] = {PEER: peer, **(extra or {})}
    if tls is not None:
        extensions["tls"] = tls
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": headers,
        "extensions": extensions,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    body = json.dumps({"principal": principal_from_scope(scope)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_believed_from_the_trusted_peer_only(pems: dict[str, str]) -> None:
    alice = [(b"x-client-cert", quote(pems["alice"]).encode())]
    direct_tls = {"client_cert_chain": [pems["bob"]], "kvstore.principal": "urn:kvstore:bob"}
    unix = ForwardedIdentity(_echo, "unix")
    assert await _call(unix, "unix", alice) == (200, {"principal": "urn:kvstore:alice"})
    assert await _call(unix, "unix", []) == (200, {"principal": None})  # no header: nobody
    status, problem = await _call(unix, "127.0.0.1", alice, direct_tls)
    assert status == 403 and "trusted proxy" in problem["detail"]
    assert await _call(unix, "127.0.0.1", [], direct_tls) == (200, {"principal": "urn:kvstore:bob"})
    loopback = ForwardedIdentity(_echo, "127.0.0.1")
    assert await _call(loopback, "127.0.0.1", alice) == (200, {"principal": "urn:kvstore:alice"})
    assert (await _call(loopback, "127.0.0.2", alice))[0] == 403
    status, problem = await _call(loopback, "127.0.0.1", [(b"x-client-cert", b"%%")])
    assert status == 400 and problem["status"] == 400
    # From any other peer nothing is parsed: a malformed header is a 403 too.
    assert (await _call(loopback, "127.0.0.9", [(b"x-client-cert", b"%%")]))[0] == 403
    # An IPv6 trusted_proxy in any spelling matches the transport's "::1".
    six = ForwardedIdentity(_echo, "0:0:0:0:0:0:0:1")
    assert await _call(six, "::1", alice) == (200, {"principal": "urn:kvstore:alice"})
    # With trusted_proxy_uid, a loopback TCP peer is the proxy only if that
    # user owns its socket (any process may connect from 127.0.0.6).
    owned = ForwardedIdentity(_echo, "127.0.0.6", trusted_uid=1337)
    for uid, expected in ((1337, 200), (0, 403), (None, 403)):
        user = SimpleNamespace(uid=uid)
        got = await _call(owned, "127.0.0.6", alice, extra={PEER_USER: user})
        assert got[0] == expected, (uid, got)
    assert (await _call(owned, "127.0.0.6", alice))[0] == 403  # not known: not believed
    envoy = ForwardedIdentity(_echo, "unix", "x-forwarded-client-cert")
    xfcc = [(b"x-forwarded-client-cert", b"Hash=1;URI=spiffe://a/b")]
    assert await _call(envoy, "unix", xfcc) == (200, {"principal": "spiffe://a/b"})
    assert (await _call(envoy, "unix", [*xfcc, *alice]))[0] == 400


def test_the_proxy_keys_are_checked(tmp_path: Path) -> None:
    def problems(**server: Any) -> list[str]:
        base = ServerConfig(certfile="c", keyfile="k", cafile="a")
        config = Config(server=dataclasses.replace(base, **server))
        return [p for p in check(config, ("holder",)) if p.startswith("server.")]

    sock = str(tmp_path / "s.sock")
    assert problems(unix_socket=sock, trusted_proxy="unix") == []
    assert problems(trusted_proxy="127.0.0.1") == problems(trusted_proxy="::1") == []
    assert "trusted_proxy" in problems(unix_socket=sock)[0]
    assert "needs server.unix_socket" in problems(trusted_proxy="unix")[0]
    for far in ("10.0.0.7", "localhost", "proxy.example"):
        assert "loopback IP address only" in problems(trusted_proxy=far)[0], far
    assert any(
        "insecure_http" in p for p in problems(trusted_proxy="127.0.0.1", insecure_http=True)
    )
    assert problems(unix_socket=sock, trusted_proxy="unix", workers=2) == []  # one each
    assert "trusted_proxy_header" in problems(trusted_proxy_header="x-ssl-cert")[0]
    assert "pass 65535" in problems(port=65535, workers=2)[0]
    # A plain TCP listener for a proxy that connects over TCP (Istio).
    assert problems(proxy_port=9000, trusted_proxy="127.0.0.6", trusted_proxy_uid=1337) == []
    assert problems(proxy_port=9000, trusted_proxy="::1", trusted_proxy_uid=0, workers=4) == []
    assert "set trusted_proxy" in problems(proxy_port=9000)[0]
    assert (
        "set trusted_proxy" in problems(proxy_port=9000, unix_socket=sock, trusted_proxy="unix")[0]
    )
    assert (
        "overlaps"
        in problems(proxy_port=8444, trusted_proxy="127.0.0.6", trusted_proxy_uid=1337, workers=2)[
            0
        ]
    )
    assert (
        "a port"
        in problems(proxy_port=65535, trusted_proxy="127.0.0.6", trusted_proxy_uid=1337, workers=2)[
            0
        ]
    )
    assert "trusted_proxy_uid" in problems(proxy_port=9000, trusted_proxy="127.0.0.6")[0]


async def test_the_user_owning_a_loopback_peer_socket_is_found() -> None:
    # What trusted_proxy_uid is checked against: the owner of the other end
    # of a real loopback connection, from /proc/net/tcp (this process's).
    import asyncio
    import os

    from kvstore.tls import PeerUser

    found: list[PeerUser] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        found.append(PeerUser(writer.get_extra_info("peername"), writer.get_extra_info("sockname")))
        writer.close()

    for host in ("127.0.0.1", "::1"):
        server = await asyncio.start_server(accepted, host, 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        for _ in range(100):
            if found:
                break
            await asyncio.sleep(0.01)
        assert found.pop().uid == os.getuid(), host
        writer.close()
        server.close()
        await server.wait_closed()
    assert PeerUser(("127.0.0.1", 1), ("127.0.0.1", 2)).uid is None  # no such connection


def test_the_unix_socket_is_bound_private_and_never_taken_from_a_live_server(
    tmp_path: Path,
) -> None:
    import socket
    import stat

    from kvstore.config import ConfigError
    from kvstore.listener import bind_unix_socket

    path = str(tmp_path / "kv.sock")
    first = bind_unix_socket(path)
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o660
    assert [p.name for p in tmp_path.iterdir()] == ["kv.sock"]  # no private directory left
    with pytest.raises(ConfigError, match="another server listens"):
        bind_unix_socket(path)
    first.close()  # a stopped server's stale file is replaced
    second = bind_unix_socket(path)
    probe = socket.socket(socket.AF_UNIX)
    probe.connect(path)
    probe.close()
    second.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a socket"):
        bind_unix_socket(str(tmp_path / "file"))
    with pytest.raises(ConfigError):
        bind_unix_socket(str(tmp_path / "missing" / "kv.sock"))
