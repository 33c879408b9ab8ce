"""Reading kubeconfig files the way kubectl does, for podgate's client commands.

Which files: `--kubeconfig` (exactly that one), else every file in $KUBECONFIG (split on ":";
missing ones are skipped), else ~/.kube/config. Several files merge as kubectl merges them: the
first file that names a cluster, user or context wins, and so does the first `current-context`.
Relative paths in a file are relative to that file.

What is understood: `server` (https or http, which may carry a path prefix),
`certificate-authority(-data)`, `insecure-skip-tls-verify`, `tls-server-name`;
`client-certificate(-data)`/`client-key(-data)`, `token`, `tokenFile`, `username`/`password`.
Credential plugins (`exec`, `auth-provider`) and `proxy-url` are refused with a clear error
rather than ignored: going on without them only ends in a confusing 401 or a wrong route.

Credentials go only over HTTPS, as kubectl does: over plain http kubectl sends no bearer token
(kubectl-api-surface.md §9), and neither does podgate.
"""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from podgate.streaming.client import Endpoint

DEFAULT_NAMESPACE = "default"
# Where kubectl looks when neither --kubeconfig nor $KUBECONFIG is set.
DEFAULT_PATH = Path("~/.kube/config")
# Largest kubeconfig read: real ones are a few KiB, even with several embedded certificates.
MAX_FILE_BYTES = 4 * 1024 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


class KubeconfigError(Exception):
    """The kubeconfig is missing, malformed, or asks for something podgate cannot do."""


@dataclass(frozen=True, slots=True)
class ApiServer:
    """Where the API is and how to talk to it, resolved from one context."""

    endpoint: Endpoint
    prefix: str  # path the server URL carries ("" or "/something", no trailing slash)
    namespace: str
    context: str
    server: str  # the URL as written, for messages

    def path(self, api_path: str) -> str:
        return f"{self.prefix}{api_path}"


# --------------------------------------------------------------------------- files and merging


def kubeconfig_paths(explicit: str | None, environ: Mapping[str, str]) -> list[Path]:
    """The files to read, in priority order."""
    if explicit:
        return [Path(explicit).expanduser()]
    value = environ.get("KUBECONFIG", "")
    if value:
        return [Path(p).expanduser() for p in value.split(os.pathsep) if p]
    home = environ.get("HOME")
    base = Path(home) if home else Path.home()
    return [base / ".kube" / "config"]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise KubeconfigError(f"cannot read kubeconfig {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise KubeconfigError(f"kubeconfig {path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"kubeconfig {path} is not valid YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise KubeconfigError(f"kubeconfig {path}: expected a mapping at the top")
    return doc


@dataclass(slots=True)
class _Entry:
    body: dict[str, Any]
    base: Path  # directory of the file that defined it (for relative paths)


@dataclass(slots=True)
class MergedConfig:
    clusters: dict[str, _Entry]
    users: dict[str, _Entry]
    contexts: dict[str, _Entry]
    current_context: str
    sources: list[Path]


def _named(doc: dict[str, Any], key: str, inner: str, path: Path) -> list[tuple[str, Any]]:
    items = doc.get(key) or []
    if not isinstance(items, list):
        raise KubeconfigError(f"kubeconfig {path}: {key} must be a list")
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise KubeconfigError(f"kubeconfig {path}: every entry of {key} needs a name")
        body = item.get(inner) or {}
        if not isinstance(body, dict):
            raise KubeconfigError(
                f"kubeconfig {path}: {key} {item['name']!r}: {inner} must be a map"
            )
        out.append((item["name"], body))
    return out


def merge_files(paths: Sequence[Path], *, explicit: bool) -> MergedConfig:
    """Read and merge; with `explicit` the single file must exist, otherwise missing files are
    skipped (as kubectl skips them in $KUBECONFIG) but at least one must be there."""
    merged = MergedConfig({}, {}, {}, "", [])
    for path in paths:
        if not explicit and not path.exists():
            continue
        doc = _read_yaml(path)
        merged.sources.append(path)
        base = path.resolve().parent
        for key, inner, table in (
            ("clusters", "cluster", merged.clusters),
            ("users", "user", merged.users),
            ("contexts", "context", merged.contexts),
        ):
            for name, body in _named(doc, key, inner, path):
                table.setdefault(name, _Entry(body, base))
        current = doc.get("current-context")
        if not merged.current_context and isinstance(current, str):
            merged.current_context = current
    if not merged.sources:
        where = ", ".join(str(p) for p in paths) or "(none)"
        raise KubeconfigError(f"no kubeconfig found (looked at {where})")
    return merged


# --------------------------------------------------------------------------- resolving


def _decode_data(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise KubeconfigError(f"{what} must be a base64 string")
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KubeconfigError(f"{what} is not valid base64: {exc}") from exc


def _file(value: object, base: Path, what: str) -> Path:
    if not isinstance(value, str) or not value:
        raise KubeconfigError(f"{what} must be a file name")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KubeconfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _material(body: dict[str, Any], base: Path, key: str, what: str) -> bytes | None:
    """`key-data` (decoded) or `key` (a file): one of them, data first as kubectl does."""
    data_key = f"{key}-data"
    if body.get(data_key):
        return _decode_data(body[data_key], f"{what} ({data_key})")
    if body.get(key):
        return _read_file(_file(body[key], base, f"{what} ({key})"), what)
    return None


def _load_client_cert(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl loads a certificate chain only from files: write them to a private directory and
    # remove it at once.
    with tempfile.TemporaryDirectory(prefix="podgate-cert-") as tmp:
        cert_path = os.path.join(tmp, "client.crt")
        key_path = os.path.join(tmp, "client.key")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            context.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError) as exc:
            raise KubeconfigError(f"cannot load the client certificate and key: {exc}") from exc


def _tls_context(cluster: _Entry, user: _Entry | None) -> ssl.SSLContext:
    body = cluster.body
    context = ssl.create_default_context()
    if body.get("insecure-skip-tls-verify") is True:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        ca = _material(body, cluster.base, "certificate-authority", "certificate authority")
        if ca is not None:
            # Only the given authority, as kubectl: not the system's roots as well.
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                # PEM text, or DER bytes (both are accepted by kubectl).
                if b"-----BEGIN" in ca:
                    context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
                else:
                    context.load_verify_locations(cadata=ca)
            except (ssl.SSLError, ValueError) as exc:
                raise KubeconfigError(f"cannot load the certificate authority: {exc}") from exc
    if user is not None:
        cert = _material(user.body, user.base, "client-certificate", "client certificate")
        key = _material(user.body, user.base, "client-key", "client key")
        if (cert is None) != (key is None):
            raise KubeconfigError("client-certificate and client-key go together")
        if cert is not None and key is not None:
            _load_client_cert(context, cert, key)
    return context


def _auth_headers(user: _Entry) -> list[tuple[str, str]]:
    body = user.body
    for plugin in ("exec", "auth-provider"):
        if body.get(plugin):
            raise KubeconfigError(
                f"the kubeconfig user uses an {plugin!r} credential plugin, which podgate does "
                "not support: use a token, a client certificate or basic auth"
            )
    token: str | None = None
    if body.get("token"):
        token = str(body["token"]).strip()
    elif body.get("tokenFile"):
        path = _file(body["tokenFile"], user.base, "tokenFile")
        token = _read_file(path, "token file").decode("utf-8", "replace").strip()
    if token:
        return [("Authorization", f"Bearer {token}")]
    if body.get("username") is not None or body.get("password") is not None:
        pair = f"{body.get('username') or ''}:{body.get('password') or ''}"
        return [("Authorization", f"Basic {base64.b64encode(pair.encode()).decode()}")]
    return []


def resolve(
    config: MergedConfig, *, context: str | None = None, namespace: str | None = None
) -> ApiServer:
    """The API server, credentials and namespace of `context` (default: the current one)."""
    name = context or config.current_context
    if not name:
        raise KubeconfigError("no context chosen: the kubeconfig has no current-context")
    entry = config.contexts.get(name)
    if entry is None:
        raise KubeconfigError(f"context {name!r} not found in the kubeconfig")
    ctx = entry.body
    cluster = config.clusters.get(str(ctx.get("cluster") or ""))
    if cluster is None:
        raise KubeconfigError(f"context {name!r}: cluster {ctx.get('cluster')!r} not found")
    user: _Entry | None = None
    if ctx.get("user"):
        user = config.users.get(str(ctx["user"]))
        if user is None:
            raise KubeconfigError(f"context {name!r}: user {ctx['user']!r} not found")
    if cluster.body.get("proxy-url"):
        raise KubeconfigError(
            f"cluster {ctx.get('cluster')!r} uses proxy-url, which podgate does not support"
        )
    server = cluster.body.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"cluster {ctx.get('cluster')!r} has no server")
    parts = urlsplit(server)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise KubeconfigError(f"server {server!r}: only https:// and http:// are supported")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise KubeconfigError(f"server {server!r}: {exc}") from exc
    if not parts.hostname:
        raise KubeconfigError(f"server {server!r} has no host")
    headers: list[tuple[str, str]] = []
    ssl_context: ssl.SSLContext | None = None
    server_name: str | None = None
    if scheme == "https":
        ssl_context = _tls_context(cluster, user)
        tls_name = cluster.body.get("tls-server-name")
        server_name = str(tls_name) if tls_name else None
        if user is not None:
            headers = _auth_headers(user)
    elif user is not None:
        _auth_headers(user)  # still refuse plugins: they would never work
    ns = namespace or str(ctx.get("namespace") or "") or DEFAULT_NAMESPACE
    endpoint = Endpoint(
        parts.hostname,
        port,
        ssl_context,
        server_hostname=server_name,
        headers=tuple(headers),
    )
    return ApiServer(endpoint, parts.path.rstrip("/"), ns, name, server)


def load(
    kubeconfig: str | None = None,
    *,
    context: str | None = None,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ApiServer:
    """Everything at once: which files, merged, resolved for one context."""
    env = os.environ if environ is None else environ
    paths = kubeconfig_paths(kubeconfig, env)
    config = merge_files(paths, explicit=bool(kubeconfig))
    return resolve(config, context=context, namespace=namespace)


__all__ = [
    "ApiServer",
    "KubeconfigError",
    "MergedConfig",
    "kubeconfig_paths",
    "load",
    "merge_files",
    "resolve",
]
