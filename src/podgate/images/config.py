"""The runtime's TOML config file (`podgate runtime --config FILE`): images and registries.

    [images]
    max_concurrent_downloads = 3
    max_layer_bytes = 10737418240

    [registries."docker.io"]
    mirrors = ["http://127.0.0.1:5000", { url = "https://mirror.internal", ca_file = "ca.pem" }]
    origin = false

    [registries."registry.internal:5443"]
    ca_file = "/etc/podgate/registry-ca.pem"
    username = "puller"
    password = "secret"

Per host (like containerd's hosts.toml): mirrors tried in order, then the origin unless
`origin = false`; `ca_file` added to the system CAs; `insecure = true` allows plain HTTP and
unverified TLS; credentials used when a pull brings none. Every error names the file and key.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

# How many layers one pull downloads at once (containerd's max_concurrent_downloads is 3).
DEFAULT_MAX_CONCURRENT_DOWNLOADS: Final = 3
# Upper bound of that setting: more parallel streams from one registry only add contention.
MAX_CONCURRENT_DOWNLOADS_LIMIT: Final = 32
# A config file larger than this is a mistake, not a config (bytes).
MAX_CONFIG_BYTES: Final = 1024 * 1024

# Docker Hub's registry API lives on another host than its name.
DOCKER_HUB: Final = "docker.io"
DOCKER_HUB_ENDPOINT: Final = "https://registry-1.docker.io"


class ConfigError(ValueError):
    """A config file podgate cannot use; the message starts with `<file>: <key>:`."""


@dataclass(frozen=True, slots=True)
class Credentials:
    username: str = ""
    password: str = ""
    identity_token: str = ""  # an OAuth refresh token (CRI identity_token)
    registry_token: str = ""  # a bearer token used as is (CRI registry_token)

    def __bool__(self) -> bool:
        return bool(self.username or self.identity_token or self.registry_token)

    def __repr__(self) -> str:  # never print secrets
        return f"Credentials(username={self.username!r})"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One place a repository can be fetched from: `scheme://host[:port][/prefix]`."""

    scheme: str  # "https" or "http"
    host: str  # host[:port], as in a URL
    prefix: str = ""  # path before /v2/, without a trailing slash
    ca_file: str = ""
    insecure: bool = False
    credentials: Credentials = field(default_factory=Credentials)
    mirror: bool = False

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def plain_http_allowed(self) -> bool:
        """containerd's fallback for loopback registries, or an explicit `insecure`."""
        return self.insecure or self.loopback

    def base_url(self, scheme: str | None = None) -> str:
        return f"{scheme or self.scheme}://{self.host}{self.prefix}/v2/"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}{self.prefix}"


@dataclass(frozen=True, slots=True)
class RegistryHost:
    """Settings of one registry name (`docker.io`, `127.0.0.1:5000`)."""

    name: str
    mirrors: tuple[Endpoint, ...] = ()
    origin: bool = True
    ca_file: str = ""
    insecure: bool = False
    credentials: Credentials = field(default_factory=Credentials)

    def origin_endpoint(self) -> Endpoint:
        url = DOCKER_HUB_ENDPOINT if self.name == DOCKER_HUB else f"https://{self.name}"
        parts = urlsplit(url)
        return Endpoint(
            "https", parts.netloc, "", self.ca_file, self.insecure, self.credentials, False
        )

    def endpoints(self) -> list[Endpoint]:
        """Mirrors in order, then the origin unless it is disabled."""
        out = list(self.mirrors)
        if self.origin:
            out.append(self.origin_endpoint())
        return out


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    hosts: Mapping[str, RegistryHost] = field(default_factory=dict)

    def host(self, name: str) -> RegistryHost:
        return self.hosts.get(name) or RegistryHost(name)


@dataclass(frozen=True, slots=True)
class ImagesSettings:
    max_concurrent_downloads: int = DEFAULT_MAX_CONCURRENT_DOWNLOADS
    # Cap on one layer's unpacked bytes; None: the image store's default.
    max_layer_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Everything the runtime's config file says."""

    images: ImagesSettings = field(default_factory=ImagesSettings)
    registries: RegistryConfig = field(default_factory=RegistryConfig)


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1, with or without a port."""
    name = host
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _Reader:
    """Typed access to a TOML table with errors naming the file and the key."""

    def __init__(self, path: str, table: Mapping[str, Any], key: str) -> None:
        self.path = path
        self.table = table
        self.key = key
        self.used: set[str] = set()

    def error(self, name: str, what: str) -> ConfigError:
        key = f"{self.key}.{name}" if self.key else name
        return ConfigError(f"{self.path}: {key}: {what}")

    def get(self, name: str, kind: type[Any], default: Any) -> Any:
        self.used.add(name)
        if name not in self.table:
            return default
        value = self.table[name]
        if kind is int and isinstance(value, bool):
            raise self.error(name, "must be an integer")
        if not isinstance(value, kind):
            raise self.error(name, f"must be {_KIND_NAMES.get(kind, kind.__name__)}")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.error(unknown[0], "unknown key")


_KIND_NAMES: Final = {
    str: "a string",
    bool: "true or false",
    int: "an integer",
    list: "a list",
    dict: "a table",
}


def _credentials(r: _Reader) -> Credentials:
    username = r.get("username", str, "")
    password = r.get("password", str, "")
    if password and not username:
        raise r.error("password", "given without username")
    if username and not password:
        raise r.error("username", "given without password")
    return Credentials(username=username, password=password)


def _ca_file(r: _Reader, base: Path) -> str:
    value: str = r.get("ca_file", str, "")
    if not value:
        return ""
    path = (base / value) if not Path(value).is_absolute() else Path(value)
    if not path.is_file():
        raise r.error("ca_file", f"{str(path)!r} is not a readable file")
    return str(path)


def _endpoint(r: _Reader, url: str, base: Path, name: str) -> Endpoint:
    text = url if "://" in url else f"https://{url}"
    parts = urlsplit(text)
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise r.error(name, f"{url!r} is not an http(s)://host[:port] URL")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise r.error(name, f"{url!r}: no user, query or fragment allowed")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v2"):
        prefix = prefix[: -len("/v2")]
    ca_file = _ca_file(r, base)
    insecure = r.get("insecure", bool, False)
    if parts.scheme == "http" and not (insecure or is_loopback(parts.netloc)):
        raise r.error(
            name,
            f"{url!r} is plain HTTP to a host that is not loopback; set insecure = true "
            "to allow it",
        )
    return Endpoint(
        parts.scheme, parts.netloc, prefix, ca_file, insecure, _credentials(r), mirror=True
    )


def _registry(path: str, name: str, table: Mapping[str, Any], base: Path) -> RegistryHost:
    key = f'registries."{name}"'
    r = _Reader(path, table, key)
    if not name or "/" in name or "://" in name:
        raise ConfigError(f"{path}: {key}: a registry is named by host[:port] only")
    mirrors: list[Endpoint] = []
    for i, item in enumerate(r.get("mirrors", list, [])):
        mkey = f"{key}.mirrors[{i}]"
        if isinstance(item, str):
            mr = _Reader(path, {}, mkey)
            mirrors.append(_endpoint(mr, item, base, "url"))
        elif isinstance(item, dict):
            mr = _Reader(path, item, mkey)
            url = mr.get("url", str, "")
            if not url:
                raise mr.error("url", "missing")
            mirrors.append(_endpoint(mr, url, base, "url"))
            mr.done()
        else:
            raise ConfigError(f"{path}: {mkey}: must be a URL string or a table with url")
    origin = r.get("origin", bool, True)
    if not origin and not mirrors:
        raise r.error("origin", "false, but no mirrors: nothing to pull from")
    host = RegistryHost(
        name=name,
        mirrors=tuple(mirrors),
        origin=origin,
        ca_file=_ca_file(r, base),
        insecure=r.get("insecure", bool, False),
        credentials=_credentials(r),
    )
    r.done()
    return host


def parse_config(text: str, path: str = "<config>") -> FileConfig:
    """Parse and validate; relative `ca_file`s are taken from the file's directory."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    base = Path(path).resolve().parent
    top = _Reader(path, doc, "")
    images_table = top.get("images", dict, {})
    ir = _Reader(path, images_table, "images")
    downloads = ir.get("max_concurrent_downloads", int, DEFAULT_MAX_CONCURRENT_DOWNLOADS)
    if not 1 <= downloads <= MAX_CONCURRENT_DOWNLOADS_LIMIT:
        raise ir.error(
            "max_concurrent_downloads", f"must be between 1 and {MAX_CONCURRENT_DOWNLOADS_LIMIT}"
        )
    max_layer_bytes = ir.get("max_layer_bytes", int, None)
    if max_layer_bytes is not None and max_layer_bytes <= 0:
        raise ir.error("max_layer_bytes", "must be a positive number of bytes")
    ir.done()
    hosts: dict[str, RegistryHost] = {}
    for name, table in top.get("registries", dict, {}).items():
        if not isinstance(table, dict):
            raise ConfigError(f'{path}: registries."{name}": must be a table')
        hosts[name] = _registry(path, name, table, base)
    top.done()
    return FileConfig(ImagesSettings(downloads, max_layer_bytes), RegistryConfig(hosts))


def load_config(path: str | Path) -> FileConfig:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8") from None
    return parse_config(text, str(p))
