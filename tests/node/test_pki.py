"""The private PKI: what the files contain, real TLS handshakes on loopback, reuse on a second
call, file modes, and kubeconfigs that the kubernetes client and kubectl accept."""

from __future__ import annotations

import base64
import datetime
import http.server
import ipaddress
import os
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.node.pki import Pki, PkiError, ensure_pki, write_kubeconfig

HANDSHAKE_TIMEOUT = 10.0  # seconds; loopback handshakes take milliseconds
KUBECTL_TIMEOUT = 60.0  # seconds; one kubectl request against a loopback server


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def subject_values(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> list[str]:
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(oid)]


def files_state(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return ensure_pki(tmp_path_factory.mktemp("pki") / "node")


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return ensure_pki(tmp_path_factory.mktemp("pki") / "other")


# --- what the files contain -------------------------------------------------------------------


def test_ca_is_a_self_signed_ten_year_ca(pki: Pki) -> None:
    ca = load_cert(pki.ca_cert)
    ca.verify_directly_issued_by(ca)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert lifetime >= datetime.timedelta(days=3650)


def test_server_cert_chains_to_ca_with_every_host(pki: Pki) -> None:
    ca, server = load_cert(pki.ca_cert), load_cert(pki.server_cert)
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert datetime.timedelta(days=365) <= lifetime < datetime.timedelta(days=366)


def test_admin_cert_names_user_and_group(pki: Pki) -> None:
    admin = load_cert(pki.admin_cert)
    admin.verify_directly_issued_by(load_cert(pki.ca_cert))
    assert subject_values(admin, NameOID.COMMON_NAME) == ["admin"]
    assert subject_values(admin, NameOID.ORGANIZATION_NAME) == ["system:masters"]
    eku = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_keys_belong_to_their_certs(pki: Pki) -> None:
    for crt, key in [
        (pki.ca_cert, pki.ca_key),
        (pki.server_cert, pki.server_key),
        (pki.admin_cert, pki.admin_key),
    ]:
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
        assert private.public_key() == load_cert(crt).public_key()


def test_file_modes(pki: Pki) -> None:
    assert stat.S_IMODE(pki.directory.stat().st_mode) == 0o700
    for key in (pki.ca_key, pki.server_key, pki.admin_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    for crt in (pki.ca_cert, pki.server_cert, pki.admin_cert):
        assert stat.S_IMODE(crt.stat().st_mode) == 0o644
    # Atomic writes leave no temporary files behind.
    assert sorted(p.name for p in pki.directory.iterdir()) == [
        "admin.crt",
        "admin.key",
        "ca.crt",
        "ca.key",
        "server.crt",
        "server.key",
    ]


def test_existing_directory_is_tightened(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    ensure_pki(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_admin_identity_with_several_groups(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path, admin_user="root", admin_groups=("ops", "devs"))
    admin = load_cert(pki.admin_cert)
    assert subject_values(admin, NameOID.COMMON_NAME) == ["root"]
    assert subject_values(admin, NameOID.ORGANIZATION_NAME) == ["ops", "devs"]


# --- reuse and renewal ------------------------------------------------------------------------


def test_second_call_reuses_every_file(tmp_path: Path) -> None:
    first = ensure_pki(tmp_path)
    before = files_state(tmp_path)
    serials = {p: load_cert(p).serial_number for p in (first.ca_cert, first.server_cert)}
    second = ensure_pki(tmp_path)
    assert second == first
    assert files_state(tmp_path) == before
    assert {p: load_cert(p).serial_number for p in serials} == serials


def test_subset_of_hosts_reuses_server_cert(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    before = files_state(tmp_path)
    ensure_pki(tmp_path, hosts=("LOCALHOST", "127.0.0.1"))
    assert files_state(tmp_path) == before
    assert pki.server_cert.read_bytes() == before["server.crt"]


def test_new_host_regenerates_only_the_server_cert(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    before = files_state(tmp_path)
    ensure_pki(tmp_path, hosts=("127.0.0.1", "10.1.2.3", "node1.example"))
    after = files_state(tmp_path)
    changed = {name for name in after if after[name] != before[name]}
    assert changed == {"server.crt", "server.key"}
    san = load_cert(pki.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(san.value.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.1.2.3"),
    }
    assert san.value.get_values_for_type(x509.DNSName) == ["node1.example"]


def test_changed_admin_identity_regenerates_admin_cert(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    before = files_state(tmp_path)
    ensure_pki(tmp_path, admin_user="root")
    after = files_state(tmp_path)
    assert {name for name in after if after[name] != before[name]} == {"admin.crt", "admin.key"}
    assert subject_values(load_cert(pki.admin_cert), NameOID.COMMON_NAME) == ["root"]


def _sign_leaf(pki: Pki, not_after: datetime.datetime) -> tuple[bytes, bytes]:
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "podgate")]))
        .issuer_name(load_cert(pki.ca_cert).subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=400))
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                    x509.DNSName("localhost"),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_expiring_server_cert_is_renewed(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)
    crt, key = _sign_leaf(pki, soon)
    pki.server_cert.write_bytes(crt)
    pki.server_key.write_bytes(key)
    ensure_pki(tmp_path)
    renewed = load_cert(pki.server_cert)
    assert renewed.public_bytes(serialization.Encoding.PEM) != crt
    assert renewed.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(
        days=300
    )


def test_healthy_foreign_looking_server_cert_is_kept(tmp_path: Path) -> None:
    # The same kind of certificate, far from expiry: proves the renewal above is about the date.
    pki = ensure_pki(tmp_path)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=200)
    crt, key = _sign_leaf(pki, later)
    pki.server_cert.write_bytes(crt)
    pki.server_key.write_bytes(key)
    ensure_pki(tmp_path)
    assert pki.server_cert.read_bytes() == crt


def test_leaf_from_another_ca_is_replaced(tmp_path: Path, other_pki: Pki) -> None:
    pki = ensure_pki(tmp_path)
    shutil.copyfile(other_pki.server_cert, pki.server_cert)
    shutil.copyfile(other_pki.server_key, pki.server_key)
    ensure_pki(tmp_path)
    load_cert(pki.server_cert).verify_directly_issued_by(load_cert(pki.ca_cert))


def test_ca_cert_without_key_is_an_error(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    ca_bytes = pki.ca_cert.read_bytes()
    pki.ca_key.unlink()
    with pytest.raises(PkiError, match=r"ca\.key is missing"):
        ensure_pki(tmp_path)
    assert pki.ca_cert.read_bytes() == ca_bytes


def test_ca_key_of_another_ca_is_an_error(tmp_path: Path, other_pki: Pki) -> None:
    pki = ensure_pki(tmp_path)
    shutil.copyfile(other_pki.ca_key, pki.ca_key)
    with pytest.raises(PkiError, match="does not belong to"):
        ensure_pki(tmp_path)


def test_empty_hosts_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        ensure_pki(tmp_path, hosts=())


def test_issue_client_cert(pki: Pki, tmp_path: Path) -> None:
    crt, key = pki.issue_client_cert("system:node:n1", ["system:nodes", "ops"], tmp_path / "u")
    assert crt.name == "system_node_n1.crt"
    assert key.name == "system_node_n1.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "u").stat().st_mode) == 0o700
    cert = load_cert(crt)
    cert.verify_directly_issued_by(load_cert(pki.ca_cert))
    assert subject_values(cert, NameOID.COMMON_NAME) == ["system:node:n1"]
    assert subject_values(cert, NameOID.ORGANIZATION_NAME) == ["system:nodes", "ops"]


@pytest.mark.parametrize(
    ("user", "groups", "error"),
    [("", [], ValueError), ("bob", [""], ValueError), ("bob", "devs", TypeError)],
)
def test_issue_client_cert_rejects_bad_identity(
    pki: Pki, tmp_path: Path, user: str, groups: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        pki.issue_client_cert(user, groups, tmp_path)


# --- real TLS handshakes on loopback ----------------------------------------------------------


@dataclass
class Handshake:
    peercert: dict[str, Any] | None = None
    server_error: BaseException | None = None
    client_error: BaseException | None = None
    alpn: str | None = None
    version: str | None = None
    echoed: bytes = b""


def handshake(
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    *,
    server_hostname: str = "127.0.0.1",
    bind: str = "127.0.0.1",
) -> Handshake:
    """One TLS connection over loopback TCP; the server echoes one message after the handshake,
    so the client also learns about a rejection that TLS 1.3 reports after its own Finished."""
    result = Handshake()
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.create_server((bind, 0), family=family) as listener:
        listener.settimeout(HANDSHAKE_TIMEOUT)
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            conn.settimeout(HANDSHAKE_TIMEOUT)
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    result.peercert = tls.getpeercert()
                    tls.sendall(tls.recv(100))
            except (ssl.SSLError, OSError) as exc:
                result.server_error = exc
            finally:
                conn.close()

        thread = threading.Thread(target=serve, name="tls-server")
        thread.start()
        try:
            with (
                socket.create_connection((bind, port), timeout=HANDSHAKE_TIMEOUT) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
            ):
                result.alpn = tls.selected_alpn_protocol()
                result.version = tls.version()
                tls.sendall(b"ping")
                result.echoed = tls.recv(100)
        except (ssl.SSLError, OSError) as exc:
            result.client_error = exc
        thread.join(HANDSHAKE_TIMEOUT)
        assert not thread.is_alive()
    return result


def test_handshake_with_admin_cert(pki: Pki) -> None:
    client = pki.client_ssl_context(pki.admin_cert, pki.admin_key)
    result = handshake(pki.server_ssl_context(), client)
    assert result.server_error is None and result.client_error is None
    assert result.echoed == b"ping"
    assert result.peercert is not None
    assert result.peercert["subject"] == (
        (("organizationName", "system:masters"),),
        (("commonName", "admin"),),
    )
    assert result.peercert["issuer"] == ((("commonName", "podgate-ca"),),)
    assert result.alpn == "http/1.1"
    assert result.version in {"TLSv1.2", "TLSv1.3"}


def test_handshake_without_client_cert(pki: Pki) -> None:
    result = handshake(pki.server_ssl_context(), pki.client_ssl_context())
    assert result.server_error is None and result.client_error is None
    assert result.echoed == b"ping"
    assert result.peercert is None


def test_cert_from_another_ca_fails_the_handshake(pki: Pki, other_pki: Pki) -> None:
    # CERT_OPTIONAL still verifies a certificate that is presented: OpenSSL aborts the handshake
    # (the server never sees an identity), rather than continuing without one.
    client = pki.client_ssl_context(other_pki.admin_cert, other_pki.admin_key)
    result = handshake(pki.server_ssl_context(), client)
    assert isinstance(result.server_error, ssl.SSLCertVerificationError)
    assert result.peercert is None
    # The client learns of it after its own Finished (TLS 1.3): as the alert or as a bare EOF,
    # depending on timing; either way it never gets an answer.
    assert result.client_error is not None
    assert result.echoed == b""


def test_server_cert_is_not_a_client_identity(pki: Pki) -> None:
    # Signed by our CA but for serverAuth only: refused as a client certificate.
    client = pki.client_ssl_context(pki.server_cert, pki.server_key)
    result = handshake(pki.server_ssl_context(), client)
    assert isinstance(result.server_error, ssl.SSLCertVerificationError)
    assert "purpose" in str(result.server_error)
    assert result.peercert is None


def test_without_client_ca_no_identity_is_read(pki: Pki) -> None:
    client = pki.client_ssl_context(pki.admin_cert, pki.admin_key)
    result = handshake(pki.server_ssl_context(client_ca=False), client)
    assert result.server_error is None and result.client_error is None
    assert result.peercert is None


def test_server_context_settings(pki: Pki) -> None:
    ctx = pki.server_ssl_context()
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_OPTIONAL
    assert pki.server_ssl_context(client_ca=False).verify_mode == ssl.CERT_NONE


def test_alpn_offers_only_http11(pki: Pki) -> None:
    client = ssl.create_default_context(cafile=pki.ca_cert)
    client.set_alpn_protocols(["h2", "http/1.1"])
    assert handshake(pki.server_ssl_context(), client).alpn == "http/1.1"
    h2_only = ssl.create_default_context(cafile=pki.ca_cert)
    h2_only.set_alpn_protocols(["h2"])
    result = handshake(pki.server_ssl_context(), h2_only)
    # No overlap: the connection goes on without ALPN, as kubectl's upgrade connections do.
    assert result.client_error is None
    assert result.alpn is None
    assert result.echoed == b"ping"


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1"])
def test_server_name_is_verified(pki: Pki, name: str) -> None:
    result = handshake(pki.server_ssl_context(), pki.client_ssl_context(), server_hostname=name)
    assert result.client_error is None
    assert result.echoed == b"ping"


def test_ipv6_loopback_is_covered(pki: Pki) -> None:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    result = handshake(
        pki.server_ssl_context(), pki.client_ssl_context(), server_hostname="::1", bind="::1"
    )
    assert result.client_error is None
    assert result.echoed == b"ping"


def test_wrong_server_name_is_refused(pki: Pki) -> None:
    result = handshake(
        pki.server_ssl_context(), pki.client_ssl_context(), server_hostname="example.com"
    )
    assert isinstance(result.client_error, ssl.SSLCertVerificationError)
    assert "example.com" in str(result.client_error)


# --- kubeconfig -------------------------------------------------------------------------------


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_kubeconfig_with_client_cert(pki: Pki, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path,
        "https://127.0.0.1:6443",
        pki.ca_cert,
        user="admin",
        client_cert=pki.admin_cert,
        client_key=pki.admin_key,
        namespace="team-a",
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "podgate",
                "cluster": {
                    "server": "https://127.0.0.1:6443",
                    "certificate-authority-data": _b64(pki.ca_cert),
                },
            }
        ],
        "contexts": [
            {
                "name": "podgate",
                "context": {"cluster": "podgate", "user": "admin", "namespace": "team-a"},
            }
        ],
        "current-context": "podgate",
        "preferences": {},
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": _b64(pki.admin_cert),
                    "client-key-data": _b64(pki.admin_key),
                },
            }
        ],
    }


def test_kubeconfig_with_token(pki: Pki, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path, "https://localhost:6443", pki.ca_cert, user="bob", token="t0k3n", context="dev"
    )
    doc = yaml.safe_load(path.read_text())
    assert doc["users"] == [{"name": "bob", "user": {"token": "t0k3n"}}]
    assert doc["current-context"] == "dev"
    assert doc["contexts"][0]["context"]["cluster"] == "dev"


def test_kubeconfig_without_ca_or_credentials(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    write_kubeconfig(path, "http://127.0.0.1:8001", None, user="dev")
    doc = yaml.safe_load(path.read_text())
    assert doc["clusters"][0]["cluster"] == {"server": "http://127.0.0.1:8001"}
    assert doc["users"] == [{"name": "dev", "user": {}}]


def test_kubeconfig_cert_needs_key(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        write_kubeconfig(
            tmp_path / "k", "https://x", pki.ca_cert, user="a", client_cert=pki.admin_cert
        )
    assert not (tmp_path / "k").exists()


def test_kubeconfig_replaces_atomically(pki: Pki, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_kubeconfig(path, "https://127.0.0.1:6443", pki.ca_cert, user="a", token="x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["kubeconfig"]


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=30))
def test_kubeconfig_strings_round_trip(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("kc") / "kubeconfig"
    write_kubeconfig(path, "https://127.0.0.1:1", None, user=text, token=text, namespace=text)
    raw = path.read_bytes()
    assert raw.isascii()
    doc = yaml.safe_load(raw)
    assert doc["users"] == [{"name": text, "user": {"token": text}}]
    assert doc["contexts"][0]["context"]["namespace"] == text


def test_kubernetes_client_loads_kubeconfig(pki: Pki, tmp_path: Path) -> None:
    from kubernetes import client, config

    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path,
        "https://127.0.0.1:6443",
        pki.ca_cert,
        user="admin",
        client_cert=pki.admin_cert,
        client_key=pki.admin_key,
    )
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=cfg)
    assert cfg.host == "https://127.0.0.1:6443"
    assert cfg.verify_ssl
    assert Path(cfg.ssl_ca_cert).read_bytes() == pki.ca_cert.read_bytes()
    assert Path(cfg.cert_file).read_bytes() == pki.admin_cert.read_bytes()
    assert Path(cfg.key_file).read_bytes() == pki.admin_key.read_bytes()

    write_kubeconfig(path, "https://127.0.0.1:6443", pki.ca_cert, user="bob", token="t0k3n")
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=cfg)
    assert cfg.api_key == {"BearerToken": "Bearer t0k3n"}


# --- real clients against a TLS server using server_ssl_context -------------------------------


@dataclass
class Seen:
    peercert: dict[str, Any] | None
    authorization: str | None
    path: str


class _Handler(http.server.BaseHTTPRequestHandler):
    seen: list[Seen]

    def do_GET(self) -> None:
        assert isinstance(self.connection, ssl.SSLSocket)
        self.seen.append(
            Seen(self.connection.getpeercert(), self.headers.get("Authorization"), self.path)
        )
        body = b'{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def https_server(pki: Pki) -> Iterator[tuple[str, list[Seen]]]:
    seen: list[Seen] = []
    handler = type("Handler", (_Handler,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = pki.server_ssl_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="https-server")
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.e2e
def test_python_client_presents_admin_cert(
    pki: Pki, tmp_path: Path, https_server: tuple[str, list[Seen]]
) -> None:
    from kubernetes import client, config

    url, seen = https_server
    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path, url, pki.ca_cert, user="admin", client_cert=pki.admin_cert, client_key=pki.admin_key
    )
    api = config.new_client_from_config(config_file=str(path))
    try:
        pods = client.CoreV1Api(api).list_namespaced_pod("default")
    finally:
        api.close()
    assert pods.items == []
    assert [s.path for s in seen] == ["/api/v1/namespaces/default/pods"]
    assert seen[0].peercert is not None
    assert ((("commonName", "admin"),)) in seen[0].peercert["subject"]
    assert seen[0].authorization is None


def _kubectl(kubeconfig: Path, home: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "")}
    return subprocess.run(
        [kubectl, "--kubeconfig", str(kubeconfig), "get", "--raw", "/api/v1/namespaces/x/pods"],
        capture_output=True,
        text=True,
        env=env,
        timeout=KUBECTL_TIMEOUT,
        check=False,
    )


@pytest.mark.e2e
def test_kubectl_presents_admin_cert(
    pki: Pki, tmp_path: Path, https_server: tuple[str, list[Seen]]
) -> None:
    url, seen = https_server
    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path, url, pki.ca_cert, user="admin", client_cert=pki.admin_cert, client_key=pki.admin_key
    )
    done = _kubectl(path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"kind":"PodList"' in done.stdout
    # kubectl 1.32 asks for /version first; every request carries the certificate.
    assert seen[-1].path == "/api/v1/namespaces/x/pods"
    for request in seen:
        assert request.peercert is not None
        assert request.peercert["subject"] == (
            (("organizationName", "system:masters"),),
            (("commonName", "admin"),),
        )
        assert request.authorization is None


@pytest.mark.e2e
def test_kubectl_sends_token_over_https(
    pki: Pki, tmp_path: Path, https_server: tuple[str, list[Seen]]
) -> None:
    url, seen = https_server
    path = tmp_path / "kubeconfig"
    write_kubeconfig(path, url, pki.ca_cert, user="bob", token="t0k3n")
    done = _kubectl(path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert seen[-1].path == "/api/v1/namespaces/x/pods"
    for request in seen:
        assert request.peercert is None
        assert request.authorization == "Bearer t0k3n"
