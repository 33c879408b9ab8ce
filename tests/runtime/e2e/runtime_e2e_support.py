"""Helpers for the runtime end-to-end suite (imported by module name; keep the name unique).

A real `podgate runtime` daemon runs as a child process on a unix socket; tests talk to it with
grpc.aio and podgate's own streaming client. Every pod a test creates is removed through CRI,
and whatever survives (a daemon killed mid-test) is SIGKILLed by the identity recorded in the
state directory, never by name.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import grpc.aio

from podgate.aio.errors import ClosedStreamError
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.linux.proc import signal_process
from podgate.model import ProcessRef
from podgate.proto.remotecommand import TerminalSize
from podgate.streaming.client import Endpoint

# sun_path holds 107 bytes and the daemon puts sockets under <state>/run/<64-hex id>/, so the
# state directory must be a short name directly under /tmp (not pytest's long tmp_path).
STATE_PARENT = "/tmp"
STATE_PREFIX = "pge"
# Interpreter start, state load and both servers, on a loaded machine.
READY_TIMEOUT_SECONDS = 30.0
# SIGTERM gives in-flight calls 5 s (service.STOP_GRACE_SECONDS) before the daemon exits.
STOP_TIMEOUT_SECONDS = 15.0
# Removing a pod stops its containers (2 s grace each) and its holder (5 s before SIGKILL).
REMOVE_TIMEOUT_SECONDS = 60.0
# ExecSync answers carry up to 16 MiB per stream; the client must accept more than that.
CLIENT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Default deadline of every CRI call, so a hung daemon fails a test instead of hanging it.
RPC_TIMEOUT_SECONDS = 60.0
# Bound on any single wait for a state change, a log line or output.
WAIT_SECONDS = 15.0
# Poll period while waiting for files and states.
POLL_SECONDS = 0.05
# Namespace of every pod the suite creates.
POD_NAMESPACE = "e2e"

READY_LINE = re.compile(
    r"^podgate runtime ready cri=unix://(?P<cri>\S+) streaming=(?P<streaming>\S+) "
    r"state=(?P<state>\S+)$",
    re.MULTILINE,
)
# A CRI log entry (kubernetes CRI logging design: RFC3339Nano time, stream, P/F tag, content).
# Go's RFC3339Nano drops trailing zeros of the fraction, and the whole fraction when it is 0.
CRI_LOG_LINE = re.compile(
    rb"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<frac>\d{0,8}[1-9]))?Z "
    rb"(?P<stream>stdout|stderr) (?P<tag>[FP]) (?P<msg>[^\n]*)"
)

# A TCP server for a container: `echo` copies its input back; `reply` sends argv[4] and closes.
# It binds exactly the address given (IPv6 sockets are v6-only), then says "listening".
POD_SERVER = r"""
import socket, sys, threading
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
reply = sys.argv[4].encode() if len(sys.argv) > 4 else b""
family = socket.AF_INET6 if ":" in host else socket.AF_INET
server = socket.socket(family, socket.SOCK_STREAM)
if family == socket.AF_INET6:
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
server.bind((host, port))
server.listen(64)
print("listening", host, port, flush=True)

def serve(conn):
    with conn:
        if mode == "echo":
            while data := conn.recv(1 << 20):
                conn.sendall(data)
        else:
            conn.sendall(reply)

while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# Connects to 127.0.0.1:argv[1] from inside a pod; prints what the server sent or "refused".
POD_CLIENT = r"""
import socket, sys
try:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
except ConnectionRefusedError:
    print("refused")
else:
    print(conn.recv(100).decode())
"""


# --------------------------------------------------------------------------- the daemon


@dataclass
class RuntimeDaemon:
    """One `podgate runtime` child process."""

    state_dir: Path
    process: subprocess.Popen[bytes]
    cri_socket: str
    streaming_base: str
    output: Path

    @classmethod
    def start(cls, state_dir: Path, output: Path, extra_args: Sequence[str] = ()) -> RuntimeDaemon:
        """Start the daemon on `state_dir` and wait (bounded) for its ready line."""
        with open(output, "ab") as out:
            start_offset = out.tell()
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "podgate", "runtime", "--state-dir", str(state_dir)),
                    *("--nri-socket", str(state_dir / "nri.sock")),
                    *extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            text = output.read_bytes()[start_offset:].decode(errors="replace")
            found = READY_LINE.search(text)
            if found is not None:
                return cls(state_dir, process, found["cri"], found["streaming"], output)
            if process.poll() is not None or time.monotonic() >= deadline:
                if process.poll() is None:
                    process.kill()
                process.wait()
                raise RuntimeError(f"podgate runtime did not get ready:\n{text[-4000:]}")
            time.sleep(POLL_SECONDS)

    @property
    def cri_target(self) -> str:
        return f"unix://{self.cri_socket}"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[pb_grpc.RuntimeServiceStub]:
        """A grpc.aio RuntimeService client on the daemon's socket (this event loop only)."""
        channel = grpc.aio.insecure_channel(self.cri_target, options=channel_options())
        try:
            yield pb_grpc.RuntimeServiceStub(channel)
        finally:
            await channel.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no cleanup runs in the daemon."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> int:
        """SIGTERM and wait; SIGKILL if it does not stop in time. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def remove_all_pods(self) -> None:
        """RemovePodSandbox for every pod the daemon knows (synchronous: for teardown)."""
        if self.process.poll() is not None:
            return
        with grpc.insecure_channel(self.cri_target, options=channel_options()) as channel:
            stub = pb_grpc.RuntimeServiceStub(channel)
            for pod in stub.ListPodSandbox(pb.ListPodSandboxRequest()).items:
                stub.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id),
                    timeout=REMOVE_TIMEOUT_SECONDS,
                )


def channel_options() -> list[tuple[str, object]]:
    service_config = {
        "methodConfig": [
            {
                "name": [{"service": "runtime.v1.RuntimeService"}],
                "timeout": f"{RPC_TIMEOUT_SECONDS:g}s",
            }
        ]
    }
    return [
        ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES),
        ("grpc.service_config", json.dumps(service_config)),
        ("grpc.enable_retries", 0),
    ]


def new_state_root() -> Path:
    """A fresh short directory for one daemon's state (`s/`) and output (`daemon.log`)."""
    return Path(tempfile.mkdtemp(prefix=STATE_PREFIX, dir=STATE_PARENT))


def kill_recorded_processes(state_dir: Path) -> list[int]:
    """SIGKILL every holder, shim and container process recorded in `state_dir`.

    A record names a process by pid and start time, so a pid reused since is never hit.
    Returns the pids that were still alive.
    """
    killed = []
    for kind in ("pods", "containers"):
        directory = state_dir / kind
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for key in ("process", "shim", "ns_process", "holder"):
                ref = record.get(key)
                if ref and signal_process(ProcessRef(**ref), signal.SIGKILL):
                    killed.append(int(ref["pid"]))
    return killed


def mounts_under(directory: Path, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points at or below `directory` (a pod's pinned namespaces are bind mounts)."""
    prefix = str(directory).rstrip("/") + "/"
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        points = [line.split(" ")[4] for line in f]
    return [p for p in points if p == str(directory) or p.startswith(prefix)]


def unmount_under(directory: Path) -> None:
    """Detach what a failed test left mounted below `directory` (deepest first)."""
    for point in sorted(mounts_under(directory), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@contextlib.contextmanager
def state_root() -> Iterator[Path]:
    """A state root that is emptied of processes, mounts and files on exit."""
    root = new_state_root()
    try:
        yield root
    finally:
        kill_recorded_processes(root / "s")
        unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def running_daemon(root: Path, extra_args: Sequence[str] = ()) -> Iterator[RuntimeDaemon]:
    """A daemon on `root/s`; on exit its pods are removed and it gets SIGTERM."""
    daemon = RuntimeDaemon.start(root / "s", root / "daemon.log", extra_args)
    try:
        yield daemon
    finally:
        try:
            daemon.remove_all_pods()
        finally:
            daemon.terminate()


# --------------------------------------------------------------------------- pods


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The error a CRI call fails with (the test fails if it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def unknown_id() -> str:
    """64 hex digits, shaped like a real id and matching nothing."""
    return uuid.uuid4().hex * 2


@dataclass
class Pod:
    id: str
    config: pb.PodSandboxConfig

    @property
    def uid(self) -> str:
        return self.config.metadata.uid


@dataclass
class Pods:
    """Creates pods and containers through CRI; `remove_all` removes every pod it made."""

    rt: pb_grpc.RuntimeServiceStub
    created: list[str] = field(default_factory=list)

    async def run(
        self,
        name: str,
        *,
        hostname: str = "",
        labels: dict[str, str] | None = None,
        log_directory: str = "",
        runtime_handler: str = "",
        pid_mode: int = pb.POD,
    ) -> Pod:
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=POD_NAMESPACE, uid=uuid.uuid4().hex, attempt=0
            ),
            hostname=hostname,
            labels=labels or {},
            log_directory=log_directory,
        )
        if pid_mode != pb.POD:
            config.linux.security_context.namespace_options.pid = pid_mode
        response = await self.rt.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
        )
        self.created.append(response.pod_sandbox_id)
        return Pod(response.pod_sandbox_id, config)

    async def create(
        self,
        pod: Pod,
        name: str,
        command: Sequence[str],
        *,
        start: bool = True,
        labels: dict[str, str] | None = None,
        log_path: str = "",
        stdin: bool = False,
        stdin_once: bool = False,
        tty: bool = False,
    ) -> str:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            command=list(command),
            labels=labels or {},
            log_path=log_path,
            stdin=stdin,
            stdin_once=stdin_once,
            tty=tty,
        )
        response = await self.rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            )
        )
        if start:
            await self.rt.StartContainer(
                pb.StartContainerRequest(container_id=response.container_id)
            )
        return response.container_id

    async def server(
        self, pod: Pod, name: str, mode: str, host: str, port: int, reply: str = ""
    ) -> str:
        """A container running POD_SERVER; returns once it is listening."""
        argv = [sys.executable, "-c", POD_SERVER, mode, host, str(port)]
        if reply:
            argv.append(reply)
        container_id = await self.create(pod, name, argv)
        await wait_for_log(self.rt, container_id, b"listening")
        return container_id

    async def status(self, container_id: str) -> pb.ContainerStatus:
        response = await self.rt.ContainerStatus(
            pb.ContainerStatusRequest(container_id=container_id)
        )
        return response.status

    async def wait_state(
        self, container_id: str, state: int, timeout: float = WAIT_SECONDS
    ) -> pb.ContainerStatus:
        async with asyncio.timeout(timeout):
            while True:
                status = await self.status(container_id)
                if status.state == state:
                    return status
                await asyncio.sleep(POLL_SECONDS)

    async def remove_all(self) -> None:
        for pod_id in self.created:
            await self.rt.RemovePodSandbox(
                pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=REMOVE_TIMEOUT_SECONDS
            )
        self.created.clear()


async def wait_for_log(
    rt: pb_grpc.RuntimeServiceStub, container_id: str, needle: bytes, timeout: float = WAIT_SECONDS
) -> bytes:
    """Wait until the container's CRI log holds `needle`; returns the log."""
    status = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=container_id))).status
    path = Path(status.log_path)
    async with asyncio.timeout(timeout):
        while True:
            if path.exists() and needle in (data := path.read_bytes()):
                return data
            await asyncio.sleep(POLL_SECONDS)


def parse_cri_log(data: bytes) -> list[tuple[int, str, str, bytes]]:
    """(time in ns since the epoch, stream, tag, content) per line; every line must parse."""
    entries = []
    for line in data.split(b"\n")[:-1]:
        match = CRI_LOG_LINE.fullmatch(line)
        assert match is not None, f"not a CRI log line: {line!r}"
        seconds = calendar.timegm(time.strptime(match["ts"].decode(), "%Y-%m-%dT%H:%M:%S"))
        fraction = int((match["frac"] or b"").decode().ljust(9, "0"))
        entries.append(
            (
                seconds * 1_000_000_000 + fraction,
                match["stream"].decode(),
                match["tag"].decode(),
                match["msg"],
            )
        )
    assert data.endswith(b"\n") or not data, "the log ends in the middle of a line"
    return entries


# --------------------------------------------------------------------------- streaming


def stream_target(url: str) -> tuple[Endpoint, str]:
    """The endpoint and request path of a CRI streaming URL."""
    parsed = urlparse(url)
    assert parsed.scheme == "http", url
    assert parsed.hostname is not None and parsed.port is not None, url
    path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
    return Endpoint(parsed.hostname, parsed.port), path


class Feed(ByteStream):
    """Input for the streaming client: chunks put in by the test, then EOF once closed."""

    def __init__(self, *chunks: bytes, eof: bool = False) -> None:
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        for chunk in chunks:
            self.put(chunk)
        if eof:
            self.close()

    def put(self, data: bytes) -> None:
        assert data, "an empty chunk would read as EOF"
        self._queue.put_nowait(data)

    def close(self) -> None:
        self._queue.put_nowait(b"")

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        chunk = await self._queue.get()
        if not chunk:
            self._queue.put_nowait(b"")  # EOF stays EOF
        return chunk

    async def send(self, data: Buffer) -> None:
        raise ClosedStreamError("a feed is read-only")

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class Sink(ByteStream):
    """Output of the streaming client, kept for the test to inspect."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        raise ClosedStreamError("a sink is write-only")

    async def send(self, data: Buffer) -> None:
        self.data += data
        self._notify()

    async def send_eof(self) -> None:
        self.eof = True
        self._notify()

    async def aclose(self) -> None:
        pass

    async def wait_for(
        self,
        needle: bytes,
        timeout: float = WAIT_SECONDS,
        *,
        session: asyncio.Task[Any] | None = None,
    ) -> None:
        """Until `needle` was written; fails at once if `session` (the writer) ends first."""
        async with asyncio.timeout(timeout):
            while needle not in self.data:
                changed = asyncio.ensure_future(self._changed.wait())
                waiting: set[asyncio.Future[Any]] = {changed}
                if session is not None:
                    waiting.add(session)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if needle not in self.data and session is not None and session.done():
                    raise AssertionError(
                        f"the session ended ({session.result()!r}) before {needle!r} arrived; "
                        f"got {bytes(self.data)!r}"
                    )


class Resizes:
    """Terminal sizes for the streaming client's `resizes=`, pushed by the test."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[TerminalSize | None] = asyncio.Queue()

    def push(self, width: int, height: int) -> None:
        self._queue.put_nowait(TerminalSize(width, height))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def sizes(self) -> AsyncIterator[TerminalSize]:
        while (size := await self._queue.get()) is not None:
            yield size


async def read_all(stream: ByteStream, limit: int = 1 << 20) -> bytes:
    """Everything until EOF (at most `limit` bytes kept)."""
    out = bytearray()
    while chunk := await stream.receive():
        if len(out) < limit:
            out += chunk
    return bytes(out)
