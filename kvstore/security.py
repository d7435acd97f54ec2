"""TLS contexts, peer identity, the authorization policy, and development certificates.

Every KVSP exchange is HTTPS with mutual TLS (H1, SEC1). The authenticated
peer's certificate identity is its **principal**: the first URI
subjectAltName if there is one, else the subject common name. A policy file
maps principals to what they may do::

    {
      "principals": {
        "urn:kvstore:alice":  {"read_scopes": ["<hex16>"], "write_scopes": ["<hex16>"]},
        "urn:kvstore:holder1": {"roles": ["holder"], "holder": "https://h1:8443/kvsp/",
                                "read_scopes": ["*"], "write_scopes": ["*"]},
        "urn:kvstore:pc":     {"roles": ["pc"], "read_scopes": ["*"]}
      }
    }

An unknown principal has no rights at all. ``"*"`` means every scope.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol.problems import Forbidden, ScopeDenied, Unauthenticated

#: "reporter": may withdraw, at the IS, replicas of scopes it can read that
#: failed their digest (BL8).
#: "metrics": may scrape /metrics (store-wide figures are not for tenants).
ROLES = frozenset({"client", "holder", "pc", "instance", "index", "admin", "reporter", "metrics"})


# --- TLS contexts ----------------------------------------------------------


def server_context(
    certfile: str, keyfile: str, cafile: str, *, require_client: bool = True
) -> ssl.SSLContext:
    """A server context: TLS 1.3 only (H1), client certificates from ``cafile``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(certfile, keyfile)
    context.load_verify_locations(cafile)
    context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_OPTIONAL
    return context


def client_context(
    cafile: str, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext:
    """A client context: TLS 1.3, the server verified against ``cafile``, our certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if certfile is not None:
        context.load_cert_chain(certfile, keyfile)
    return context


def principal_of(peercert: Mapping[str, Any] | None) -> str | None:
    """The principal of a peer certificate as ``ssl.SSLSocket.getpeercert()`` returns it."""
    if not peercert:
        return None
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI":
            return str(value)
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


# --- policy ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grant:
    roles: frozenset[str] = frozenset({"client"})
    read_scopes: frozenset[str] = frozenset()
    write_scopes: frozenset[str] = frozenset()
    #: For holders: the base URI they publish and serve as.
    holder: str | None = None
    #: For inference instances: the base URI they report status as.
    instance: str | None = None

    def can_read(self, scope_id: str) -> bool:
        return "*" in self.read_scopes or scope_id in self.read_scopes

    def can_write(self, scope_id: str) -> bool:
        return "*" in self.write_scopes or scope_id in self.write_scopes


@dataclass(frozen=True, slots=True)
class Policy:
    """Principals and their grants (SEC1, SEC2)."""

    principals: Mapping[str, Grant] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> Policy:
        if not isinstance(data, Mapping) or not isinstance(data.get("principals"), Mapping):
            raise ValueError('policy: expected {"principals": {...}}')
        grants = {}
        for name, raw in data["principals"].items():
            where = f"policy.principals[{name!r}]"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{where}: must be an object")
            roles = frozenset(raw.get("roles", ["client"]))
            unknown = roles - ROLES
            if unknown:
                raise ValueError(f"{where}.roles: unknown {sorted(unknown)}; known {sorted(ROLES)}")
            for member in ("read_scopes", "write_scopes"):
                value = raw.get(member, [])
                if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                    raise ValueError(f"{where}.{member}: must be an array of scope ids or '*'")
            holder = raw.get("holder")
            if holder is not None and not isinstance(holder, str):
                raise ValueError(f"{where}.holder: must be a base URI")
            instance = raw.get("instance")
            if instance is not None and not isinstance(instance, str):
                raise ValueError(f"{where}.instance: must be a base URI")
            grants[str(name)] = Grant(
                roles=roles,
                read_scopes=frozenset(raw.get("read_scopes", [])),
                write_scopes=frozenset(raw.get("write_scopes", [])),
                holder=holder,
                instance=instance,
            )
        return cls(grants)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        return cls.from_json(json.loads(Path(path).read_text()))

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
    key is written next to the certificates.
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

    def issue(common_name: str, sans: list[Any], usage: Any) -> tuple[Any, Any]:
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
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return key, cert

    server_sans: list[Any] = []
    for host in hosts:
        try:
            server_sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            server_sans.append(x509.DNSName(host))
    _write_key_and_cert(
        out, "server", *issue("kvstore server", server_sans, ExtendedKeyUsageOID.SERVER_AUTH)
    )

    uris = {}
    for name in principals:
        uri = f"urn:kvstore:{name}"
        key, cert = issue(
            name, [x509.UniformResourceIdentifier(uri)], ExtendedKeyUsageOID.CLIENT_AUTH
        )
        _write_key_and_cert(out, f"client-{name}", key, cert)
        uris[name] = uri
    return uris
