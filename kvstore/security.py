"""TLS contexts, peer identity, the authorization policy, and development certificates.

Every KVSP exchange is HTTPS with mutual TLS (H1, SEC1). The authenticated
peer's certificate identity is its **principal**: the first URI
subjectAltName if there is one, else the subject common name. A policy file
maps principals to what they may do::

    {
      "principals": {
        "urn:kvstore:alice":  {"read_scopes": ["<scope id>"], "write_scopes": ["<scope id>"]},
        "urn:kvstore:holder1": {"roles": ["holder"], "holder": "https://h1:8443/kvsp/",
                                "write_scopes": ["*"]},
        "urn:kvstore:pc":     {"roles": ["pc"], "read_scopes": ["*"]}
      }
    }

An unknown principal has no rights at all. ``"*"`` means every scope; a
scope id is 32 lowercase hex digits. docs/security.md ("The policy file")
describes every member, the roles and what each needs, with an example.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from .protocol.problems import Forbidden, ScopeDenied, Unauthenticated

#: "reporter": may withdraw, at the IS, replicas of scopes it can read that
#: failed their digest (BL8).
#: "metrics": may scrape /metrics (store-wide figures are not for tenants).
ROLES = frozenset({"client", "holder", "pc", "instance", "index", "admin", "reporter", "metrics"})


# --- policy ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grant:
    roles: frozenset[str] = frozenset({"client"})
    read_scopes: frozenset[str] = frozenset()
    write_scopes: frozenset[str] = frozenset()
    #: For holders: the base URI they publish and serve as (the first of ``holders``).
    holder: str | None = None
    #: For inference instances: the base URI they report status as.
    instance: str | None = None
    #: For holders: every base URI they publish as: the policy's ``holder``
    #: member may be an array, one URI per worker (docs/workers.md).
    holders: tuple[str, ...] = ()

    def acts_as_holder(self, uri_matches: Callable[[str], bool]) -> bool:
        """Whether one of this grant's holder URIs is the one asked about."""
        return any(uri_matches(u) for u in (self.holders or (self.holder,)) if u is not None)

    def can_read(self, scope_id: str) -> bool:
        return "*" in self.read_scopes or scope_id in self.read_scopes

    def can_write(self, scope_id: str) -> bool:
        return "*" in self.write_scopes or scope_id in self.write_scopes


#: The members of a principal's entry (docs/security.md).
GRANT_MEMBERS = ("roles", "read_scopes", "write_scopes", "holder", "instance")
_SCOPE_ID = re.compile(r"[0-9a-f]{32}")


class PolicyError(ValueError):
    """An invalid policy document: every problem found, in ``problems``, each
    the source (a file name, or ``policy``), the JSON path of the member and
    the reason, e.g. ``policy.json: principals["urn:x"].read_scopes[1]: ...``.
    Its message is all of them on one line, the source said once."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        #: (JSON path, reason) pairs; the path is "" for the document itself.
        self.members = tuple(problems)
        self.source = source
        self.problems = tuple(f"{source}: {_where(path, reason)}" for path, reason in problems)
        super().__init__(f"{source}: " + "; ".join(_where(p, r) for p, r in problems))


def _where(path: str, reason: str) -> str:
    return f"{path}: {reason}" if path else reason


class _Members(dict[str, Any]):
    """A JSON object as :meth:`Policy.load` reads it, with its repeated names."""

    duplicates: tuple[str, ...] = ()


def _members(pairs: list[tuple[str, Any]]) -> _Members:
    out = _Members(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated: dict[str, None] = {}
        for name, _ in pairs:
            if name in seen:
                repeated[name] = None
            seen.add(name)
        out.duplicates = tuple(repeated)
    return out


def _key(path: str, name: str) -> str:
    return f"{path}[{json.dumps(name)}]"


def _member(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_uri(value: Any, path: str, problems: list[tuple[str, str]]) -> str | None:
    if value is None:
        return None
    try:
        parts = urlsplit(value) if isinstance(value, str) else None
    except ValueError:  # e.g. an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("https", "http") or not parts.netloc:
        problems.append((path, "must be an absolute https (or http) base URI"))
        return None
    return str(value)


def _strings(
    raw: Mapping[str, Any],
    name: str,
    path: str,
    problems: list[tuple[str, str]],
    what: str,
    check: Callable[[str], str | None],
) -> frozenset[str]:
    """The items of an array member of strings; a problem for each wrong one
    (``check`` says what is wrong with a string, or None)."""
    value = raw.get(name, [])
    if not isinstance(value, list):
        problems.append((_member(path, name), f"must be an array of {what}"))
        return frozenset()
    out = set()
    for index, item in enumerate(value):
        where = f"{_member(path, name)}[{index}]"
        reason = check(item) if isinstance(item, str) else f"must be a string ({what})"
        if reason is None:
            out.add(item)
        else:
            problems.append((where, reason))
    return frozenset(out)


def _role(name: str) -> str | None:
    return None if name in ROLES else f"unknown role {name!r}; known: {', '.join(sorted(ROLES))}"


def _scope(name: str) -> str | None:
    if name == "*" or _SCOPE_ID.fullmatch(name):
        return None
    return 'must be a hex16 scope id (32 lowercase hex digits) or "*"'


def _grant(raw: Any, path: str, problems: list[tuple[str, str]]) -> Grant | None:
    if not isinstance(raw, Mapping):
        problems.append((path, "must be an object"))
        return None
    before = len(problems)
    for name in getattr(raw, "duplicates", ()):
        problems.append((_member(path, name), "given more than once"))
    for name in raw:
        if name not in GRANT_MEMBERS:
            problems.append(
                (_member(path, name), f"unknown member; known: {', '.join(GRANT_MEMBERS)}")
            )
    roles = _strings(raw, "roles", path, problems, "role names", _role)
    scopes = {
        name: _strings(raw, name, path, problems, 'scope ids or "*"', _scope)
        for name in ("read_scopes", "write_scopes")
    }
    uris = {"instance": _check_uri(raw.get("instance"), _member(path, "instance"), problems)}
    holders: list[str] = []
    raw_holder = raw.get("holder")
    for i, value in enumerate(raw_holder if isinstance(raw_holder, list) else [raw_holder]):
        where = _member(path, "holder") + (f"[{i}]" if isinstance(raw_holder, list) else "")
        uri = _check_uri(value, where, problems)
        if uri is not None:
            holders.append(uri)
    if isinstance(raw_holder, list) and not raw_holder:
        problems.append((_member(path, "holder"), "an empty array names no holder"))
    uris["holder"] = holders[0] if holders else None
    if len(problems) != before:
        return None
    return Grant(
        roles=roles if "roles" in raw else frozenset({"client"}),
        read_scopes=scopes["read_scopes"],
        write_scopes=scopes["write_scopes"],
        holder=uris["holder"],
        instance=uris["instance"],
        holders=tuple(holders),
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """Principals and their grants (SEC1, SEC2); the format is docs/security.md's."""

    principals: Mapping[str, Grant] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, source: str = "policy") -> Policy:
        """The policy of a parsed document; :class:`PolicyError` naming every
        invalid member by its JSON path, after ``source``."""
        problems: list[tuple[str, str]] = []
        grants: dict[str, Grant] = {}
        if not isinstance(data, Mapping):
            problems.append(("", 'must be a JSON object {"principals": {...}}'))
        else:
            for name in getattr(data, "duplicates", ()):
                problems.append((name, "given more than once"))
            for name in data:
                if name != "principals":
                    problems.append((name, "unknown member; known: principals"))
            principals = data.get("principals")
            if principals is None:
                problems.append(("principals", "required member is missing"))
            elif not isinstance(principals, Mapping):
                problems.append(("principals", "must be an object of principal names"))
            else:
                for name in getattr(principals, "duplicates", ()):
                    problems.append((_key("principals", name), "given more than once"))
                for name, raw in principals.items():
                    where = _key("principals", name)
                    named = isinstance(name, str) and bool(name)
                    if not named:
                        problems.append((where, "a principal name must be a non-empty string"))
                    grant = _grant(raw, where, problems)
                    if grant is not None and named:
                        grants[name] = grant
        if problems:
            raise PolicyError(source, problems)
        return cls(grants)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """The policy file at ``path``: :class:`OSError` when it cannot be
        read, :class:`PolicyError` (a ValueError) when it is not a valid policy."""
        text = Path(path).read_text()
        try:
            data = json.loads(text, object_pairs_hook=_members)
        except json.JSONDecodeError as exc:
            raise PolicyError(str(path), [("", f"not JSON: {exc}")]) from exc
        return cls.from_json(data, source=str(path))

    def take(self, other: Policy) -> None:
        """Hold ``other``'s grants from now on (a reload of the policy file:
        every role given this object sees the new one at its next request)."""
        principals = cast(dict[str, Grant], self.principals)
        principals.clear()
        principals.update(other.principals)

    def grant(self, principal: str | None) -> Grant:
        """The principal's grant; :class:`Forbidden` for an unknown one."""
        if principal is None:
            raise Unauthenticated("a client certificate is required")
        grant = self.principals.get(principal)
        if grant is None:
            raise Forbidden("the client certificate's principal is not in the policy")
        return grant

    def require_role(self, principal: str | None, role: str) -> Grant:
        grant = self.grant(principal)
        if role not in grant.roles:
            raise Forbidden(f"principal lacks the {role!r} role")
        return grant

    def require_any_role(self, principal: str | None, roles: tuple[str, ...]) -> Grant:
        grant = self.grant(principal)
        if not grant.roles.intersection(roles):
            raise Forbidden(f"principal lacks one of the roles {list(roles)}")
        return grant

    def require_read(self, principal: str | None, scope_id: str) -> Grant:
        grant = self.grant(principal)
        if not grant.can_read(scope_id):
            # No hint whether the block exists (the draft's cross-tenant concern).
            raise ScopeDenied("not authorized for the scope")
        return grant

    def require_write(self, principal: str | None, scope_id: str) -> Grant:
        grant = self.grant(principal)
        if not grant.can_write(scope_id):
            raise ScopeDenied("not authorized for the scope")
        return grant


# --- development certificates ------------------------------------------------


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key_and_cert(directory: Path, stem: str, key: Any, cert: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    key_path = directory / f"{stem}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    ca_key: Any,
    ca_cert: Any,
    common_name: str,
    sans: list[Any],
    usage: Any,
    start: datetime.datetime,
    end: datetime.datetime,
) -> tuple[Any, Any]:
    """A key and a certificate for ``sans`` signed by the CA, valid start..end."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Which CA key signed it (RFC 5280 4.2.1.1): while a rotation trusts
        # an old and a new CA of the same name, the verifier picks the right one.
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def create_dev_certificates(
    directory: str | Path,
    principals: Iterable[str] = ("client",),
    *,
    hosts: Iterable[str] = ("localhost", "127.0.0.1", "::1"),
    days: int = 365,
) -> dict[str, str]:
    """A development CA, a server certificate for ``hosts`` and one client
    certificate per principal name (SAN URI ``urn:kvstore:<name>``).

    Returns the principal URI of each client name. For local use only: the CA
    key is written next to the certificates. An existing CA in ``directory``
    is replaced (``kvstore certs init`` refuses that without ``--force``).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvstore development CA"))
        .issuer_name(_name("kvstore development CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key_and_cert(out, "ca", ca_key, ca_cert)

    server_sans: list[Any] = []
    for host in hosts:
        try:
            server_sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            server_sans.append(x509.DNSName(host))
    server = _issue(
        ca_key, ca_cert, "kvstore server", server_sans, ExtendedKeyUsageOID.SERVER_AUTH, start, end
    )
    _write_key_and_cert(out, "server", *server)
    return {name: issue_certificate(out, name, days=days) for name in principals}


def issue_certificate(
    ca_directory: str | Path,
    principal: str,
    *,
    days: int = 365,
    out: str | Path | None = None,
    not_before: datetime.datetime | None = None,
) -> str:
    """One more client certificate from the CA of ``ca_directory`` (its
    ca.pem and ca.key): ``client-<principal>.pem`` and ``.key`` in ``out``
    (default: that directory), SAN URI ``urn:kvstore:<principal>``, valid
    from ``not_before`` (default: now, less 5 minutes) for ``days``.
    Returns the principal URI. A running server trusts it at once (same CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", principal):
        raise ValueError(f"principal {principal!r}: letters, digits and '._-', at most 64")
    ca = Path(ca_directory)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    except OSError as exc:
        raise ValueError(
            f"{exc.filename}: {exc.strerror} (a CA made by kvstore certs init)"
        ) from None
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    uri = f"urn:kvstore:{principal}"
    key, cert = _issue(
        ca_key,
        ca_cert,
        principal,
        [x509.UniformResourceIdentifier(uri)],
        ExtendedKeyUsageOID.CLIENT_AUTH,
        start,
        start + datetime.timedelta(days=days),
    )
    target = Path(out) if out is not None else ca
    target.mkdir(parents=True, exist_ok=True)
    _write_key_and_cert(target, f"client-{principal}", key, cert)
    return uri
