"""What every ``kvstore`` command module shares (:mod:`.cli`, :mod:`.checks`, :mod:`.opscmds`,
:mod:`.certcmds`): the errors that end a command with one line and their exit
statuses, reading a JSON argument, a client TLS context from a certificate
directory, the development server's URIs and certificate directory as the
ops commands' defaults. Below them all: none of them is imported here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


class Unhealthy(Exception):
    """``kvstore health``: the server did not answer 200 (exit 1: Docker's
    HEALTHCHECK reads 1 as unhealthy and reserves 2)."""


class ClientTlsProblem(Exception):
    """``kvstore health``: the probe's own certificate (or the CA it trusts)
    is what fails, not the server: exit 3, so that an expired client
    certificate is not taken for a server down."""


EXIT_CLIENT_TLS = 3


class CliError(Exception):
    """A user-facing error: printed on one line, exit status 2."""


def read_json(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{path} is not JSON: {exc}") from exc


def _dev_context(
    certs: str,
    cafile: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    principal: str | None = None,
) -> Any:
    """A client TLS context from a certificate directory of ``kvstore serve``'s
    first use or ``kvstore certs init`` (ca.pem, client-NAME.pem/.key, NAME
    ``principal`` or ``client``), each file overridable. A missing file is a
    :class:`FileNotFoundError` naming it."""
    from .tls import client_context

    root = Path(certs)
    stem = f"client-{principal or 'client'}"
    files = {
        "CA certificate": cafile or str(root / "ca.pem"),
        "client certificate": cert or str(root / f"{stem}.pem"),
        "client key": key or str(root / f"{stem}.key"),
    }
    for what, file in files.items():
        if not Path(file).is_file():
            raise FileNotFoundError(f"{what} {file} does not exist")
    return client_context(files["CA certificate"], files["client certificate"], files["client key"])


def default_urls(directory: str = ".kvstore") -> list[str]:
    """The URIs ``status`` and ``top`` read without any given: ``KVSTORE_URL``,
    else the development server's roles (``<directory>/kvstore.toml``, as
    ``kvstore serve`` made it, or its defaults on port 8443)."""
    given = os.environ.get("KVSTORE_URL", "").replace(",", " ").split()
    if given:
        return given
    config = Path(directory) / "kvstore.toml"
    if config.is_file():
        import tomllib

        try:
            saved = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            saved = {}
        found = [
            str(saved[section]["uri"])
            for section in ("holder", "index", "controller")
            if isinstance(saved.get(section), dict) and saved[section].get("uri")
        ]
        if found:
            return found
    return [f"https://127.0.0.1:8443{path}" for path in ("/kvsp/", "/is/", "/pc/")]


def default_certs() -> str:
    """The certificate directory ops commands use: ``KVSTORE_CERTS``, else
    the development server's."""
    return os.environ.get("KVSTORE_CERTS") or ".kvstore/certs"


def default_health_url() -> str:
    """``kvstore health``'s default: the readiness of the listener of
    :func:`default_urls`' first URI."""
    from urllib.parse import urlsplit

    first = urlsplit(default_urls()[0])
    return f"{first.scheme}://{first.netloc}/readyz"
