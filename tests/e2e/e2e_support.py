"""Helpers for the end-to-end tests (imported by module name; keep the name unique).

Real kubectl binaries run against the demo API with a fresh HOME per run (no discovery cache
carries over), a timeout on every wait, and every process reaped by its PID whatever happens.
Traffic helpers move random bytes through real sockets and hash what comes back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import termios
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

# A kubectl exec/attach run; they finish in well under a second on loopback.
KUBECTL_TIMEOUT_SECONDS = 30.0
# From starting `kubectl port-forward` to its "Forwarding from" line (discovery + pod GETs).
FORWARD_READY_SECONDS = 20.0
# After SIGTERM, how long a kubectl may take to exit before it gets SIGKILL.
STOP_GRACE_SECONDS = 5.0
# Receive buffer per recv() on the local end of a forwarded connection.
RECV_BYTES = 256 * 1024
# How much of a received stream is kept verbatim (enough for a hex digest or an error text).
KEEP_HEAD_BYTES = 4096
# Read size for a pty master and for kubectl's output pipes.
PTY_READ_BYTES = 64 * 1024
# After a client is done, how long the server may take to finish its side of the session.
SERVER_FINISH_SECONDS = 10.0


def kubectl_dir() -> Path | None:
    """The directory holding kubectl and its kubectl.1.NN siblings, resolved through links."""
    found = shutil.which("kubectl")
    return Path(os.path.realpath(found)).parent if found else None


def kubectl_binary(version: str) -> str:
    """Path of `kubectl.<version>` next to the kubectl on PATH; skip the test if it is absent."""
    where = kubectl_dir()
    if where is None:
        pytest.skip("kubectl is not on PATH")
    binary = where / f"kubectl.{version}"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"kubectl {version} not installed: no executable {binary.name} in {where}")
    return str(binary)


class Wire(Enum):
    """How an upgrade request asked to be served (what the server saw, not what kubectl says)."""

    WEBSOCKET = "websocket"  # GET + Upgrade: websocket, channel protocol
    TUNNEL = "tunnel"  # GET + Upgrade: websocket, SPDY/3.1+portforward.k8s.io
    SPDY = "spdy"  # POST + Upgrade: SPDY/3.1
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Profile:
    """One kubectl version with its environment, and the transports it must end up on.

    The expected transports are kubectl-api-surface.md §1.2 and §7: a single upgrade per
    session, so a WebSocket attempt that the server refused (and kubectl's SPDY fallback) fails.
    """

    name: str
    version: str
    exec_wire: Wire
    portforward_wire: Wire
    env: tuple[tuple[str, str], ...] = ()


PROFILES = (
    Profile("1.27", "1.27", Wire.SPDY, Wire.SPDY),
    Profile("1.30", "1.30", Wire.WEBSOCKET, Wire.SPDY),
    Profile("1.33", "1.33", Wire.WEBSOCKET, Wire.TUNNEL),
    Profile(
        "1.33-spdy",
        "1.33",
        Wire.SPDY,
        Wire.SPDY,
        env=(
            ("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false"),
            ("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false"),
        ),
    ),
)


def profile_params() -> list[Any]:
    return [pytest.param(p, id=p.name) for p in PROFILES]


def profile_named(name: str) -> Profile:
    (found,) = [p for p in PROFILES if p.name == name]
    return found


# --- what the server was asked ------------------------------------------------------------


@dataclass(slots=True)
class Upgrade:
    """One upgrade request and how the server's handling of it ended."""

    subresource: str
    method: str
    target: str
    wire: Wire
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def classify(method: str, upgrade: str, protocols: str) -> Wire:
    upgrade = upgrade.lower()
    if method == "GET" and upgrade == "websocket":
        return Wire.TUNNEL if "SPDY/3.1+portforward.k8s.io" in protocols else Wire.WEBSOCKET
    if method == "POST" and upgrade.startswith("spdy/3.1"):
        return Wire.SPDY
    return Wire.OTHER


@dataclass
class UpgradeLog:
    """Records every upgrade request the demo API hands to its stream handler, and whether
    the handler returned normally: an exception there is a server bug even when the client
    got what it wanted (asyncio would only log it when the task is collected)."""

    entries: list[Upgrade] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        """Forget everything recorded (after letting running sessions end)."""
        self.settle()
        with self._lock:
            self.entries.clear()

    def wires(self, subresource: str) -> list[Wire]:
        with self._lock:
            return [e.wire for e in self.entries if e.subresource == subresource]

    def targets(self, subresource: str) -> list[str]:
        with self._lock:
            return [e.target for e in self.entries if e.subresource == subresource]

    def settle(self, timeout: float = SERVER_FINISH_SECONDS) -> list[Upgrade]:
        """Wait (at most `timeout`) until the server is done with every recorded session."""
        deadline = time.monotonic() + timeout
        with self._lock:
            entries = list(self.entries)
        for entry in entries:
            entry.finished.wait(max(deadline - time.monotonic(), 0))
        return entries

    def assert_served_cleanly(self, timeout: float = SERVER_FINISH_SECONDS) -> None:
        """Every recorded session has ended on the server, and none of them raised."""
        for entry in self.settle(timeout):
            what = f"{entry.method} {entry.target}"
            assert entry.finished.is_set(), f"server still serving {what} after {timeout} s"
            if entry.error is not None:
                raise AssertionError(f"server failed serving {what}: {entry.error!r}") from (
                    entry.error
                )

    def wrap(self, serve: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def recording(
            conn: Any, handshake: Any, request: Any, what: Any, *args: Any, **kwargs: Any
        ) -> Any:
            entry = Upgrade(
                subresource=request.path.rsplit("/", 1)[-1],
                method=request.method,
                target=request.target,
                wire=classify(
                    request.method,
                    request.header("upgrade") or "",
                    request.header("sec-websocket-protocol") or "",
                ),
            )
            with self._lock:
                self.entries.append(entry)
            try:
                return await serve(conn, handshake, request, what, *args, **kwargs)
            except BaseException as exc:
                entry.error = exc
                raise
            finally:
                entry.finished.set()

        return recording


# --- running kubectl ------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after a grace period; always reaps (by the Popen's PID)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_GRACE_SECONDS)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@dataclass(frozen=True, slots=True)
class Kubectl:
    """One kubectl version pointed at one kubeconfig; each run gets a new empty HOME."""

    binary: str
    kubeconfig: str
    home_root: Path
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def for_profile(cls, profile: Profile, kubeconfig: str, home_root: Path) -> Kubectl:
        return cls(kubectl_binary(profile.version), kubeconfig, home_root, profile.env)

    def environ(self) -> dict[str, str]:
        # Inherited KUBECTL_* switches would silently change which transport is tried.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECTL_")}
        env["HOME"] = tempfile.mkdtemp(prefix="home-", dir=self.home_root)
        env["KUBECONFIG"] = self.kubeconfig
        env.update(self.env)
        return env

    def argv(self, args: Sequence[str]) -> list[str]:
        return [self.binary, *args]

    def run(
        self,
        args: Sequence[str],
        *,
        stdin: bytes = b"",
        timeout: float = KUBECTL_TIMEOUT_SECONDS,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run to completion; subprocess.run kills the child (by PID) if the timeout passes."""
        return subprocess.run(
            self.argv(args),
            input=stdin,
            capture_output=True,
            env=self.environ(),
            timeout=timeout,
            check=False,
        )

    @contextlib.contextmanager
    def popen(self, args: Sequence[str]) -> Iterator[subprocess.Popen[bytes]]:
        """A running kubectl with piped stdout; SIGTERM'd and reaped when the block ends."""
        proc = subprocess.Popen(
            self.argv(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.environ(),
        )
        try:
            yield proc
        finally:
            stop_process(proc)

    @contextlib.contextmanager
    def port_forward(self, pod: str, local_port: int, remote_port: int) -> Iterator[Forwarder]:
        """`kubectl port-forward pod/POD L:R`, ready to accept once this yields."""
        proc = subprocess.Popen(
            self.argv(["port-forward", f"pod/{pod}", f"{local_port}:{remote_port}"]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.environ(),
        )
        forwarder = Forwarder(proc, local_port, remote_port)
        try:
            forwarder.wait_ready(FORWARD_READY_SECONDS)
            yield forwarder
        finally:
            stop_process(proc)
            forwarder.join_readers()

    def pty_session(self, args: Sequence[str], *, rows: int, cols: int) -> PtySession:
        return PtySession(self.argv(args), self.environ(), rows=rows, cols=cols)


class Forwarder:
    """A running `kubectl port-forward`, its output collected by two reader threads."""

    def __init__(self, proc: subprocess.Popen[bytes], local_port: int, remote_port: int) -> None:
        self.proc = proc
        self.local_port = local_port
        self.remote_port = remote_port
        self._stdout = bytearray()
        self._stderr = bytearray()
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, self._stdout), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, self._stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _pump(self, pipe: Any, sink: bytearray) -> None:
        while chunk := pipe.read1(PTY_READ_BYTES):
            with self._changed:
                sink.extend(chunk)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def stdout(self) -> str:
        with self._changed:
            return self._stdout.decode(errors="replace")

    @property
    def stderr(self) -> str:
        with self._changed:
            return self._stderr.decode(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        ready = f"Forwarding from 127.0.0.1:{self.local_port} -> {self.remote_port}".encode()
        deadline = time.monotonic() + timeout
        with self._changed:
            while ready not in self._stdout:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(
                        f"port-forward not ready (rc={self.proc.poll()}):\n"
                        f"stdout: {self._stdout.decode(errors='replace')}\n"
                        f"stderr: {self._stderr.decode(errors='replace')}"
                    )
                self._changed.wait(min(left, 0.1))

    def wait_exit(self, timeout: float) -> int:
        returncode = self.proc.wait(timeout)
        self.join_readers()
        return returncode

    def join_readers(self) -> None:
        for reader in self._readers:
            reader.join(STOP_GRACE_SECONDS)


class PtySession:
    """A process on the slave side of a fresh pty of the given size; we hold the master."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, rows: int, cols: int):
        self.output = bytearray()
        self.eof = False
        master, slave = os.openpty()
        try:
            set_winsize(slave, rows, cols)
            self.proc = subprocess.Popen(
                list(argv),
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=dict(env),
                start_new_session=True,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self.master = master

    def __enter__(self) -> PtySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            stop_process(self.proc)
        finally:
            if self.master >= 0:
                os.close(self.master)
                self.master = -1

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def resize(self, rows: int, cols: int) -> None:
        """What a terminal emulator does: set the size, then SIGWINCH the program."""
        set_winsize(self.master, rows, cols)
        os.kill(self.proc.pid, signal.SIGWINCH)

    def _read_some(self, timeout: float) -> bool:
        """Read what is there (waiting at most `timeout`); False once the pty is closed."""
        if self.eof:
            return False
        readable, _, _ = select.select([self.master], [], [], max(timeout, 0))
        if not readable:
            return True
        try:
            chunk = os.read(self.master, PTY_READ_BYTES)
        except OSError:  # EIO: every slave fd is closed, the program is gone
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.output.extend(chunk)
        return True

    def search(self, pattern: re.Pattern[bytes], timeout: float) -> re.Match[bytes] | None:
        """The first match in everything read so far, reading on for at most `timeout`."""
        deadline = time.monotonic() + timeout
        while (match := pattern.search(self.output)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read_some(left):
                return None
        return match

    def expect(self, pattern: re.Pattern[bytes], timeout: float) -> re.Match[bytes]:
        match = self.search(pattern, timeout)
        if match is None:
            raise AssertionError(
                f"no {pattern.pattern!r} in pty output {bytes(self.output)!r} "
                f"(eof={self.eof}, rc={self.proc.poll()})"
            )
        return match

    def read_to_end(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while self._read_some(deadline - time.monotonic()):
            if time.monotonic() >= deadline:
                raise AssertionError(f"pty still open after {timeout} s: {bytes(self.output)!r}")
        return bytes(self.output)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


# --- moving bytes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Received:
    nbytes: int
    sha256: str
    head: bytes  # the first KEEP_HEAD_BYTES, verbatim


def exchange(sock: socket.socket, data: bytes, timeout: float, *, half_close: bool) -> Received:
    """Send `data` while reading everything back until EOF, concurrently; bounded by `timeout`.

    With half_close the write side is shut down after the data (a sink answers only then);
    without it the caller must stop once it has what it expects, so reading ends at len(data).
    """
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    digest = hashlib.sha256()
    head = bytearray()
    count = 0
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while half_close or count < len(data):
            if time.monotonic() > deadline:
                raise AssertionError(f"exchange timed out after {timeout} s ({count} bytes in)")
            chunk = sock.recv(RECV_BYTES)
            if not chunk:
                break
            digest.update(chunk)
            count += len(chunk)
            if len(head) < KEEP_HEAD_BYTES:
                head.extend(chunk[: KEEP_HEAD_BYTES - len(head)])
    finally:
        sender.join(max(deadline - time.monotonic(), 0.1))
        if sender.is_alive():
            sock.close()  # unblocks sendall
            sender.join(STOP_GRACE_SECONDS)
    if errors:
        raise errors[0]
    return Received(count, digest.hexdigest(), bytes(head))


def exchange_tcp(port: int, data: bytes, timeout: float, *, half_close: bool = True) -> Received:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        return exchange(sock, data, timeout, half_close=half_close)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
