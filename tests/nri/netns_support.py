"""Network namespaces, unique names and subnets, and tiny HTTP peers for the network tests.

Every helper cleans up what it made in `finally`, and stops only processes it started, by PID.
Traffic goes only to addresses inside namespaces made here, and only after the test checked that
the host routes their subnet through its own bridge.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

NOT_ROOT = os.geteuid() != 0
_needs_root = pytest.mark.skipif(NOT_ROOT, reason="needs root (network namespaces, veths, bridges)")

F = TypeVar("F", bound=Callable[..., Any])


def privileged(func: F) -> F:
    """Mark a test `privileged` and skip it when not root."""
    return pytest.mark.privileged(_needs_root(func))  # type: ignore[no-any-return]


# Seconds any helper process may live, and how long we wait for one to be ready.
HELPER_LIFETIME = 60.0
READY_TIMEOUT = 10.0
# Attempts (and the pause between them, seconds) for a first connection: neighbour discovery.
CONNECT_ATTEMPTS = 100
CONNECT_PAUSE = 0.1


def unique(prefix: str) -> str:
    """`prefix` + 6 random hex digits: short enough for an interface name with a prefix ≤ 9."""
    return prefix + secrets.token_hex(3)


def _routes() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for family in ("-4", "-6"):
        text = subprocess.run(
            ["ip", "-j", family, "route", "show", "table", "all"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        for route in json.loads(text or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default":
                with suppress(ValueError):
                    out.append(ipaddress.ip_network(dst, strict=False))
    return out


def free_subnet_v4() -> str:
    """A random /24 in 10.192.0.0/10 that no host route covers or overlaps."""
    taken = [r for r in _routes() if r.version == 4]
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{random.randint(192, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(r) for r in taken):
            return str(net)
    raise RuntimeError("no free IPv4 test subnet")


def free_subnet_v6() -> str:
    """A random ULA /64 (fd00::/8) that no host route covers or overlaps."""
    taken = [r for r in _routes() if r.version == 6]
    for _ in range(100):
        words = [random.randint(0, 0xFFFF) for _ in range(3)]
        net = ipaddress.ip_network(f"fd{words[0] & 0xFF:02x}:{words[1]:x}:{words[2]:x}::/64")
        if not any(net.overlaps(r) for r in taken):
            return str(net)
    raise RuntimeError("no free IPv6 test subnet")


def link_names() -> set[str]:
    """Interface names in the host netns."""
    text = subprocess.run(
        ["ip", "-j", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {link["ifname"] for link in json.loads(text)}


def link_addresses(name: str, netns: Netns | None = None, *, scope: str = "global") -> set[str]:
    """`address/prefix` of the addresses of `scope` ("global", "host", "all") on `name`, in
    `netns` or on the host."""
    argv = ["ip", "-j", "addr", "show", "dev", name]
    if scope != "all":
        argv += ["scope", scope]
    if netns is not None:
        text = netns.run(argv).stdout
    else:
        text = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    return {
        f"{info['local']}/{info['prefixlen']}"
        for link in json.loads(text or "[]")
        for info in link.get("addr_info", [])
        if "local" in info
    }


async def wait_link_gone(name: str) -> None:
    """The kernel removes a dead netns's veth pair asynchronously; wait (bounded) for it."""
    for _ in range(100):
        if name not in link_names():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} still exists")


def delete_link(name: str) -> None:
    subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


def assert_routed_via(address: str, bridge: str) -> None:
    """The host sends traffic for `address` out of `bridge` (so it stays on this machine)."""
    text = subprocess.run(
        ["ip", "-j", "route", "get", address], capture_output=True, text=True, check=True
    ).stdout
    (route,) = json.loads(text)
    assert route["dev"] == bridge, f"{address} would leave through {route['dev']}, not {bridge}"


@dataclass
class Netns:
    """A network namespace made for a test: `path` is what NRI passes as the pod's netns."""

    name: str
    path: str

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def run(
        self, argv: list[str], timeout: float = READY_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout, check=False
        )

    def links(self) -> set[str]:
        text = self.run(["ip", "-j", "link", "show"]).stdout
        return {link["ifname"] for link in json.loads(text or "[]")}


@contextmanager
def named_netns() -> Iterator[Netns]:
    """`ip netns add` a unique namespace (path /run/netns/NAME); deleted afterwards."""
    name = unique("pgtest")
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield Netns(name, f"/run/netns/{name}")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@contextmanager
def held_netns() -> Iterator[Netns]:
    """A namespace held by a sleeping process (path /proc/PID/ns/net, as a pod's is)."""
    proc = subprocess.Popen(
        ["unshare", "--net", "sleep", str(int(HELPER_LIFETIME))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        path = f"/proc/{proc.pid}/ns/net"
        home = os.stat("/proc/self/ns/net").st_ino
        deadline = time.monotonic() + READY_TIMEOUT
        while os.stat(path).st_ino == home:  # until unshare has run
            assert time.monotonic() < deadline, "unshare --net did not start"
            time.sleep(0.01)
        yield Netns(f"pid{proc.pid}", path)
    finally:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=READY_TIMEOUT)


_SERVER = r"""
import http.server, socket, sys, time
body = sys.argv[1].encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6  # "::" also takes IPv4 (bindv6only=0)
server = Server(("::", 0), Handler)
server.timeout = 0.2
print(server.server_address[1], flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    server.handle_request()
"""

_CLIENT = r"""
import socket, sys, time
host, port, attempts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for attempt in range(attempts):
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        break
    except OSError:
        if attempt == attempts - 1:
            raise
        time.sleep(0.1)
sys.stdout.write(data.split(b"\r\n\r\n", 1)[1].decode())
"""


@contextmanager
def http_server(netns: Netns, body: str) -> Iterator[int]:
    """An HTTP server on every address inside `netns` answering `body`; yields its port."""
    proc = subprocess.Popen(
        netns.argv([sys.executable, "-c", _SERVER, body, str(HELPER_LIFETIME)]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        assert line.strip().isdigit(), (
            f"server did not start: {proc.stderr and proc.stderr.read()!r}"
        )
        yield int(line)
    finally:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=READY_TIMEOUT)


def http_get(host: str, port: int) -> str:
    """GET / from the host netns; retried while neighbour discovery settles."""
    for attempt in range(CONNECT_ATTEMPTS):
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            return data.split(b"\r\n\r\n", 1)[1].decode()
        except OSError:
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
            time.sleep(CONNECT_PAUSE)
    raise AssertionError("unreachable")


def http_get_from(netns: Netns, host: str, port: int) -> str:
    """GET / from inside `netns`."""
    result = netns.run(
        [sys.executable, "-c", _CLIENT, host, str(port), str(CONNECT_ATTEMPTS)], timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def tcp_refused_or_unreachable(netns: Netns, host: str, port: int) -> bool:
    """Whether a connection from `netns` to host:port fails (one quick attempt)."""
    result = netns.run([sys.executable, "-c", _CLIENT, host, str(port), "1"], timeout=30)
    return result.returncode != 0
