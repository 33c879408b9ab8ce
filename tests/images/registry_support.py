"""Real registries on loopback for the image tests, and what the tests push into them.

- `Registry`: Debian's `docker-registry` (distribution 2.8) on 127.0.0.1 with an ephemeral
  port and its own storage directory: plain HTTP and anonymous; or TLS (a test CA) with
  htpasswd basic auth; or token auth against `TokenServer`.
- `TokenServer`: the Docker token protocol for tests. It checks Basic credentials and signs
  RS256 JWTs whose `x5c` certificate chains to the registry's `rootcertbundle`.
- `ImageBuilder`: OCI / Docker schema 2 images and indexes, built in memory from busybox-static
  plus generated files (the tests make everything they pull).
- `push_image`: a small push client (monolithic blob upload, manifest PUT) over HTTP(S).
- `ThrottlingProxy`: a loopback TCP proxy that slows the registry's answers, so a test can kill
  a pull in the middle of a blob.

Nothing here resolves a name or opens a socket outside 127.0.0.1.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

REGISTRY_BIN = "/usr/bin/docker-registry"
BUSYBOX = Path("/bin/busybox")
LOOPBACK = "127.0.0.1"
# Registry start on a loaded machine, seconds.
READY_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.05
# Every test HTTP call's timeout, seconds.
HTTP_TIMEOUT_SECONDS = 60.0
# Lifetime of a test token (the registry checks exp/nbf), seconds.
TOKEN_LIFETIME_SECONDS = 300
TOKEN_SERVICE = "podgate-test-registry"
TOKEN_ISSUER = "podgate-test-issuer"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def require_registry() -> None:
    if not os.access(REGISTRY_BIN, os.X_OK):
        pytest.skip("docker-registry is not installed (Debian package docker-registry)")
    if not BUSYBOX.is_file():
        pytest.skip("busybox-static is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- certificates


@dataclass
class LoopbackCA:
    """A CA, a server certificate for 127.0.0.1, and a token-signing certificate."""

    dir: Path
    ca_file: Path
    server_cert: Path
    server_key: Path
    signing_key: rsa.RSAPrivateKey
    signing_cert_der: bytes

    @classmethod
    def create(cls, directory: Path) -> LoopbackCA:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "podgate test CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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

        def leaf(
            cn: str, san: list[x509.GeneralName]
        ) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            builder = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                .issuer_name(ca_name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
            )
            if san:
                builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
            return key, builder.sign(ca_key, hashes.SHA256())

        import ipaddress

        server_key, server_cert = leaf(
            "127.0.0.1", [x509.IPAddress(ipaddress.ip_address(LOOPBACK))]
        )
        signing_key, signing_cert = leaf("podgate test token signer", [])
        pem = serialization.Encoding.PEM
        ca_file = directory / "ca.pem"
        ca_file.write_bytes(ca_cert.public_bytes(pem))
        (directory / "server.pem").write_bytes(server_cert.public_bytes(pem))
        (directory / "server.key").write_bytes(
            server_key.private_bytes(
                pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )
        return cls(
            directory,
            ca_file,
            directory / "server.pem",
            directory / "server.key",
            signing_key,
            signing_cert.public_bytes(serialization.Encoding.DER),
        )


# --------------------------------------------------------------------------- token server


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    """GET /token?service=&scope=… with Basic auth → {"token": JWT, "expires_in": …}."""

    ca: LoopbackCA
    users: dict[str, str]
    server: ThreadingHTTPServer | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    anonymous_pull: bool = False
    # OAuth refresh tokens (CRI identity_token) → the user they stand for.
    refresh_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def realm(self) -> str:
        assert self.server is not None
        return f"http://{LOOPBACK}:{self.server.server_address[1]}/token"

    def sign(self, subject: str, access: list[dict[str, Any]]) -> str:
        header = {
            "alg": "RS256",
            "typ": "JWT",
            "x5c": [base64.b64encode(self.ca.signing_cert_der).decode()],
        }
        now = int(time.time())
        claims = {
            "iss": TOKEN_ISSUER,
            "sub": subject,
            "aud": TOKEN_SERVICE,
            "exp": now + TOKEN_LIFETIME_SECONDS,
            "nbf": now - 60,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        signature = self.ca.signing_key.sign(
            signing_input.encode(), padding.PKCS1v15(), hashes.SHA256()
        )
        return f"{signing_input}.{_b64url(signature)}"

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                user = ""
                header = self.headers.get("Authorization", "")
                if header.startswith("Basic "):
                    name, _, password = base64.b64decode(header[6:]).decode().partition(":")
                    if outer.users.get(name) != password:
                        outer.requests.append({"user": name, "ok": False})
                        self._answer(401, {"details": "bad credentials"})
                        return
                    user = name
                if not user and not outer.anonymous_pull:
                    outer.requests.append({"user": "", "ok": False})
                    self._answer(401, {"details": "authentication required"})
                    return
                access = []
                for scope in query.get("scope", []):
                    for one in scope.split():
                        kind, _, rest = one.partition(":")
                        name, _, actions = rest.rpartition(":")
                        allowed = actions.split(",") if user else ["pull"]
                        access.append({"type": kind, "name": name, "actions": allowed})
                outer.requests.append({"user": user, "ok": True, "scope": query.get("scope", [])})
                self._answer(
                    200, {"token": outer.sign(user, access), "expires_in": TOKEN_LIFETIME_SECONDS}
                )

            def do_POST(self) -> None:
                # OAuth2 (the Docker token spec's POST form): refresh tokens the server issued.
                length = int(self.headers.get("Content-Length", "0"))
                form = parse_qs(self.rfile.read(length).decode())
                refresh = form.get("refresh_token", [""])[0]
                user = outer.refresh_tokens.get(refresh)
                if form.get("grant_type") != ["refresh_token"] or user is None:
                    outer.requests.append({"user": "", "ok": False, "post": True})
                    self._answer(401, {"details": "bad refresh token"})
                    return
                access = []
                for one in form.get("scope", [""])[0].split():
                    kind, _, rest = one.partition(":")
                    name, _, actions = rest.rpartition(":")
                    access.append({"type": kind, "name": name, "actions": actions.split(",")})
                outer.requests.append({"user": user, "ok": True, "post": True})
                self._answer(
                    200,
                    {
                        "access_token": outer.sign(user, access),
                        "expires_in": TOKEN_LIFETIME_SECONDS,
                    },
                )

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


# --------------------------------------------------------------------------- the registry


@dataclass
class Registry:
    """One docker-registry process."""

    root: Path
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    tls: LoopbackCA | None = None
    users: dict[str, str] = field(default_factory=dict)
    token_server: TokenServer | None = None

    @property
    def host(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    def blob_data_path(self, digest: str) -> Path:
        hexpart = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexpart[:2] / hexpart / "data"

    def requests(self) -> list[tuple[str, str]]:
        """(method, uri) of every request the registry has answered, from its JSON log."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == "response completed" or "http.response.status" in entry:
                method = entry.get("http.request.method")
                uri = entry.get("http.request.uri")
                if method and uri and entry.get("msg") == "response completed":
                    out.append((method, uri))
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def running_registry(
    root: Path,
    *,
    tls: LoopbackCA | None = None,
    users: dict[str, str] | None = None,
    token: TokenServer | None = None,
) -> Iterator[Registry]:
    """Start docker-registry on 127.0.0.1:<free port>; stop it and its files at the end."""
    require_registry()
    root.mkdir(parents=True, exist_ok=True)
    (root / "storage").mkdir(exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(root / "storage")},
            "delete": {"enabled": True},
        },
        "http": {"addr": f"{LOOPBACK}:{port}", "secret": secrets.token_hex(16)},
    }
    if tls is not None:
        config["http"]["tls"] = {"certificate": str(tls.server_cert), "key": str(tls.server_key)}
    if users:
        import bcrypt

        lines = [
            f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=4)).decode()}"
            for u, p in users.items()
        ]
        (root / "htpasswd").write_text("\n".join(lines) + "\n")
        config["auth"] = {"htpasswd": {"realm": "podgate-test", "path": str(root / "htpasswd")}}
    if token is not None:
        bundle = root / "token-roots.pem"
        bundle.write_bytes(tls_ca_pem(token.ca))
        config["auth"] = {
            "token": {
                "realm": token.realm,
                "service": TOKEN_SERVICE,
                "issuer": TOKEN_ISSUER,
                "rootcertbundle": str(bundle),
            }
        }
    config_path = root / "config.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    log_path = root / "registry.log"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(config_path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    registry = Registry(root, port, process, log_path, tls, dict(users or {}), token)
    try:
        _wait_ready(registry)
        yield registry
    finally:
        registry.stop()
        shutil.rmtree(root, ignore_errors=True)


def tls_ca_pem(ca: LoopbackCA) -> bytes:
    return ca.ca_file.read_bytes()


def _wait_ready(registry: Registry) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RuntimeError(f"docker-registry exited:\n{registry.log_path.read_text()[-3000:]}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection((LOOPBACK, registry.port), timeout=1),
        ):
            return
        time.sleep(POLL_SECONDS)
    registry.stop()
    raise RuntimeError(f"docker-registry did not listen:\n{registry.log_path.read_text()[-3000:]}")


# --------------------------------------------------------------------------- images


@dataclass
class Layer:
    blob: bytes  # as stored (gzip)
    diff_id: str
    media_type: str

    @property
    def digest(self) -> str:
        return sha256(self.blob)


@dataclass
class BuiltImage:
    config: bytes
    layers: list[Layer]
    manifest: bytes
    manifest_type: str
    architecture: str

    @property
    def digest(self) -> str:
        return sha256(self.manifest)

    @property
    def config_digest(self) -> str:
        return sha256(self.config)

    def blobs(self) -> list[tuple[str, bytes]]:
        return [(self.config_digest, self.config), *((lay.digest, lay.blob) for lay in self.layers)]


@dataclass
class BuiltIndex:
    index: bytes
    media_type: str
    images: list[BuiltImage]

    @property
    def digest(self) -> str:
        return sha256(self.index)


def layer_from_files(
    files: dict[str, bytes], media_type: str = OCI_LAYER_GZIP, mode: int = 0o755
) -> Layer:
    """A gzip layer holding `files` (parents created), deterministic bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        dirs: set[str] = set()
        for name in sorted(files):
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type = tarfile.DIRTYPE
                    ti.mode = 0o755
                    ti.mtime = 1_600_000_000
                    tf.addfile(ti)
            ti = tarfile.TarInfo(name.strip("/"))
            ti.size = len(files[name])
            ti.mode = mode
            ti.mtime = 1_600_000_000
            tf.addfile(ti, io.BytesIO(files[name]))
    tar = raw.getvalue()
    blob = gzip.compress(tar, compresslevel=1, mtime=0)
    return Layer(blob, sha256(tar), media_type)


def noise(seed: str, size: int) -> bytes:
    """Deterministic bytes that do not compress (sha256 counter stream)."""
    out = bytearray()
    counter = 0
    base = seed.encode()
    while len(out) < size:
        out += hashlib.sha256(base + counter.to_bytes(8, "big")).digest() * 1
        counter += 1
    return bytes(out[:size])


def make_image(
    layers: Sequence[dict[str, bytes]],
    *,
    docker: bool = False,
    architecture: str = "amd64",
    user: str = "",
    label: str = "",
) -> BuiltImage:
    layer_type = DOCKER_LAYER_GZIP if docker else OCI_LAYER_GZIP
    built = [layer_from_files(files, layer_type) for files in layers]
    return image_from_layers(
        built, docker=docker, architecture=architecture, user=user, label=label
    )


def image_from_layers(
    built: Sequence[Layer],
    *,
    docker: bool = False,
    architecture: str = "amd64",
    user: str = "",
    label: str = "",
) -> BuiltImage:
    """An image of ready-made layers (any tar content, hostile ones included)."""
    config = {
        "architecture": architecture,
        "os": "linux",
        "config": {
            "User": user,
            "Env": ["PATH=/bin"],
            "Cmd": ["/bin/sh"],
            "Labels": {"test": label} if label else {},
        },
        "rootfs": {"type": "layers", "diff_ids": [lay.diff_id for lay in built]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest_type = DOCKER_MANIFEST if docker else OCI_MANIFEST
    manifest = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": {
            "mediaType": DOCKER_CONFIG if docker else OCI_CONFIG,
            "digest": sha256(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": lay.media_type, "digest": lay.digest, "size": len(lay.blob)}
            for lay in built
        ],
    }
    return BuiltImage(
        config_bytes, list(built), json.dumps(manifest).encode(), manifest_type, architecture
    )


def busybox_image(
    *,
    docker: bool = False,
    architecture: str = "amd64",
    label: str = "",
    extra: dict[str, bytes] | None = None,
) -> BuiltImage:
    """busybox-static as /bin/busybox and /bin/sh, plus an optional second layer."""
    base = {"bin/busybox": BUSYBOX.read_bytes()}
    layers = [base, {"etc/podgate-test": f"{label or 'test'}\n".encode(), **(extra or {})}]
    return make_image(layers, docker=docker, architecture=architecture, label=label)


def make_index(images: Sequence[BuiltImage], *, docker: bool = False) -> BuiltIndex:
    media_type = DOCKER_LIST if docker else OCI_INDEX
    doc = {
        "schemaVersion": 2,
        "mediaType": media_type,
        "manifests": [
            {
                "mediaType": img.manifest_type,
                "digest": img.digest,
                "size": len(img.manifest),
                "platform": {"architecture": img.architecture, "os": "linux"},
            }
            for img in images
        ],
    }
    return BuiltIndex(json.dumps(doc).encode(), media_type, list(images))


# --------------------------------------------------------------------------- push client


class Pusher:
    """Pushes blobs and manifests; answers Basic and Bearer challenges with its credentials."""

    def __init__(self, registry: Registry, username: str = "", password: str = "") -> None:
        self.registry = registry
        self.username = username
        self.password = password
        verify: ssl.SSLContext | bool = True
        if registry.tls is not None:
            verify = ssl.create_default_context(cafile=str(registry.tls.ca_file))
        self.client = httpx.Client(verify=verify, timeout=HTTP_TIMEOUT_SECONDS, trust_env=False)
        self.auth: str | None = None

    def close(self) -> None:
        self.client.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if self.auth:
            headers["Authorization"] = self.auth
        response = self.client.request(method, url, headers=headers, **kwargs)
        if response.status_code != 401:
            return response
        challenge = response.headers.get("WWW-Authenticate", "")
        basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        if challenge.lower().startswith("basic"):
            self.auth = f"Basic {basic}"
        else:
            params = dict(
                (k.strip(), v.strip('"'))
                for k, _, v in (p.partition("=") for p in challenge[len("Bearer ") :].split('",'))
            )
            params = {k: v.strip('"') for k, v in params.items()}
            token = self.client.get(
                params["realm"],
                params={"service": params["service"], "scope": params.get("scope", "")},
                headers={"Authorization": f"Basic {basic}"},
            )
            token.raise_for_status()
            self.auth = "Bearer " + token.json()["token"]
        headers["Authorization"] = self.auth
        return self.client.request(method, url, headers=headers, **kwargs)

    def blob(self, repo: str, digest: str, data: bytes) -> None:
        base = self.registry.url
        head = self._request("HEAD", f"{base}/v2/{repo}/blobs/{digest}")
        if head.status_code == 200:
            return
        start = self._request("POST", f"{base}/v2/{repo}/blobs/uploads/")
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        if location.startswith("/"):
            location = base + location
        sep = "&" if "?" in location else "?"
        done = self._request(
            "PUT",
            f"{location}{sep}digest={digest}",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert done.status_code == 201, done.text

    def manifest(self, repo: str, reference: str, body: bytes, media_type: str) -> None:
        put = self._request(
            "PUT",
            f"{self.registry.url}/v2/{repo}/manifests/{reference}",
            content=body,
            headers={"Content-Type": media_type},
        )
        assert put.status_code == 201, put.text

    def image(self, repo: str, tag: str, image: BuiltImage) -> None:
        for digest, data in image.blobs():
            self.blob(repo, digest, data)
        self.manifest(repo, tag, image.manifest, image.manifest_type)

    def index(self, repo: str, tag: str, index: BuiltIndex) -> None:
        for img in index.images:
            for digest, data in img.blobs():
                self.blob(repo, digest, data)
            self.manifest(repo, img.digest, img.manifest, img.manifest_type)
        self.manifest(repo, tag, index.index, index.media_type)


def push_image(registry: Registry, repo: str, tag: str, image: BuiltImage, **creds: str) -> None:
    pusher = Pusher(registry, **creds)
    try:
        pusher.image(repo, tag, image)
    finally:
        pusher.close()


# --------------------------------------------------------------------------- throttling proxy


class ThrottlingProxy:
    """127.0.0.1:<port> → the registry; server→client bytes limited to `rate` bytes/s.

    Counts connections; `paused` holds back answers entirely while set.
    """

    CHUNK = 16 * 1024

    def __init__(self, target_port: int, rate: float | None = None) -> None:
        self.target_port = target_port
        self.rate = rate
        self.listener = socket.socket()
        self.listener.bind((LOOPBACK, 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.bytes_down = 0
        self.connections = 0
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((LOOPBACK, self.target_port))
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.rate), daemon=True
            ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        started = time.monotonic()
        sent = 0
        try:
            while not self._stop.is_set():
                data = src.recv(self.CHUNK)
                if not data:
                    break
                dst.sendall(data)
                if rate is not None:
                    sent += len(data)
                    with self._lock:
                        self.bytes_down += len(data)
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Reset every open connection (the registry "goes away"); new ones still work."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            # shutdown wakes the pipe threads blocked in recv; close alone would not.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
