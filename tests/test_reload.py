"""Certificates and policies read again without a restart (kvstore/reload.py):
everything checked first, put in place only whole, a broken file keeping
every old one with one error line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import ssl
from pathlib import Path

import pytest

from kvstore.protocol.problems import Forbidden
from kvstore.reload import Reloader, tls_files
from kvstore.security import Policy, create_dev_certificates
from kvstore.tls import ServerTLS, principal_of, reloadable_client_context, server_context

from .storage.helpers import until


def issue(directory: Path, principal: str) -> str:
    """A new CA, server certificate and client certificate in ``directory``;
    the CA's subject serial, to tell which CA a context trusts."""
    create_dev_certificates(directory, [principal])
    return _serial_of(server_context(*_paths(directory)))


def _paths(directory: Path) -> tuple[str, str, str]:
    return (
        str(directory / "server.pem"),
        str(directory / "server.key"),
        str(directory / "ca.pem"),
    )


def _serial_of(context: object) -> str:
    (ca,) = context.get_ca_certs()  # type: ignore[attr-defined]
    return str(ca["serialNumber"])


def policy_file(path: Path, *principals: str) -> None:
    grants = {f"urn:kvstore:{p}": {"roles": ["metrics"]} for p in principals}
    path.write_text(json.dumps({"principals": grants}))


@pytest.fixture
def live(tmp_path: Path) -> tuple[Path, ServerTLS, Policy, Reloader]:
    """A listener's files in tmp_path/live, their context and policy in use."""
    live = tmp_path / "live"
    issue(live, "alice")
    policy_file(live / "policy.json", "alice")
    files = _paths(live)
    tls = ServerTLS(server_context(*files), lambda: server_context(*files))
    policy = Policy.load(live / "policy.json")
    reloader = Reloader(tls, [(str(live / "policy.json"), policy)], tls_files(*files), 0.0)
    return live, tls, policy, reloader


def rotate(live: Path, fresh: Path) -> None:
    """Put a new CA's files where the listener reads them (as cert-manager does)."""
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(fresh / name, live / name)


def test_a_reload_takes_the_new_ca_certificate_and_policy(
    live: tuple[Path, ServerTLS, Policy, Reloader], tmp_path: Path
) -> None:
    directory, tls, policy, reloader = live
    before = tls.current
    new_ca = issue(tmp_path / "new", "bob")
    rotate(directory, tmp_path / "new")
    policy_file(directory / "policy.json", "alice", "bob")
    with pytest.raises(Forbidden):
        policy.grant("urn:kvstore:bob")
    assert reloader.reload("test")
    assert tls.current is not before and _serial_of(tls.current) == new_ca
    assert policy.grant("urn:kvstore:bob").roles == frozenset({"metrics"})
    assert reloader.reloads == 1


@pytest.mark.parametrize("broken", ["server.key", "ca.pem", "policy.json"])
def test_a_broken_file_keeps_every_old_one(
    live: tuple[Path, ServerTLS, Policy, Reloader],
    tmp_path: Path,
    broken: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory, tls, policy, reloader = live
    before, ca = tls.current, _serial_of(tls.current)
    issue(tmp_path / "new", "bob")
    rotate(directory, tmp_path / "new")  # good new certificates ...
    policy_file(directory / "policy.json", "alice", "bob")
    (directory / broken).write_text("not what it should be\n")  # ... but one broken file
    with caplog.at_level(logging.ERROR, logger="kvstore.serve"):
        assert not reloader.reload("SIGHUP")
    assert tls.current is before and _serial_of(tls.current) == ca
    with pytest.raises(Forbidden):
        policy.grant("urn:kvstore:bob")  # the old policy stays too
    assert policy.grant("urn:kvstore:alice")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("reload (SIGHUP) refused, the certificates and policies in use stay:")
    assert "Traceback" not in line and "Error(" not in line
    assert reloader.refusals == 1


async def test_a_change_of_the_files_is_read_by_itself(
    live: tuple[Path, ServerTLS, Policy, Reloader], tmp_path: Path
) -> None:
    directory, _, policy, reloader = live
    reloader.check_s = 0.02
    reloader.start()
    try:
        await asyncio.sleep(0.05)
        assert reloader.reloads == 0  # nothing changed: nothing read
        policy_file(directory / "policy.json", "alice", "carol")
        await until(lambda: reloader.reloads == 1)
        assert policy.grant("urn:kvstore:carol")
    finally:
        await reloader.stop()


def handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> str | None:
    """A TLS 1.3 handshake in memory; the principal the server saw (raises
    ssl.SSLError when either side refuses)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    near = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    far = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"near": False, "far": False}
    for _ in range(10):
        for name, side in (("near", near), ("far", far)):
            if not done[name]:
                with contextlib.suppress(ssl.SSLWantReadError):
                    side.do_handshake()
                    done[name] = True
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            with contextlib.suppress(ssl.SSLWantReadError):
                far.read(1)  # TLS 1.3: the client's certificate is checked here
            return principal_of(far.getpeercert())
    raise AssertionError("the handshake did not end")


def test_a_reload_gives_the_roles_client_certificates_their_new_files(
    live: tuple[Path, ServerTLS, Policy, Reloader], tmp_path: Path
) -> None:
    # A holder's certificate for the IS (holder.client_certfile), renewed by
    # cert-manager under a new CA: new connections present the new one.
    directory, _, _, _ = live
    client = reloadable_client_context(
        str(directory / "ca.pem"),
        str(directory / "client-alice.pem"),
        str(directory / "client-alice.key"),
    )
    old_server = server_context(*_paths(directory))
    assert handshake(client, old_server) == "urn:kvstore:alice"
    issue(tmp_path / "new", "bob")
    new_server = server_context(*_paths(tmp_path / "new"))
    with pytest.raises(ssl.SSLError):  # another CA: neither side trusts it yet
        handshake(client, new_server)
    reloader = Reloader(None, [], [], 0.0)
    assert str(directory / "client-alice.key") in reloader.files  # watched
    shutil.copy(tmp_path / "new" / "client-bob.pem", directory / "client-alice.pem")
    shutil.copy(tmp_path / "new" / "client-bob.key", directory / "client-alice.key")
    shutil.copy(tmp_path / "new" / "ca.pem", directory / "ca.pem")
    assert reloader.reload("test")
    assert handshake(client, new_server) == "urn:kvstore:bob"
    # A broken key: refused whole, the context keeps what it had.
    (directory / "client-alice.key").write_text("not a key\n")
    assert not reloader.reload("test")
    assert handshake(client, new_server) == "urn:kvstore:bob"
