"""Certificates and policies read again without a restart (issue 37).

cert-manager renews a certificate by rewriting its Secret's files; an
operator adds a principal to policy.json. On SIGHUP, and when one of those
files changes (checked every ``server.reload_check_s``), ``kvstore serve``
reads them all again:

* the listener's certificate, key and CA (``server.certfile``, ``keyfile``,
  ``cafile``) into a new TLS context that every new connection takes; open
  connections finish with the one they have;
* every role's policy file, each role's :class:`~kvstore.security.Policy`
  then holding the new grants from its next request on;
* the roles' own client certificates (``client_certfile``, ``client_keyfile``:
  a holder's for the IS, the PC's and an instance's for the roles they
  call), which new connections present; the CA is added to those trusted.

All of it is read and checked first, and only then put in place: a new file
that is broken (a key that does not match its certificate, a policy with an
invalid member) keeps every old one, with one error line naming what to fix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Sequence
from pathlib import Path

from .background import Background
from .security import Policy, PolicyError
from .tls import ServerTLS, check_clients, reload_clients, reloadable_client_files

log = logging.getLogger("kvstore.serve")

#: What a file looks like from outside: changed when any of these is.
Signature = tuple[tuple[int, int, int] | None, ...]


class Reloader(Background):
    """Reloads ``tls`` (None: plain HTTP) and ``policies`` ((file, the
    policy object the roles were given) pairs) on :meth:`reload`, and by
    itself when their files change (``check_s``: how often it looks; 0:
    only on :meth:`reload`)."""

    def __init__(
        self,
        tls: ServerTLS | None,
        policies: Sequence[tuple[str, Policy]],
        files: Sequence[str],
        check_s: float = 10.0,
    ) -> None:
        super().__init__()
        self.tls, self.policies = tls, list(policies)
        #: The files watched: the listener's certificate, key and CA, the
        #: policies, the roles' client certificates and keys.
        self.files = list(
            dict.fromkeys([*files, *(path for path, _ in policies), *reloadable_client_files()])
        )
        self.check_s = check_s
        self.reloads = self.refusals = 0
        self._seen = self.signature()

    def signature(self) -> Signature:
        """Each watched file's (inode, size, modification time), None when
        it cannot be read: cert-manager swaps a symbolic link to the new
        files, so the path is followed."""
        out: list[tuple[int, int, int] | None] = []
        for path in self.files:
            try:
                found = os.stat(path)
            except OSError:
                out.append(None)
            else:
                out.append((found.st_ino, found.st_size, found.st_mtime_ns))
        return tuple(out)

    def reload(self, why: str) -> bool:
        """Read every file again and put it in place, or keep every old one
        (one error line) when any of them is bad. True when reloaded."""
        self._seen = self.signature()
        try:
            context = self.tls.build() if self.tls is not None else None
            policies = [(Policy.load(path), policy) for path, policy in self.policies]
            clients = check_clients()
        except (OSError, ssl.SSLError, PolicyError, ValueError) as exc:
            self.refusals += 1
            log.error(
                "reload (%s) refused, the certificates and policies in use stay: %s",
                why,
                _reason(exc),
            )
            return False
        if self.tls is not None and context is not None:
            self.tls.current = context
        for new, policy in policies:
            policy.take(new)
        reload_clients(clients)
        self.reloads += 1
        what = []
        if policies:
            what.append("the policy" if len(policies) == 1 else f"{len(policies)} policies")
        if clients:
            what.insert(0, "the client certificates")
        if self.tls is not None:
            what.insert(0, "the server certificate and CA")
        said = ", ".join(what[:-1]) + " and " + what[-1] if len(what) > 1 else "".join(what)
        log.info("reloaded %s (%s)", said, why)
        return True

    async def run(self) -> None:
        if not self.check_s:
            return
        while True:
            await asyncio.sleep(self.check_s)
            if self.signature() != self._seen:
                # cert-manager writes a Secret's files one by one: give the
                # last one a moment before reading them as a set.
                await asyncio.sleep(min(1.0, self.check_s / 2))
                self.reload("files changed")


def _reason(exc: BaseException) -> str:
    """What to fix, in words (not a repr)."""
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    if isinstance(exc, ssl.SSLError):
        detail = exc.reason or exc.strerror or str(exc)
        return f"the certificate, key or CA does not load ({detail})"
    return str(exc)


def tls_files(certfile: str, keyfile: str, cafile: str) -> list[str]:
    """The listener's files, as a reload reads them."""
    return [str(Path(p)) for p in (certfile, keyfile, cafile) if p]
