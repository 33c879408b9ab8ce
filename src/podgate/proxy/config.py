"""The proxy's configuration (a TOML file, overridden by flags) and which pods it selects.

No I/O beyond reading the file: selection is a pure function of a sandbox's runtime handler
and annotations, so it is tested without a runtime.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_UPSTREAM = "unix:///run/containerd/containerd.sock"
DEFAULT_AGENT_DIALBACK = "/run/podgate/agent-dialback"


class ConfigError(ValueError):
    """The configuration file or a flag is malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class AnnotationMatch:
    """`key` present, or `key=value` when value is not None."""

    key: str
    value: str | None = None

    @classmethod
    def parse(cls, text: str) -> AnnotationMatch:
        key, eq, value = text.partition("=")
        if not key:
            raise ConfigError(f"annotation selector {text!r} has no key")
        return cls(key, value if eq else None)

    def matches(self, annotations: Mapping[str, str]) -> bool:
        if self.key not in annotations:
            return False
        return self.value is None or annotations[self.key] == self.value


@dataclass(frozen=True, slots=True)
class Selector:
    """Pods whose PortForward the proxy answers: all, or those with one of the runtime
    handlers, or with one of the annotations."""

    all: bool = False
    runtime_handlers: frozenset[str] = frozenset()
    annotations: tuple[AnnotationMatch, ...] = ()

    def selects(self, runtime_handler: str, annotations: Mapping[str, str]) -> bool:
        if self.all or runtime_handler in self.runtime_handlers:
            return True
        return any(m.matches(annotations) for m in self.annotations)

    @property
    def empty(self) -> bool:
        return not (self.all or self.runtime_handlers or self.annotations)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    listen: str = ""
    upstream: str = DEFAULT_UPSTREAM
    select: Selector = field(default_factory=Selector)
    # Exec/Attach URLs through the proxy's streaming server too (audited), not the runtime's.
    exec_via_proxy: bool = False
    stream_address: str = "127.0.0.1"
    stream_port: int = 0
    stream_socket: str = ""  # a unix socket instead of TCP
    # podgate's sandbox agent: its ttrpc socket ({sandbox_id} replaced) and the unix socket
    # prefix it dials back to (`hvsock://PREFIX`); pods without one use the exec forwarder.
    agent_socket: str = ""
    agent_dialback: str = DEFAULT_AGENT_DIALBACK
    # "relay": HTTP/2 frames relayed, only intercepted answers rewritten (fast); "grpc": a gRPC
    # server and client in the proxy (every call decoded into gRPC calls).
    data_plane: str = "relay"


def upstream_socket(upstream: str) -> str:
    """The socket path of a `unix://` endpoint (as the kubelet's --container-runtime-endpoint
    spells it); a bare path is taken as is."""
    if upstream.startswith("unix://"):
        path = upstream[len("unix://") :]
    elif "://" in upstream:
        raise ConfigError(f"upstream {upstream!r}: only unix:// endpoints are supported")
    else:
        path = upstream
    if not path.startswith("/"):
        raise ConfigError(f"upstream {upstream!r}: the socket path must be absolute")
    return path


_KEYS = frozenset(
    {"listen", "upstream", "exec_via_proxy", "select", "streaming", "agent", "data_plane"}
)
DATA_PLANES = ("relay", "grpc")
_AGENT_KEYS = frozenset({"socket", "dialback"})
_SELECT_KEYS = frozenset({"all", "runtime_handlers", "annotations"})
_STREAMING_KEYS = frozenset({"address", "port", "socket"})


def _table(data: Mapping[str, Any], name: str, allowed: frozenset[str]) -> Mapping[str, Any]:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{name}: unknown keys {', '.join(unknown)}")
    return data


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name} must be a list of strings")
    return list(value)


def _typed(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be a {kind.__name__}")
    return value


def parse_config(data: Mapping[str, Any]) -> ProxyConfig:
    """A ProxyConfig from the TOML document's tables (see examples/podgate-proxy.toml)."""
    top = _table(data, "config", _KEYS)
    select = _table(_typed(top.get("select", {}), dict, "select"), "select", _SELECT_KEYS)
    streaming = _table(
        _typed(top.get("streaming", {}), dict, "streaming"), "streaming", _STREAMING_KEYS
    )
    selector = Selector(
        all=_typed(select.get("all", False), bool, "select.all"),
        runtime_handlers=frozenset(
            _strings(select.get("runtime_handlers", []), "select.runtime_handlers")
        ),
        annotations=tuple(
            AnnotationMatch.parse(a)
            for a in _strings(select.get("annotations", []), "select.annotations")
        ),
    )
    agent = _table(_typed(top.get("agent", {}), dict, "agent"), "agent", _AGENT_KEYS)
    port = _typed(streaming.get("port", 0), int, "streaming.port")
    if not 0 <= port < 65536:
        raise ConfigError(f"streaming.port {port} is out of range")
    data_plane = _typed(top.get("data_plane", "relay"), str, "data_plane")
    if data_plane not in DATA_PLANES:
        raise ConfigError(f"data_plane must be one of {', '.join(DATA_PLANES)}")
    return ProxyConfig(
        data_plane=data_plane,
        listen=_typed(top.get("listen", ""), str, "listen"),
        upstream=_typed(top.get("upstream", DEFAULT_UPSTREAM), str, "upstream"),
        select=selector,
        exec_via_proxy=_typed(top.get("exec_via_proxy", False), bool, "exec_via_proxy"),
        stream_address=_typed(streaming.get("address", "127.0.0.1"), str, "streaming.address"),
        stream_port=port,
        stream_socket=_typed(streaming.get("socket", ""), str, "streaming.socket"),
        agent_socket=_typed(agent.get("socket", ""), str, "agent.socket"),
        agent_dialback=_typed(agent.get("dialback", DEFAULT_AGENT_DIALBACK), str, "agent.dialback"),
    )


def load_config(path: str | Path) -> ProxyConfig:
    try:
        with open(path, "rb") as f:
            return parse_config(tomllib.load(f))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def with_flags(
    config: ProxyConfig,
    *,
    listen: str | None = None,
    upstream: str | None = None,
    select_all: bool = False,
    runtime_handlers: Iterable[str] = (),
    annotations: Iterable[str] = (),
    exec_via_proxy: bool = False,
    stream_address: str | None = None,
    stream_port: int | None = None,
    stream_socket: str | None = None,
    agent_socket: str | None = None,
    agent_dialback: str | None = None,
    data_plane: str | None = None,
) -> ProxyConfig:
    """Flags add to the file's selection and override its scalars."""
    select = Selector(
        all=config.select.all or select_all,
        runtime_handlers=config.select.runtime_handlers | frozenset(runtime_handlers),
        annotations=config.select.annotations
        + tuple(AnnotationMatch.parse(a) for a in annotations),
    )
    return ProxyConfig(
        listen=listen or config.listen,
        upstream=upstream or config.upstream,
        select=select,
        exec_via_proxy=config.exec_via_proxy or exec_via_proxy,
        stream_address=stream_address or config.stream_address,
        stream_port=config.stream_port if stream_port is None else stream_port,
        stream_socket=stream_socket or config.stream_socket,
        agent_socket=agent_socket or config.agent_socket,
        agent_dialback=agent_dialback or config.agent_dialback,
        data_plane=data_plane or config.data_plane,
    )
