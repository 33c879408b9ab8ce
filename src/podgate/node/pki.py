"""A small private PKI for the node gateway: one CA, a server certificate, client certificates,
and kubeconfig files that carry them.

kubectl sends its bearer token only over HTTPS, so even token-only setups need this CA.
Files are created once and reused: a second `ensure_pki` call loads what is on disk and only
replaces what is missing, expired, or no longer fits the request.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
import re
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from podgate.files import atomic_write

CA_VALIDITY_DAYS = 3650  # days; the CA is baked into every kubeconfig, so it should outlive them
LEAF_VALIDITY_DAYS = 365  # days; server and client certificates, renewed by `ensure_pki`
RENEW_BEFORE_DAYS = 30  # days; renew a leaf this long before it expires, not after it broke
CLOCK_SKEW = datetime.timedelta(minutes=5)  # backdate notBefore so slightly slow clocks accept it
KEY_FILE_MODE = 0o600  # private keys: owner only
CERT_FILE_MODE = 0o644  # certificates are public
DIR_MODE = 0o700  # the directory holds the CA key

DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")
ALPN_PROTOCOLS = ["http/1.1"]  # kubectl negotiates http/1.1, and no ALPN on upgrades (§9)

_CA_NAME = "podgate-ca"
_SERVER_NAME = "podgate"
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")

_Host: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address | str


class PkiError(Exception):
    """The PKI directory is in a state we must not repair silently."""


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of the PKI files; see `ensure_pki`."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path

    def server_ssl_context(self, client_ca: bool = True) -> ssl.SSLContext:
        """A TLS server context; with `client_ca`, client certificates signed by our CA are
        verified when presented (and a connection without one is still accepted)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.server_cert, self.server_key)
        ctx.set_alpn_protocols(ALPN_PROTOCOLS)
        if client_ca:
            ctx.load_verify_locations(cafile=self.ca_cert)
            # Optional so bearer-token clients can still connect; a presented certificate that
            # does not verify fails the handshake.
            ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def client_ssl_context(
        self, cert: Path | str | None = None, key: Path | str | None = None
    ) -> ssl.SSLContext:
        """A TLS client context trusting our CA, optionally presenting a client certificate."""
        ctx = ssl.create_default_context(cafile=self.ca_cert)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(ALPN_PROTOCOLS)
        if cert is not None:
            ctx.load_cert_chain(cert, key)
        return ctx

    def issue_client_cert(
        self,
        user: str,
        groups: Sequence[str],
        directory: Path | str,
        *,
        days: int = LEAF_VALIDITY_DAYS,
    ) -> tuple[Path, Path]:
        """Sign a client certificate (CN=user, one O per group) and write `<user>.crt/.key`
        into `directory`. Returns (certificate path, key path)."""
        ca_cert, ca_key = _load_ca(self.ca_cert, self.ca_key)
        out = Path(directory)
        _make_dir(out)
        stem = _UNSAFE_FILE_CHARS.sub("_", user) or "user"
        crt_path, key_path = out / f"{stem}.crt", out / f"{stem}.key"
        cert, key = _issue_client(ca_cert, ca_key, user, groups, days)
        _write_key(key_path, key)
        _write_cert(crt_path, cert)
        return crt_path, key_path


@dataclass(frozen=True, slots=True)
class OperatorTls:
    """TLS material an operator brings instead of the generated PKI."""

    cert: Path  # server certificate (chain), PEM
    key: Path
    client_ca: Path | None = None  # CA bundle that client certificates must chain to

    def server_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.set_alpn_protocols(ALPN_PROTOCOLS)
        if self.client_ca is not None:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def server_names(self) -> list[str]:
        """The DNS names and IP addresses the server certificate is valid for."""
        return certificate_names(self.cert)

    def issuer_bundle(self) -> Path | None:
        """A CA file that verifies the server certificate (for kubeconfigs), if we have one:
        the client CA when it issued the server certificate."""
        if self.client_ca is None:
            return None
        leaf = x509.load_pem_x509_certificate(self.cert.read_bytes())
        for ca in x509.load_pem_x509_certificates(self.client_ca.read_bytes()):
            try:
                leaf.verify_directly_issued_by(ca)
            except (ValueError, TypeError, InvalidSignature):
                continue
            return self.client_ca
        return None


def certificate_names(cert_path: Path | str) -> list[str]:
    """The subjectAltName entries (DNS and IP) of the first certificate in a PEM file."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName)] + [
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    ]


def ensure_pki(
    directory: Path | str,
    *,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    admin_user: str = "admin",
    admin_groups: Sequence[str] = ("system:masters",),
) -> Pki:
    """Create the CA, server and admin certificates in `directory`, or reuse the ones there.

    The server certificate is replaced when it does not cover every host in `hosts`; leaves are
    replaced when expiring, when not signed by the CA on disk, or (admin) when the identity
    differs. A CA certificate without its key is an error, never a silent new CA.
    """
    root = Path(directory)
    _make_dir(root)
    pki = Pki(
        directory=root,
        ca_cert=root / "ca.crt",
        ca_key=root / "ca.key",
        server_cert=root / "server.crt",
        server_key=root / "server.key",
        admin_cert=root / "admin.crt",
        admin_key=root / "admin.key",
    )
    wanted_hosts = [_parse_host(h) for h in hosts]
    if not wanted_hosts:
        raise ValueError("hosts must name at least one IP address or DNS name")
    now = _now()

    if pki.ca_cert.exists():
        ca_cert, ca_key = _load_ca(pki.ca_cert, pki.ca_key)
    else:
        ca_cert, ca_key = _issue_ca(now)
        _write_key(pki.ca_key, ca_key)
        # The certificate goes last: once it exists, its key does too.
        _write_cert(pki.ca_cert, ca_cert)

    server = _load_leaf(pki.server_cert, pki.server_key, ca_cert, now)
    if server is None or not _covers(server, wanted_hosts):
        cert, key = _issue_server(ca_cert, ca_key, wanted_hosts, now)
        _write_key(pki.server_key, key)
        _write_cert(pki.server_cert, cert)

    admin = _load_leaf(pki.admin_cert, pki.admin_key, ca_cert, now)
    if admin is None or _identity(admin) != (admin_user, tuple(admin_groups)):
        cert, key = _issue_client(ca_cert, ca_key, admin_user, admin_groups, LEAF_VALIDITY_DAYS)
        _write_key(pki.admin_key, key)
        _write_cert(pki.admin_cert, cert)
    return pki


def write_kubeconfig(
    path: Path | str,
    server_url: str,
    ca_path: Path | str | None,
    *,
    user: str,
    client_cert: Path | str | None = None,
    client_key: Path | str | None = None,
    token: str | None = None,
    namespace: str = "default",
    context: str = "podgate",
) -> None:
    """Write a one-cluster, one-user kubeconfig with the CA and credentials embedded."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together")
    cluster = [f"    server: {_yaml_str(server_url)}"]
    if ca_path is not None:
        cluster.append(f"    certificate-authority-data: {_b64_file(ca_path)}")
    creds: list[str] = []
    if client_cert is not None and client_key is not None:
        creds.append(f"    client-certificate-data: {_b64_file(client_cert)}")
        creds.append(f"    client-key-data: {_b64_file(client_key)}")
    if token is not None:
        creds.append(f"    token: {_yaml_str(token)}")
    lines = [
        "apiVersion: v1",
        "kind: Config",
        "clusters:",
        f"- name: {_yaml_str(context)}",
        "  cluster:",
        *cluster,
        "contexts:",
        f"- name: {_yaml_str(context)}",
        "  context:",
        f"    cluster: {_yaml_str(context)}",
        f"    user: {_yaml_str(user)}",
        f"    namespace: {_yaml_str(namespace)}",
        f"current-context: {_yaml_str(context)}",
        "preferences: {}",
        "users:",
        f"- name: {_yaml_str(user)}",
        "  user:" if creds else "  user: {}",
        *creds,
    ]
    _atomic_write(Path(path), ("\n".join(lines) + "\n").encode("ascii"), KEY_FILE_MODE)


# --- issuing ----------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: small, fast, and accepted by Go's crypto/tls and OpenSSL alike.
    return ec.generate_private_key(ec.SECP256R1())


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    days: int,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _leaf_builder(
    subject: x509.Name,
    ca_cert: x509.Certificate,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    days: int,
    usage: x509.ObjectIdentifier,
) -> x509.CertificateBuilder:
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        _builder(subject, ca_cert.subject, public_key, now, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
    )


def _key_usage(*, digital_signature: bool = False, ca: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _issue_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)])
    cert = (
        _builder(name, name, key.public_key(), now, CA_VALIDITY_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=True, ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue_server(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: Sequence[_Host],
    now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    names: list[x509.GeneralName] = [
        x509.DNSName(h) if isinstance(h, str) else x509.IPAddress(h) for h in hosts
    ]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _SERVER_NAME)])
    cert = (
        _leaf_builder(
            subject,
            ca_cert,
            key.public_key(),
            now,
            LEAF_VALIDITY_DAYS,
            ExtendedKeyUsageOID.SERVER_AUTH,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _issue_client(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    user: str,
    groups: Sequence[str],
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not user:
        raise ValueError("a client certificate needs a user name")
    if isinstance(groups, str):
        raise TypeError("groups must be a sequence of names, not a string")
    if any(not g for g in groups):
        raise ValueError("group names must not be empty")
    key = _new_key()
    # kube-apiserver's x509 authenticator: CN is the user, each O a group.
    subject = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        + [x509.NameAttribute(NameOID.COMMON_NAME, user)]
    )
    cert = _leaf_builder(
        subject, ca_cert, key.public_key(), _now(), days, ExtendedKeyUsageOID.CLIENT_AUTH
    ).sign(ca_key, hashes.SHA256())
    return cert, key


# --- loading and checking ---------------------------------------------------------------------


def _load_ca(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not key_path.exists():
        raise PkiError(f"{cert_path} exists but its key {key_path} is missing")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{key_path}: expected an EC private key")
    if key.public_key() != cert.public_key():
        raise PkiError(f"{key_path} does not belong to {cert_path}")
    return cert, key


def _load_leaf(
    cert_path: Path, key_path: Path, ca_cert: x509.Certificate, now: datetime.datetime
) -> x509.Certificate | None:
    """The certificate at `cert_path` if it is still good to use, else None."""
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return None
    if key.public_key() != cert.public_key():
        return None
    if cert.not_valid_after_utc - now < datetime.timedelta(days=RENEW_BEFORE_DAYS):
        return None
    return cert


def _parse_host(host: str) -> _Host:
    if not host:
        raise ValueError("empty host name")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return host.lower()


def _covers(cert: x509.Certificate, hosts: Sequence[_Host]) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    ips = set(san.get_values_for_type(x509.IPAddress))
    dns = {d.lower() for d in san.get_values_for_type(x509.DNSName)}
    return all((h in dns) if isinstance(h, str) else (h in ips) for h in hosts)


def _identity(cert: x509.Certificate) -> tuple[str, tuple[str, ...]]:
    def values(oid: x509.ObjectIdentifier) -> list[str]:
        return [str(a.value) for a in cert.subject.get_attributes_for_oid(oid)]

    cns = values(NameOID.COMMON_NAME)
    return (cns[0] if len(cns) == 1 else "", tuple(values(NameOID.ORGANIZATION_NAME)))


# --- files ------------------------------------------------------------------------------------


def _make_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _atomic_write(path, pem, KEY_FILE_MODE)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _atomic_write(path, cert.public_bytes(serialization.Encoding.PEM), CERT_FILE_MODE)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    atomic_write(path, data, mode=mode)


def _b64_file(path: Path | str) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _yaml_str(value: str) -> str:
    """A YAML double-quoted scalar in pure ASCII (every YAML 1.1/1.2 parser reads it)."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)
