"""``kvstore certs init``, ``kvstore certs issue`` and ``kvstore health``:
the commands that make certificates and probe with them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .clibase import ClientTlsProblem, CliError, Unhealthy, _dev_context

#: What a client made by ``kvstore certs`` may do unless --role says: read and
#: write blocks, and scrape /metrics (``kvstore status``, docs/holder.md).
DEFAULT_CLIENT_ROLES = ("client", "metrics")


def _add_to_policy(file: Path, uris: Sequence[str], roles: Sequence[str]) -> None:
    """Each principal into the policy file (made if missing), with ``roles``
    and every scope; the principals already there are kept as they are."""
    from .security import Policy, PolicyError

    policy: dict[str, Any] = {"principals": {}}
    if file.exists():
        try:
            policy = json.loads(file.read_text())
        except ValueError as exc:
            raise CliError(f"{file}: not JSON ({exc}); fix or remove it") from None
    for uri in uris:
        policy.setdefault("principals", {})[uri] = {
            "roles": list(roles),
            "read_scopes": ["*"],
            "write_scopes": ["*"],
        }
    file.write_text(json.dumps(policy, indent=2) + "\n")
    try:
        Policy.load(str(file))
    except PolicyError as exc:
        raise CliError(f"{file}: {exc.problems[0]}") from None


def _check_roles(roles: Sequence[str] | None) -> tuple[str, ...]:
    from .security import ROLES

    chosen = tuple(roles or DEFAULT_CLIENT_ROLES)
    for role in chosen:
        if role not in ROLES:
            raise CliError(f"--role: unknown role {role!r}; known: {', '.join(sorted(ROLES))}")
    return chosen


def cmd_certs_init(args: argparse.Namespace) -> Any:
    from .security import create_dev_certificates

    directory = Path(args.directory)
    roles = _check_roles(args.role)
    if (directory / "ca.pem").exists() and not args.force:
        raise CliError(
            f"{directory / 'ca.pem'} exists: a new CA would make every certificate "
            f"it issued stop working; kvstore certs issue --ca {directory} --principal "
            "NAME adds one, --force replaces the CA"
        )
    names = args.principal or ["client"]
    uris = create_dev_certificates(
        directory, names, hosts=args.host or ("localhost", "127.0.0.1", "::1")
    )
    if args.force:
        (directory / "policy.json").unlink(missing_ok=True)  # the old CA's principals go too
    _add_to_policy(directory / "policy.json", list(uris.values()), roles)
    return {
        "ca": str(directory / "ca.pem"),
        "server": [str(directory / "server.pem"), str(directory / "server.key")],
        "clients": {
            name: [str(directory / f"client-{name}.pem"), str(directory / f"client-{name}.key")]
            for name in uris
        },
        "principals": uris,
        "policy": str(directory / "policy.json"),
    }


def cmd_certs_issue(args: argparse.Namespace) -> Any:
    """One more client certificate from an existing CA (rotation, a new
    client), added to the policy file beside the CA (or --policy)."""
    from .security import issue_certificate

    if args.days < 1:
        raise CliError("--days: at least 1")
    roles = _check_roles(args.role)
    ca = Path(args.ca)
    out = Path(args.out) if args.out else ca
    uri = issue_certificate(ca, args.principal, days=args.days, out=out)
    policy = Path(args.policy) if args.policy else ca / "policy.json"
    _add_to_policy(policy, [uri], roles)
    name = args.principal
    return {
        "principal": uri,
        "roles": list(roles),
        "certificate": [str(out / f"client-{name}.pem"), str(out / f"client-{name}.key")],
        "policy": str(policy),
    }


def cmd_health(args: argparse.Namespace) -> Any:
    """A probe for containers and load balancers (``HEALTHCHECK``)."""
    import ssl
    import urllib.error
    import urllib.request

    if (args.cert is None) != (args.key is None):
        raise CliError("health: --cert and --key go together")
    try:
        context = None
        if args.url.startswith("https:"):
            context = _dev_context(args.certs, args.cafile, args.cert, args.key, args.principal)
            _check_own_certificate(
                args.cert or str(Path(args.certs) / f"client-{args.principal or 'client'}.pem")
            )
        with urllib.request.urlopen(args.url, timeout=args.timeout, context=context) as answer:
            return answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise Unhealthy(f"{args.url}: {exc.code} {exc.read().decode(errors='replace')}") from exc
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", exc)
        from .unreachable import TLS_ALERTS

        text = str(reason).lower()
        if isinstance(reason, ssl.SSLCertVerificationError):
            why = f"the server's certificate failed verification ({reason.verify_message})"
            raise ClientTlsProblem(f"{args.url}: {why}: check --cafile") from exc
        for alert, why in TLS_ALERTS.items():
            if alert in text:
                raise ClientTlsProblem(f"{args.url}: {why}") from exc
        raise Unhealthy(f"{args.url}: {exc}") from exc


def _check_own_certificate(file: str) -> None:
    """A client certificate out of its validity is the probe's problem:
    said as such before any connection (the server would only hang up)."""
    import datetime

    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(Path(file).read_bytes())
    except (OSError, ValueError):
        return  # _dev_context read it; a bad one fails the handshake below
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise ClientTlsProblem(
            f"the client certificate {file} expired on "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: issue a new one "
            "(kvstore certs issue --ca DIR --principal NAME)"
        )
    if cert.not_valid_before_utc > now:
        raise ClientTlsProblem(
            f"the client certificate {file} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (clock?)"
        )
