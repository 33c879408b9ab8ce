"""Helpers for the node gateway's end-to-end tests (imported by module name; keep it unique).

`podgate up` runs as a child process with its own state directory and sample pods; tests reach
it with real kubectl, the Python client, and raw TLS connections. Every wait is bounded, every
process is stopped by its PID, and the state directory is removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_support import Kubectl, kubectl_binary

from podgate.node.pki import Pki, write_kubeconfig
from process_support import processes_mentioning

REPO = Path(__file__).resolve().parents[2]

# From starting `podgate up` to its ready line: runtime, four sample pods and the gateway.
READY_TIMEOUT_SECONDS = 60.0
# After SIGTERM, how long `podgate up` may take to remove its pods and exit.
STOP_TIMEOUT_SECONDS = 60.0
# How long an audit record or a reloaded file may take to show its effect.
SETTLE_SECONDS = 10.0
# Poll interval while waiting for a file or a log line.
POLL_SECONDS = 0.05
# Bound on one raw request/response exchange with the gateway.
RAW_TIMEOUT_SECONDS = 15.0
# Largest response head read from the gateway (its Status bodies are a few hundred bytes).
MAX_HEAD_BYTES = 64 * 1024

READY_LINE = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+) cri=unix://(\S+)")
STREAMING_LINE = re.compile(r"streaming on (\S+)")

# The `data` pod's servers, bound to the pod's own loopback (kubectl-api-surface.md's echo and
# sink targets): 7000 echoes and ends after the client's EOF; 7001 reads to EOF and answers
# with the sha256 hex digest of what it read. SIGTERM ends it at once when the pod is removed.
ECHO_PORT = 7000
SINK_PORT = 7001
# 7003 answers one HTTP/1.0 request and closes, without waiting for the client's EOF: the end
# of the response is the pod closing the connection.
HTTP10_PORT = 7003
HTTP10_BODY = b"podgate http/1.0 body\n"
# 7004 accepts and never reads (a pod that stopped reading), holding each connection.
STALL_PORT = 7004
DATA_SERVER = """\
import hashlib, os, signal, socket, threading
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
def echo(c):
    with c:
        while d := c.recv(262144):
            c.sendall(d)
def sink(c):
    with c:
        h = hashlib.sha256()
        while d := c.recv(262144):
            h.update(d)
        c.sendall(h.hexdigest().encode())
def http10(c):
    with c:
        got = b""
        while b"\\r\\n\\r\\n" not in got and (d := c.recv(65536)):
            got += d
        body = HTTP10_BODY
        c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n" + body)
def stall(c):
    held.append(c)
held = []
def serve(port, handler):
    s = socket.create_server(("127.0.0.1", port))
    while True:
        c, _ = s.accept()
        threading.Thread(target=handler, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(SINK_PORT, sink), daemon=True).start()
threading.Thread(target=serve, args=(HTTP10_PORT, http10), daemon=True).start()
threading.Thread(target=serve, args=(STALL_PORT, stall), daemon=True).start()
serve(ECHO_PORT, echo)
""".replace("SINK_PORT", str(SINK_PORT)).replace("ECHO_PORT", str(ECHO_PORT))
DATA_SERVER = DATA_SERVER.replace("STALL_PORT", str(STALL_PORT))
DATA_SERVER = DATA_SERVER.replace("HTTP10_PORT", str(HTTP10_PORT)).replace(
    "HTTP10_BODY", repr(HTTP10_BODY)
)
V6_ECHO_PORT = 7002
# The same servers plus an echo bound only to ::1, for the sandboxed pod.
SANDBOXED_DATA_SERVER = (
    DATA_SERVER.replace(
        "threading.Thread(target=serve, args=(",
        "threading.Thread(target=lambda: serve6(V6_PORT, echo), daemon=True).start()\n"
        "threading.Thread(target=serve, args=(",
        1,
    )
    .replace(
        "def serve(port, handler):",
        "def serve6(port, handler):\n"
        '    s = socket.create_server(("::1", port), family=socket.AF_INET6)\n'
        "    while True:\n"
        "        c, _ = s.accept()\n"
        "        threading.Thread(target=handler, args=(c,), daemon=True).start()\n"
        "def serve(port, handler):",
    )
    .replace("V6_PORT", str(V6_ECHO_PORT))
)
# One numbered line every 0.2 s; the trap lets SIGTERM end it at once when the pod is removed.
LOGGER_SCRIPT = (
    "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo \"logger line $i\"; sleep 0.2; done"
)
LOGGER_LINE = re.compile(r"^logger line (\d+)$")


def write_examples(directory: Path) -> None:
    """The sample pods: the repository's `hello` and `shell`, plus `data` and `logger`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("hello", "shell"):
        shutil.copyfile(REPO / "examples" / f"{name}.json", directory / f"{name}.json")
    pods: dict[str, dict[str, Any]] = {
        "data": {
            "name": "srv",
            "ports": [ECHO_PORT, SINK_PORT, HTTP10_PORT, STALL_PORT],
            "command": ["python3", "-c"],
        },
        "logger": {"name": "log", "command": ["sh", "-c", LOGGER_SCRIPT]},
        "data-sandboxed": {
            "name": "srv",
            "ports": [ECHO_PORT, SINK_PORT, V6_ECHO_PORT],
            "command": ["python3", "-c", SANDBOXED_DATA_SERVER],
        },
    }
    pods["data"]["command"].append(DATA_SERVER)
    for name, container in pods.items():
        spec: dict[str, Any] = {
            "pod": {
                "metadata": {"name": name, "namespace": "default", "uid": f"gw-{name}"},
                "hostname": name,
            },
            "containers": [container],
        }
        if name.endswith("-sandboxed"):
            spec["pod"]["runtime_handler"] = "sandboxed"
        (directory / f"{name}.json").write_text(json.dumps(spec, indent=2))


# --- the audit log ----------------------------------------------------------------------------


class AuditLog:
    """The gateway's JSON-lines audit log, read from a remembered position."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        """The current end; pass it to `since` to see only what is written afterwards."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def since(self, mark: int) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(mark)
                data = f.read()
        except FileNotFoundError:
            return []
        # A line being written has no newline yet: leave it for the next read.
        complete = data[: data.rfind(b"\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def wait_for(
        self,
        mark: int,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        count: int = 1,
        timeout: float = SETTLE_SECONDS,
    ) -> list[dict[str, Any]]:
        """Entries since `mark` matching `predicate`, once there are `count` of them."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.since(mark) if predicate(e)]
            if len(found) >= count or time.monotonic() > deadline:
                assert len(found) >= count, (
                    f"{len(found)} of {count} audit entries after {timeout} s; "
                    f"all new entries: {self.since(mark)}"
                )
                return found
            time.sleep(POLL_SECONDS)


def matching(**fields: Any) -> Callable[[dict[str, Any]], bool]:
    """A predicate for audit entries whose fields have exactly these values."""
    return lambda entry: all(entry.get(k) == v for k, v in fields.items())


# --- the running gateway ----------------------------------------------------------------------


@dataclass
class Gateway:
    """A running `podgate up` and the files it wrote."""

    proc: subprocess.Popen[bytes]
    root: Path  # the temporary directory holding the state directory and the examples
    state_dir: Path
    log_path: Path
    url: str
    port: int
    kubeconfig: str  # admin, client certificate
    cri_socket: str
    homes: Path = field(init=False)

    def __post_init__(self) -> None:
        self.homes = self.root / "homes"
        self.homes.mkdir(exist_ok=True)

    @property
    def node_dir(self) -> Path:
        return self.state_dir / "node"

    @property
    def kubeconfig_token(self) -> str:
        return str(self.node_dir / "kubeconfig-token")

    @property
    def token_file(self) -> Path:
        return self.node_dir / "tokens.csv"

    @property
    def policy_file(self) -> Path:
        return self.node_dir / "policy.toml"

    @property
    def ca_cert(self) -> Path:
        return self.node_dir / "pki" / "ca.crt"

    @property
    def pki(self) -> Pki:
        d = self.node_dir / "pki"
        return Pki(
            directory=d,
            ca_cert=d / "ca.crt",
            ca_key=d / "ca.key",
            server_cert=d / "server.crt",
            server_key=d / "server.key",
            admin_cert=d / "admin.crt",
            admin_key=d / "admin.key",
        )

    @property
    def audit(self) -> AuditLog:
        return AuditLog(self.node_dir / "audit.log")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_mark(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def streaming_url(self) -> str:
        m = STREAMING_LINE.search(self.log_text())
        assert m, self.log_text()
        return m[1]

    def admin_token(self) -> str:
        for line in self.token_file.read_text().splitlines():
            fields = line.split(",")
            if not line.startswith("#") and len(fields) >= 2 and fields[1] == "admin":
                return fields[0]
        raise AssertionError(f"no admin token in {self.token_file}")

    def kubectl(
        self, version: str, kubeconfig: str, env: Sequence[tuple[str, str]] = ()
    ) -> Kubectl:
        return Kubectl(kubectl_binary(version), kubeconfig, self.homes, tuple(env))

    # -- credentials for more users

    def add_token(self, token: str, user: str, groups: Sequence[str] = ()) -> None:
        """Append a line to the token file (the gateway re-reads it when it changes)."""
        line = f'{token},{user},{user},"{",".join(groups)}"\n'
        with open(self.token_file, "a") as f:
            f.write(line)

    def write_policy(self, text: str) -> None:
        """Replace the policy by rename, so the gateway never reads half a file."""
        tmp = self.policy_file.with_name(".policy.toml.new")
        tmp.write_text(text)
        os.replace(tmp, self.policy_file)

    def token_kubeconfig(self, name: str, token: str) -> str:
        path = self.root / f"kubeconfig-{name}"
        write_kubeconfig(path, self.url, self.ca_cert, user=name, token=token)
        return str(path)

    def cert_kubeconfig(self, name: str, groups: Sequence[str]) -> tuple[str, Path, Path]:
        """A client certificate signed by the gateway's CA, and a kubeconfig using it."""
        crt, key = self.pki.issue_client_cert(name, groups, self.root / "certs")
        path = self.root / f"kubeconfig-{name}"
        write_kubeconfig(path, self.url, self.ca_cert, user=name, client_cert=crt, client_key=key)
        return str(path), crt, key

    def anonymous_kubeconfig(self) -> str:
        """The server and its CA, and a user with no credentials at all."""
        path = self.root / "kubeconfig-anonymous"
        write_kubeconfig(path, self.url, self.ca_cert, user="nobody")
        return str(path)

    # -- raw connections

    def connect(self, *, cert: Path | None = None, key: Path | None = None) -> RawConnection:
        ctx = self.pki.client_ssl_context(cert, key)
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=RAW_TIMEOUT_SECONDS)
        try:
            tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
        except BaseException:
            sock.close()
            raise
        return RawConnection(tls, f"127.0.0.1:{self.port}")


def read_lines(proc: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    """The first `count` lines of a running process's stdout, waiting at most `timeout`."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buffer = b""
    while buffer.count(b"\n") < count:
        left = deadline - time.monotonic()
        readable, _, _ = select.select([fd], [], [], max(left, 0))
        chunk = os.read(fd, 65536) if readable else b""
        if not chunk:
            raise AssertionError(f"{count} lines not read within {timeout} s: {buffer!r}")
        buffer += chunk
    return buffer.decode().split("\n")[:count]


@contextlib.contextmanager
def running_gateway(extra_args: Sequence[str] = ()) -> Iterator[Gateway]:
    """`podgate up` on a fresh state directory with the sample pods of `write_examples`
    (and `extra_args` for it)."""
    # Short: the runtime puts unix sockets under <state>/run/<64 hex>/ (108-byte limit).
    root = Path(tempfile.mkdtemp(prefix="pgw", dir="/tmp"))
    state = root / "s"
    examples = root / "ex"
    write_examples(examples)
    log_path = root / "up.log"
    argv = [sys.executable, "-m", "podgate", "up", "--state-dir", str(state), "--port", "0"]
    argv += ["--examples", str(examples), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not (m := READY_LINE.search(log_path.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"podgate up not ready (rc={proc.poll()}):\n{log_path.read_text()}"
                )
            time.sleep(POLL_SECONDS)
        port = int(m[1].rsplit(":", 1)[1])
        gateway = Gateway(proc, root, state, log_path, m[1], port, m[2], m[3])
        yield gateway
    finally:
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
            try:
                returncode = proc.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_SECONDS)
                raise AssertionError(
                    f"podgate up ignored SIGTERM for {STOP_TIMEOUT_SECONDS} s:\n"
                    f"{log_path.read_text(errors='replace')}"
                ) from None
            assert returncode == 0, f"podgate up exited {returncode}:\n{log_path.read_text()}"
            # The pods go with it (no --keep-pods): no holder or shim may remain.
            assert processes_mentioning(str(state)) == [], "processes left behind"
        finally:
            shutil.rmtree(root, ignore_errors=True)


# --- raw HTTP/1.1 over TLS --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RawConnection:
    """One TLS connection to the gateway, speaking HTTP/1.1 by hand."""

    def __init__(self, sock: ssl.SSLSocket, host: str) -> None:
        self.sock = sock
        self.host = host
        self._buffer = bytearray()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    @property
    def local_address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(
        self, method: str, target: str, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
    ) -> bytes:
        """The bytes of a request (not sent)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if body or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _fill(self) -> bool:
        try:
            chunk = self.sock.recv(MAX_HEAD_BYTES)
        except (ConnectionResetError, ssl.SSLError):
            chunk = b""
        self._buffer += chunk
        return bool(chunk)

    def read_response(self) -> Response | None:
        """The next response; None if the gateway closed the connection instead."""
        while b"\r\n\r\n" not in self._buffer:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise AssertionError(f"response head too long: {bytes(self._buffer[:200])!r}")
            if not self._fill():
                if self._buffer:
                    raise AssertionError(f"connection closed mid-response: {self._buffer!r}")
                return None
        head, _, rest = bytes(self._buffer).partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self._buffer = bytearray(rest)
        if status == 101:
            return Response(status, headers, b"")
        length = int(headers.get("content-length", "0"))
        while len(self._buffer) < length:
            if not self._fill():
                raise AssertionError(f"body cut short: {bytes(self._buffer)!r}")
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return Response(status, headers, body)

    def exchange(
        self, method: str, target: str, headers: Sequence[tuple[str, str]] = ()
    ) -> Response | None:
        self.send(self.request(method, target, headers))
        return self.read_response()


# A fixed key is fine: the server only hashes it into Sec-WebSocket-Accept (RFC 6455 §4.2.2).
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


def websocket_headers(protocol: str) -> list[tuple[str, str]]:
    """The upgrade headers kubectl sends (kubectl-api-surface.md §5.1, §5.3)."""
    return [
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", WS_KEY),
        ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Protocol", protocol),
    ]


def spdy_headers(protocols: Sequence[str]) -> list[tuple[str, str]]:
    """The SPDY upgrade headers kubectl sends (kubectl-api-surface.md §5.2, §5.4)."""
    return [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")] + [
        ("X-Stream-Protocol-Version", p) for p in protocols
    ]


def exec_target(pod: str, command: Sequence[str], *, stdout: bool = True) -> str:
    query = "&".join(f"command={c}" for c in command)
    return f"/api/v1/namespaces/default/pods/{pod}/exec?{query}&stdout={str(stdout).lower()}"


# --- listening sockets ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listener:
    family: str  # "tcp" or "tcp6"
    address: str
    port: int


def _decode_address(hex_address: str) -> tuple[str, int]:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order.
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, swapped), int(port_hex, 16)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listening_sockets(pid: int) -> list[Listener]:
    """Every listening TCP socket the process holds, as its network namespace lists them."""
    inodes = _socket_inodes(pid)
    found = []
    for family in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{family}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            # fields: sl local remote state ... uid timeout inode
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A = TCP_LISTEN
                host, port = _decode_address(fields[1])
                found.append(Listener(family, host, port))
    return found


def child_pids(pid: int) -> list[int]:
    """Direct and indirect children of `pid`."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
