"""The listener of ``kvstore serve``: uvicorn with kvstore's TLS context and
protocol classes (:mod:`.tls`), its signal handling and its stop, and the
plain listeners a trusted proxy connects to, a unix socket or a loopback
TCP port (docs/proxy.md). What it serves is built by :mod:`.serve`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError
from .lifespan import Listening, Shutdown

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

log = logging.getLogger("kvstore.serve")


@contextlib.contextmanager
def stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` meanwhile, then to what they went
    to before (nothing changes outside the main thread, where signals cannot
    be caught). The server's and the workers' supervisor's."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with kvstore's stop in one place:

        * the first SIGTERM / SIGINT begins the stop: the listener closes,
          in-flight requests get ``server.shutdown_grace_s``, then the roles'
          lifespans stop in what is left of it (:class:`.Shutdown`). A second
          signal meanwhile is logged; the stop goes on (uvicorn's: a second
          SIGINT cuts the wait for in-flight requests short);
        * the process then ends with ``serve`` (exit 0), where uvicorn would
          raise the signal again;
        * :class:`.Listening` is set once the listener is bound.
        """

        def __init__(
            self,
            config: Any,
            listening: Listening,
            shutdown: Shutdown,
            proxy_sockets: Sequence[tuple[socket.socket, str]] = (),
        ) -> None:
            super().__init__(config)
            self.listening, self.shutdown_budget = listening, shutdown
            self.proxy_sockets = proxy_sockets

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                for sock, where in self.proxy_sockets:
                    await self._listen_for_the_proxy(sock, where)
                self.listening.set()

        async def _listen_for_the_proxy(self, sock: socket.socket, where: str) -> None:
            """``server.unix_socket`` or ``server.proxy_port`` (bound before
            the roles started, so a bad path or a taken port fails the start
            cleanly): plain HTTP for the trusted proxy beside the TLS
            listener, in the same server (its connections are drained and
            closed with the others at the stop)."""
            config = self.config

            def create_protocol(_loop: Any = None) -> asyncio.Protocol:
                protocol: Any = getattr(config, "kvstore_plain_protocol")  # noqa: B009
                return protocol(  # type: ignore[no-any-return]
                    config=config,
                    server_state=self.server_state,
                    app_state=self.lifespan.state,
                    _loop=_loop,
                )

            server = await asyncio.get_running_loop().create_server(
                create_protocol, sock=sock, backlog=config.backlog
            )
            self.servers.append(server)
            log.info("serving plain HTTP on %s for the trusted proxy", where)

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets)  # the socket file goes with the closing steps
            if self.force_exit:
                # A second SIGINT cut the wait for in-flight requests short;
                # uvicorn then skips the lifespan, but kvstore's stop (spill,
                # withdrawals, closing the tiers) still runs.
                await self.lifespan.shutdown()

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                log.warning("signal %d while stopping: finishing the stop first", sig)
            else:
                self.shutdown_budget.begin()
                log.info(
                    "stopping (signal %d): in-flight requests get %.0f s",
                    sig,
                    self.config.timeout_graceful_shutdown or 0,
                )
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with stop_signals(self.handle_exit):
                yield

    return Server


def bind_unix_socket(path: str, mode: int = 0o660) -> socket.socket:
    """A listening unix socket at ``path``, of ``mode`` before anyone can
    connect (its peers' forwarded identities are believed): bound in a
    private directory beside ``path``, then renamed into place. A stale
    socket file of a stopped server is replaced; a socket another server
    still answers on, or any other file, is an error."""
    import stat
    import tempfile

    target = Path(path)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise ConfigError(f"server.unix_socket: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            pass  # stale: nobody listens there
        else:
            raise ConfigError(f"server.unix_socket: another server listens on {path}")
        finally:
            probe.close()
    try:
        private = Path(tempfile.mkdtemp(prefix=".kvstore-", dir=target.parent))  # mode 0700
    except OSError as exc:
        raise ConfigError(f"server.unix_socket: {target.parent}: {exc.strerror}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(private / "s"))
        os.chmod(private / "s", mode)
        os.replace(private / "s", target)  # the socket, now at its path, of its mode
    except OSError as exc:
        sock.close()
        raise ConfigError(f"server.unix_socket: {path}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(OSError):
            (private / "s").unlink()
        with contextlib.suppress(OSError):
            private.rmdir()
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def close_socket(sock: socket.socket, path: str = "") -> None:
    """A proxy listener, at the end (or after a start that failed): closed,
    and a unix socket's file (``path``) removed."""
    sock.close()
    if path:
        with contextlib.suppress(OSError):
            Path(path).unlink(missing_ok=True)


def bind_proxy_port(trusted: str, port: int) -> tuple[socket.socket, str]:
    """The listening TCP socket of ``server.proxy_port``, on the loopback
    address of ``trusted``'s family (the proxy is on this host), and where
    it is for the log."""
    import ipaddress

    host = "::1" if ipaddress.ip_address(trusted).version == 6 else "127.0.0.1"
    sock = bind_tcp("server.proxy_port", host, port, backlog=2048)
    return sock, f"{'[::1]' if ':' in host else host}:{port}"


def bind_tcp(key: str, host: str, port: int, backlog: int) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host`` (an IP address)
    and ``port``; a port in use or an address not ours is one line naming
    ``key`` (a ConfigError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, above
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{key}: {host} port {port}: {exc.strerror}") from exc
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def check_tls_files(config: Config) -> None:
    """Read the server's certificate, key and CA now, so that a missing or
    bad file is one line naming it (a ConfigError) before anything else
    starts; nothing to read in plain-HTTP development mode."""
    from .tls import server_context

    server = config.server
    if server.insecure_http:
        return
    for name in ("certfile", "keyfile", "cafile"):
        path = getattr(server, name)
        if not path:
            raise ConfigError(f"server.{name}: required for TLS")
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"server.{name}: {path}: {exc.strerror}") from None
    try:
        server_context(server.certfile, server.keyfile, server.cafile)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"server.certfile/keyfile/cafile ({server.certfile}, "
            f"{server.keyfile}, {server.cafile}): {exc}"
        ) from None


def bind_listener(config: Config) -> socket.socket:
    """The main listening socket, bound before any role or tier is built: a
    port in use is one line (a ConfigError), and nothing was touched."""
    host, port = config.server.host, config.server.port
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"server.host: {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that
    # say so (with 0, every small answer waited for a delayed ACK: a C=1 load
    # ran at a quarter of its rate).
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (another server there? --port or KVSTORE_SERVER__PORT picks another)"
        raise ConfigError(
            f"server.port: cannot listen on {host}:{port}: {exc.strerror}"
            + (hint if exc.errno == errno.EADDRINUSE else "")
        ) from None
    sock.set_inheritable(True)
    return sock


def uvicorn_config(config: Config, app: ASGIApp) -> uvicorn.Config:
    import uvicorn

    from .tls import http1_protocol, server_context

    server = config.server
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "http": http1_protocol(server.header_timeout_s),
        # SIGTERM: stop accepting, let in-flight requests finish this long.
        "timeout_graceful_shutdown": server.shutdown_grace_s,
    }
    if server.insecure_http:
        where = f"{server.host}:{server.port}"
        log.warning("PLAIN HTTP on %s: no TLS, no client identity (development only)", where)
    else:
        certfile, keyfile, cafile = server.certfile, server.keyfile, server.cafile

        # H1: TLS 1.3, both sides authenticate; the context kvstore's own
        # clients and tests also use (tls.server_context).
        def context(uv: Any, default: Any) -> ssl.SSLContext:
            alpn = getattr(uv.http_protocol_class, "alpn_protocols", None)  # h2 by ALPN

            def build() -> ssl.SSLContext:
                return server_context(certfile, keyfile, cafile, alpn=alpn)

            built["build"] = build
            return build()

        built: dict[str, Any] = {}
        options["ssl_context_factory"] = context
    if server.http2:
        try:
            from .tls import http2_protocol

            options["http"] = http2_protocol()  # H1 SHOULD: h2 or http/1.1 by ALPN
        except ImportError as exc:
            raise ConfigError(f"server.http2: needs the http2 extra ({exc})") from exc
    # The lifespan runs the roles' background parts and their stop (STYLE 14).
    # Its lines go through the root handler in server.log_format (kvstore.logs);
    # the access log is kvstore's own (kvstore.metrics), with principal and peer.
    uv = uvicorn.Config(
        app, log_level="warning", log_config=None, access_log=False, lifespan="on", **options
    )
    uv.load()
    #: What the trusted proxy's plain listeners speak (no TLS layer).
    uv.kvstore_plain_protocol = uv.http_protocol_class  # type: ignore[attr-defined]
    if uv.ssl is not None:
        # TLS by kvstore's own layer (asyncio's, with each refused handshake
        # logged, rate-limited: asyncio logs none outside debug mode).
        from .tls import RefusedHandshakes, ServerTLS, logged_tls

        tls = ServerTLS(uv.ssl, built["build"])
        uv.http_protocol_class = logged_tls(  # type: ignore[assignment]
            uv.http_protocol_class, tls, RefusedHandshakes()
        )
        uv.ssl = None
        #: The context a reload replaces (kvstore.reload).
        uv.kvstore_tls = tls  # type: ignore[attr-defined]
    return uv
