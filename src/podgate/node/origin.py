"""Who may send a request, by its `Origin` and `Host` headers (cross-site and DNS rebinding).

kubectl and client-go never send `Origin`; a browser always does on a cross-site fetch or
WebSocket. The Python client's WebSocket library sends the server's own origin
(`https://HOST:PORT` of the URL it dials). So a request carrying `Origin` is refused (403)
unless the origin is the gateway itself — the same scheme-less authority as `Host`, a name
the gateway serves; it serves no pages, so no page can have that origin — or is on an
explicit allow-list. `Host` must name the gateway: one of the names it serves
(listen address, certificate SANs) or a loopback form; a page whose DNS name was rebound to
our address sends its own name and is refused with 421 Misdirected Request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from podgate.proto.k8s import http_status_body
from podgate.proto.upgrade import UpgradeRequest

__all__ = ["Refusal", "RequestOrigins", "host_name"]

# Names that always reach this process through loopback, whatever else is configured.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "127.0.0.1", "::1"})
# A bind address that stands for every local address: it names no host of its own.
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    reason: str
    message: str

    def body(self) -> bytes:
        return http_status_body(self.status, self.reason, self.message)


def host_name(value: str) -> str | None:
    """The host of a `Host` header without its port, lower-cased and IPv6 unbracketed;
    None if it is not a well-formed host[:port]."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not _is_port(value[end + 2 :], value[end + 1])):
            return None
        return value[1:end]
    name, sep, port = value.rpartition(":")
    if not sep:
        return value
    if ":" in name or not _is_port(port, ":"):
        return None
    return name


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _authority(value: str, default_port: int) -> tuple[str, int] | None:
    """(canonical host, port) of `host[:port]`, the port defaulted."""
    name = host_name(value)
    if name is None:
        return None
    rest = value.rsplit("]", 1)[1] if value.startswith("[") else value
    port = rest.rpartition(":")[2] if ":" in rest else ""
    return _canonical(name), int(port) if port else default_port


def _is_port(text: str, sep: str) -> bool:
    return sep == ":" and text.isdigit() and len(text) <= 5


def _canonical(name: str) -> str:
    name = name.strip().lower().strip("[]")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


class RequestOrigins:
    """The Host names the gateway answers to and the Origins it accepts (none by default)."""

    def __init__(
        self,
        hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        *,
        check_host: bool = True,
    ) -> None:
        self.check_host = check_host
        self.hosts = set(LOOPBACK_NAMES)
        self.add_hosts(hosts)
        self.allowed_origins = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins)

    def add_hosts(self, hosts: Iterable[str]) -> None:
        self.hosts.update(_canonical(h) for h in hosts if h not in _WILDCARDS)

    def _host_allowed(self, name: str) -> bool:
        name = _canonical(name)
        if name in self.hosts:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def _same_origin(self, origin: str, request: UpgradeRequest) -> bool:
        """The Origin names this gateway, exactly as the request's Host does."""
        scheme, sep, authority = origin.strip().lower().partition("://")
        hosts = request.header_values("host")
        if not sep or scheme not in _DEFAULT_PORTS or len(hosts) != 1 or "/" in authority:
            return False
        ours = _authority(hosts[0].strip().lower(), _DEFAULT_PORTS[scheme])
        theirs = _authority(authority, _DEFAULT_PORTS[scheme])
        return ours is not None and ours == theirs and self._host_allowed(ours[0])

    def check(self, request: UpgradeRequest) -> Refusal | None:
        """None if the request may go on, else how to refuse it."""
        origins = request.header_values("origin")
        for origin in origins:
            if origin.strip().rstrip(
                "/"
            ).lower() not in self.allowed_origins and not self._same_origin(origin, request):
                return Refusal(
                    403,
                    "Forbidden",
                    f"cross-origin requests are not allowed (Origin: {origin[:200]}); "
                    "kubectl and client libraries send no Origin",
                )
        if not self.check_host:
            return None
        hosts = request.header_values("host")
        if len(hosts) != 1:
            return Refusal(400, "BadRequest", "a request must carry exactly one Host header")
        name = host_name(hosts[0])
        if name is None:
            return Refusal(400, "BadRequest", f"malformed Host header {hosts[0][:200]!r}")
        if not self._host_allowed(name):
            return Refusal(
                421,
                "MisdirectedRequest",
                f"this server does not serve host {name[:200]!r}; "
                "add it with --san or use the address in the kubeconfig",
            )
        return None
