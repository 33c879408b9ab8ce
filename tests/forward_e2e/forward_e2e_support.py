"""Helpers for the `podgate port-forward` acceptance tests (imported by module name; keep the
name unique).

The stack is real and split in two processes, so the gateway can be restarted on its own:
`podgate runtime` (its own short state directory under /tmp) and `podgate node` in front of its
CRI socket, on a fixed free port and a fixed state directory, so the kubeconfigs it wrote stay
valid across restarts. Pods are made over CRI with a synchronous client; their servers are
containers that can be stopped (a crash, as far as a client can tell) and started again.
`podgate port-forward --json` runs as a child process whose event lines are read by a thread.
Every wait is bounded; every process is stopped by its PID and every directory removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from e2e_support import Forwarder, Kubectl, kubectl_binary
from gateway_support import AuditLog
from runtime_e2e_support import (
    REMOVE_TIMEOUT_SECONDS,
    RuntimeDaemon,
    channel_options,
    kill_recorded_processes,
    new_state_root,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.node.pki import write_kubeconfig

REPO = Path(__file__).resolve().parents[2]

# Whether the slow tests run at full size (1 GiB, 100,000 queries) or the bounded one.
FULL = os.environ.get("PODGATE_FULL_ACCEPTANCE") == "1"

# `podgate node`: interpreter start, PKI on first start, the first CRI call.
NODE_READY_SECONDS = 30.0
# After SIGTERM, how long a child may take to exit before it gets SIGKILL.
STOP_GRACE_SECONDS = 10.0
# One CRI call (RunPodSandbox starts a holder; a sandboxed pod also its shim and agent).
CRI_TIMEOUT_SECONDS = 60.0
# A container's server printing its ready line into the CRI log.
SERVER_READY_SECONDS = 20.0
# `podgate port-forward` from start to its listeners (kubeconfig, pod GET, first session).
FORWARD_READY_SECONDS = 30.0
# Any one event the tests wait for (a reconnect includes the client's backoff).
EVENT_SECONDS = 30.0
# Poll period for files and logs.
POLL_SECONDS = 0.05
# Lines of a child's stderr quoted in a failure message.
TAIL_LINES = 15
# Read size for a child's pipes and for forwarded connections.
READ_BYTES = 256 * 1024
# Bulk test data is made and sent a MiB at a time: bounded memory whatever the size.
KEYSTREAM_CHUNK_BYTES = 1024 * 1024
# Write size of a Pusher (an active connection): many SPDY frames per MiB.
PUSH_CHUNK_BYTES = 64 * 1024

NODE_READY_LINE = re.compile(
    r"^podgate node ready api=(?P<api>\S+) runtime=.* kubeconfig=(?P<kubeconfig>\S+)$",
    re.MULTILINE,
)

# The server in the test pods, bound to the pod's own 127.0.0.1: 7000 echoes until the
# client's EOF; 7001 reads to EOF and answers with the sha256 hex digest of what it read;
# 7002 answers "<token> <hostname>\n" (which container of which pod this is) and closes;
# 7003 accepts and never reads (a busy server: what a client sends piles up in the pod, so a
# crash resets the connection instead of closing it), logging "held N" for its N-th client.
# argv[1] is the token. SIGTERM ends it at once, as a crash would for its clients.
ECHO_PORT = 7000
SINK_PORT = 7001
IDENT_PORT = 7002
HOLD_PORT = 7003
POD_SERVER = string.Template("""\
import hashlib, os, signal, socket, sys, threading
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
token = sys.argv[1]
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
def ident(c):
    with c:
        c.sendall(f"{token} {socket.gethostname()}\\n".encode())
held = []
def hold(c):
    held.append(c)
    print("held", len(held), flush=True)
def serve(s, handler):
    while True:
        c, _ = s.accept()
        threading.Thread(target=handler, args=(c,), daemon=True).start()
servers = [(socket.create_server(("127.0.0.1", p)), h)
           for p, h in (($echo, echo), ($sink, sink), ($ident, ident), ($hold, hold))]
for s, h in servers[1:]:
    threading.Thread(target=serve, args=(s, h), daemon=True).start()
print("listening", token, flush=True)
serve(*servers[0])
""").substitute(echo=ECHO_PORT, sink=SINK_PORT, ident=IDENT_PORT, hold=HOLD_PORT)

# The DNS server in the DNS pods: dnsmasq on the pod's 127.0.0.1 only, answering A queries
# for *.podgate.test with DNS_ANSWER from its own configuration; no upstream servers, no
# /etc/hosts, no config file, so nothing leaves the pod and nothing else answers.
DNS_PORT = 5353
DNS_DOMAIN = "podgate.test"
DNS_ANSWER = "10.1.2.3"
DNSMASQ = "/usr/sbin/dnsmasq"
DNSMASQ_ARGV = (
    DNSMASQ,
    "--no-daemon",
    f"--port={DNS_PORT}",
    "--listen-address=127.0.0.1",
    "--bind-interfaces",
    "--no-resolv",
    "--no-hosts",
    f"--address=/{DNS_DOMAIN}/{DNS_ANSWER}",
    "--conf-file=/dev/null",
    "--user=root",
)
# dnsmasq logs this (to stderr, hence the CRI log) once its sockets are bound.
DNSMASQ_READY = b"started, version"

SANDBOXED = "sandboxed"


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_pid(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    """Signal the child by its PID, then SIGKILL after a grace period; returns its status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_GRACE_SECONDS)
    return proc.returncode


# --------------------------------------------------------------------------- the gateway


class NodeGateway:
    """`podgate node` on a fixed port and state directory: stop it and start it again, and
    the kubeconfigs, tokens and policy it wrote stay valid."""

    def __init__(self, state_dir: Path, cri_socket: str, log_path: Path) -> None:
        self.state_dir = state_dir
        self.cri_socket = cri_socket
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.kubeconfig = ""

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        argv = [sys.executable, "-m", "podgate", "node", "--state-dir", str(self.state_dir)]
        argv += ["--cri-socket", self.cri_socket, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO
            )
        deadline = time.monotonic() + NODE_READY_SECONDS
        while not (m := NODE_READY_LINE.search(self._log_from(offset))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop_pid(self.proc)
                raise AssertionError(
                    f"podgate node not ready (rc={self.proc.returncode}):\n"
                    f"{tail(self._log_from(offset), 40)}"
                )
            time.sleep(POLL_SECONDS)
        self.url, self.kubeconfig = m["api"], m["kubeconfig"]
        assert self.url.endswith(f":{self.port}"), self.url

    def _log_from(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> int:
        """SIGTERM by PID; the exit status."""
        assert self.proc is not None
        return stop_pid(self.proc)

    def log_text(self) -> str:
        return self._log_from(0)

    @property
    def audit(self) -> AuditLog:
        return AuditLog(self.state_dir / "audit.log")

    @property
    def token_file(self) -> Path:
        return self.state_dir / "tokens.csv"

    @property
    def ca_cert(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    def add_user(self, name: str, groups: Sequence[str] = ()) -> str:
        """A bearer token for a new user (the gateway re-reads the token file) and a
        kubeconfig with it; the default policy gives such a user nothing."""
        token = uuid.uuid4().hex
        with open(self.token_file, "a") as f:
            f.write(f'{token},{name},{name},"{",".join(groups)}"\n')
        path = self.state_dir.parent / f"kubeconfig-{name}"
        write_kubeconfig(path, self.url, self.ca_cert, user=name, token=token)
        return str(path)


# --------------------------------------------------------------------------- pods over CRI


@dataclass
class Pod:
    id: str
    config: pb.PodSandboxConfig
    handler: str = ""

    @property
    def name(self) -> str:
        return str(self.config.metadata.name)

    @property
    def namespace(self) -> str:
        return str(self.config.metadata.namespace)

    @property
    def uid(self) -> str:
        return str(self.config.metadata.uid)


class CriPods:
    """Pods and containers through the runtime's CRI socket (synchronous calls, each with a
    deadline); `remove_all` removes every pod made here that still exists."""

    def __init__(self, cri_socket: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{cri_socket}", options=channel_options())
        self.rt = pb_grpc.RuntimeServiceStub(self.channel)
        self.made: list[str] = []

    def run_pod(self, namespace: str, name: str, *, handler: str = "", hostname: str = "") -> Pod:
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=namespace, uid=uuid.uuid4().hex, attempt=0
            ),
            hostname=hostname or name,
        )
        reply = self.rt.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config, runtime_handler=handler),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        self.made.append(reply.pod_sandbox_id)
        return Pod(reply.pod_sandbox_id, config, handler)

    def start(
        self, pod: Pod, name: str, argv: Sequence[str], ready: bytes, *, attempt: int = 0
    ) -> str:
        """Create and start a container; returns once its CRI log holds `ready`."""
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name, attempt=attempt), command=list(argv)
        )
        reply = self.rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            ),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        container_id = str(reply.container_id)
        self.rt.StartContainer(
            pb.StartContainerRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
        )
        self.wait_log(container_id, ready)
        return container_id

    def server(self, pod: Pod, token: str, *, attempt: int = 0) -> str:
        """POD_SERVER as container "srv", answering IDENT_PORT with `token`."""
        argv = [sys.executable, "-c", POD_SERVER, token]
        return self.start(pod, "srv", argv, f"listening {token}".encode(), attempt=attempt)

    def dnsmasq(self, pod: Pod) -> str:
        return self.start(pod, "dns", DNSMASQ_ARGV, DNSMASQ_READY)

    def wait_log(self, container_id: str, needle: bytes) -> bytes:
        status = self.status(container_id)
        path = Path(status.log_path)
        deadline = time.monotonic() + SERVER_READY_SECONDS
        data = b""
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                data = path.read_bytes()
            if needle in data:
                return data
            if self.status(container_id).state == pb.CONTAINER_EXITED:
                break
            time.sleep(POLL_SECONDS)
        raise AssertionError(f"container never logged {needle!r}; its log:\n{data[-2000:]!r}")

    def status(self, container_id: str) -> pb.ContainerStatus:
        return self.rt.ContainerStatus(
            pb.ContainerStatusRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
        ).status

    def kill(self, container_id: str) -> None:
        """StopContainer with no grace: the server dies with its connections open."""
        self.rt.StopContainer(
            pb.StopContainerRequest(container_id=container_id, timeout=0),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        assert self.status(container_id).state == pb.CONTAINER_EXITED

    def remove_container(self, container_id: str) -> None:
        self.rt.RemoveContainer(
            pb.RemoveContainerRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
        )

    def remove_pod(self, pod: Pod) -> None:
        self.rt.RemovePodSandbox(
            pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=REMOVE_TIMEOUT_SECONDS
        )
        if pod.id in self.made:
            self.made.remove(pod.id)

    def remove_all(self) -> None:
        for pod_id in list(self.made):
            with contextlib.suppress(grpc.RpcError):
                self.rt.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id),
                    timeout=REMOVE_TIMEOUT_SECONDS,
                )
        self.made.clear()

    def close(self) -> None:
        self.channel.close()


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """The runtime, the gateway in front of it, and a CRI client for pods."""

    root: Path
    runtime: RuntimeDaemon
    node: NodeGateway
    pods: CriPods
    homes: Path = field(init=False)

    def __post_init__(self) -> None:
        self.homes = self.root / "homes"
        self.homes.mkdir(exist_ok=True)

    def kubectl(self, kubeconfig: str = "", version: str = "1.33") -> Kubectl:
        return Kubectl(kubectl_binary(version), kubeconfig or self.node.kubeconfig, self.homes)

    def namespace(self) -> str:
        """A namespace of the caller's own, so tests never see each other's pods."""
        return f"fwd-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def running_stack() -> Iterator[Stack]:
    """`podgate runtime` and `podgate node` on fresh state; everything is gone afterwards."""
    # Short: the runtime puts unix sockets under <state>/run/<64 hex>/ (108-byte limit).
    root = new_state_root()
    runtime: RuntimeDaemon | None = None
    node: NodeGateway | None = None
    pods: CriPods | None = None
    stack: Stack | None = None
    try:
        runtime = RuntimeDaemon.start(root / "s", root / "runtime.log")
        node = NodeGateway(root / "node", runtime.cri_socket, root / "node.log")
        node.start()
        pods = CriPods(runtime.cri_socket)
        stack = Stack(root, runtime, node, pods)
        yield stack
    finally:
        if stack is not None:
            runtime = stack.runtime  # a test may have restarted it
        try:
            if node is not None and node.proc is not None:
                node.stop()
            if pods is not None:
                pods.remove_all()
                pods.close()
        finally:
            if runtime is not None:
                runtime.terminate()
            kill_recorded_processes(root / "s")
            shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- podgate port-forward


class PodgateForward:
    """A running `podgate port-forward --json`: its event lines parsed as they arrive, its
    stderr kept, and the process stopped by PID at the end."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        self.events: list[dict[str, Any]] = []
        self.other_stdout: list[str] = []
        self._stderr = bytearray()
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            with self._changed:
                try:
                    event = json.loads(line)
                except ValueError:
                    event = None
                if isinstance(event, dict):
                    self.events.append(event)
                elif line:
                    self.other_stdout.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, READ_BYTES):
            with self._changed:
                self._stderr += chunk

    @property
    def stderr(self) -> str:
        with self._changed:
            return self._stderr.decode(errors="replace")

    def describe(self) -> str:
        with self._changed:
            events = "\n".join(json.dumps(e) for e in self.events[-40:])
        return (
            f"rc={self.proc.poll()}\nevents (last 40):\n{events}\n"
            f"other stdout: {self.other_stdout[-10:]}\nstderr:\n{tail(self.stderr)}"
        )

    def mark(self) -> int:
        with self._changed:
            return len(self.events)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self._changed:
            return list(self.events[mark:])

    def wait_event(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        mark: int = 0,
        timeout: float = EVENT_SECONDS,
    ) -> dict[str, Any]:
        """The first event after `mark` matching `predicate`; fails if the process ends or
        the time runs out first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events[mark:]:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._readers[0].is_alive()):
                    break
                self._changed.wait(min(left, 0.1))
        raise AssertionError(f"no matching event within {timeout} s:\n{self.describe()}")

    def local_port(self, remote: int, protocol: str = "tcp") -> int:
        """The local port of the listener for `remote` (from its "listening" event)."""
        event = self.wait_event(
            lambda e: (
                e.get("event") == "listening"
                and e.get("remote") == remote
                and e.get("protocol", "tcp") == protocol
            ),
            timeout=FORWARD_READY_SECONDS,
        )
        host, _, port = str(event["local"]).rpartition(":")
        assert host in ("127.0.0.1", "[127.0.0.1]"), event
        return int(port)

    def wait_exit(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"podgate port-forward still running after {timeout} s:\n{self.describe()}"
            ) from None
        self.join()
        return code

    def interrupt(self) -> int:
        """SIGINT (Ctrl-C) by PID; the exit status."""
        code = stop_pid(self.proc, signal.SIGINT)
        self.join()
        return code

    def join(self) -> None:
        for reader in self._readers:
            reader.join(STOP_GRACE_SECONDS)

    def close(self) -> None:
        stop_pid(self.proc)
        self.join()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def forward_env(home_root: Path) -> dict[str, str]:
    """No inherited KUBECONFIG and an empty HOME: only --kubeconfig counts."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    home = home_root / f"home-{uuid.uuid4().hex[:8]}"
    home.mkdir()
    env["HOME"] = str(home)
    return env


@contextlib.contextmanager
def podgate_forward(
    stack: Stack,
    target: str,
    ports: Sequence[str],
    *,
    namespace: str,
    kubeconfig: str = "",
    extra: Sequence[str] = (),
    wait_ready: bool = True,
) -> Iterator[PodgateForward]:
    """`podgate port-forward TARGET PORTS -n NS --kubeconfig K --json`; with `wait_ready`,
    yields once every port pair has its listener."""
    argv = [sys.executable, "-m", "podgate", "port-forward", target, *ports]
    argv += ["-n", namespace, "--kubeconfig", kubeconfig or stack.node.kubeconfig, "--json"]
    argv += list(extra)
    forward = PodgateForward(argv, forward_env(stack.homes))
    try:
        if wait_ready:
            for spec in ports:
                remote, _, protocol = spec.rpartition(":")[2].partition("/")
                forward.local_port(int(remote), protocol or "tcp")
        yield forward
    finally:
        forward.close()


@contextlib.contextmanager
def kubectl_forward(
    kubectl: Kubectl, namespace: str, pod: str, local: int, remote: int
) -> Iterator[Forwarder]:
    """`kubectl port-forward -n NS pod/POD LOCAL:REMOTE`, ready once this yields."""
    args = ["port-forward", "-n", namespace, f"pod/{pod}", f"{local}:{remote}"]
    proc = subprocess.Popen(
        kubectl.argv(args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kubectl.environ(),
    )
    forwarder = Forwarder(proc, local, remote)
    try:
        forwarder.wait_ready(FORWARD_READY_SECONDS)
        yield forwarder
    finally:
        stop_pid(proc)
        forwarder.join_readers()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


# --------------------------------------------------------------------------- TCP traffic


def ident(port: int, timeout: float = EVENT_SECONDS) -> str:
    """What IDENT_PORT answers through a forward: "<token> <hostname>"."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        data = bytearray()
        while chunk := sock.recv(READ_BYTES):
            data += chunk
    return data.decode().strip()


class Keystream:
    """Deterministic pseudo-random bytes (AES-CTR under a random key): the same bytes for
    every reader made from one instance, produced chunk by chunk, never all in memory."""

    def __init__(self) -> None:
        self.key = os.urandom(16)
        self.nonce = os.urandom(16)

    def chunks(self, size: int) -> Iterator[bytes]:
        encryptor = Cipher(algorithms.AES(self.key), modes.CTR(self.nonce)).encryptor()
        zeros = bytes(KEYSTREAM_CHUNK_BYTES)
        left = size
        while left > 0:
            n = min(left, KEYSTREAM_CHUNK_BYTES)
            yield encryptor.update(zeros[:n])
            left -= n


@dataclass(frozen=True, slots=True)
class SinkResult:
    sent: int
    sent_sha256: str
    reply: bytes  # what the sink answered: the hex digest of what it received
    seconds: float


def send_to_sink(port: int, stream: Keystream, size: int, timeout: float) -> SinkResult:
    """Send `size` bytes of `stream` to the sink through a forward, half-close, read the
    sink's digest; bounded by `timeout` (socket timeouts on every call)."""
    digest = hashlib.sha256()
    started = time.monotonic()
    deadline = started + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sent = 0
        for chunk in stream.chunks(size):
            if time.monotonic() > deadline:
                raise AssertionError(f"sending timed out after {sent} of {size} bytes")
            sock.sendall(chunk)
            digest.update(chunk)
            sent += len(chunk)
        sock.shutdown(socket.SHUT_WR)
        reply = bytearray()
        while chunk := sock.recv(READ_BYTES):
            reply += chunk
            if len(reply) > 4096:
                break
    return SinkResult(sent, digest.hexdigest(), bytes(reply), time.monotonic() - started)


class Pusher:
    """One connection that writes `limit` bytes to a server in a thread, then waits for the
    connection to end: an active session for a server to die under. `outcome` says how the
    connection ended ("eof", "received ...", or the error)."""

    def __init__(self, port: int, limit: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=EVENT_SECONDS)
        self.limit = limit
        self.sent = 0
        self.outcome = ""
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._push, daemon=True)
        self._thread.start()

    @property
    def peer(self) -> str:
        """The client's own address, as the forward's events name it ("peer")."""
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def _push(self) -> None:
        chunk = os.urandom(PUSH_CHUNK_BYTES)
        try:
            while self.sent < self.limit and not self._stop.is_set():
                self.sock.sendall(chunk)
                self.sent += len(chunk)
            while not self._stop.is_set():
                readable, _, _ = select.select([self.sock], [], [], POLL_SECONDS)
                if readable:
                    data = self.sock.recv(READ_BYTES)
                    self.outcome = f"received {data[:80]!r}" if data else "eof"
                    return
            self.outcome = "stopped"
        except OSError as exc:
            self.outcome = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def wait_sent(self, timeout: float = EVENT_SECONDS) -> None:
        """Until all `limit` bytes are written (and the connection is still open)."""
        deadline = time.monotonic() + timeout
        while self.sent < self.limit and not self.done.is_set():
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.sent} bytes sent within {timeout} s")
            time.sleep(POLL_SECONDS)
        assert not self.done.is_set(), f"the connection ended early: {self.outcome}"

    def wait_end(self, timeout: float = EVENT_SECONDS) -> str:
        """How the connection ended; fails if it is still open after `timeout`."""
        assert self.done.wait(timeout), f"connection still open after {timeout} s"
        return self.outcome

    def close(self) -> None:
        self._stop.set()
        self._thread.join(STOP_GRACE_SECONDS)
        self.sock.close()


def echo_roundtrip(port: int, data: bytes, timeout: float = EVENT_SECONDS) -> str:
    """Send `data` to the echo server through a forward, read it all back; the sha256 hex of
    what came back."""
    digest = hashlib.sha256()
    got = 0
    errors: list[BaseException] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:

        def send() -> None:
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                errors.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        while chunk := sock.recv(READ_BYTES):
            digest.update(chunk)
            got += len(chunk)
        sender.join(timeout)
    if errors:
        raise errors[0]
    assert got == len(data), f"echoed {got} of {len(data)} bytes"
    return digest.hexdigest()


# --------------------------------------------------------------------------- DNS over UDP

DNS_HEADER = struct.Struct(">HHHHHH")
DNS_TYPE_A = 1
DNS_CLASS_IN = 1
DNS_FLAG_QR = 0x8000
DNS_FLAG_RD = 0x0100
DNS_RCODE_MASK = 0x000F
# Queries in flight at once: a window keeps the sender from overrunning any socket buffer.
DNS_WINDOW = 64
# No reply at all for this long ends the run (the rest count as lost).
DNS_STALL_SECONDS = 5.0
MAX_DNS_BYTES = 512


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\x00")


def dns_query(query_id: int, name: str) -> bytes:
    """A standard query (RFC 1035 §4.1): one question, type A, class IN, recursion desired."""
    header = DNS_HEADER.pack(query_id, DNS_FLAG_RD, 1, 0, 0, 0)
    return header + encode_name(name) + struct.pack(">HH", DNS_TYPE_A, DNS_CLASS_IN)


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """A possibly compressed name (RFC 1035 §4.1.4); returns it and the offset after it."""
    labels: list[str] = []
    end = -1
    for _ in range(128):  # bounded: a pointer loop is a malformed message
        length = message[offset]
        if length & 0xC0 == 0xC0:
            if end < 0:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | message[offset + 1]
            continue
        if length == 0:
            return ".".join(labels), (end if end >= 0 else offset + 1)
        labels.append(message[offset + 1 : offset + 1 + length].decode("ascii"))
        offset += 1 + length
    raise ValueError("name compression loop")


@dataclass(frozen=True, slots=True)
class DnsReply:
    id: int
    flags: int
    question: tuple[str, int, int]
    answers: tuple[tuple[str, int, int, bytes], ...]  # name, type, class, rdata


def parse_reply(message: bytes) -> DnsReply:
    qid, flags, qdcount, ancount, _, _ = DNS_HEADER.unpack_from(message)
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    name, offset = _read_name(message, DNS_HEADER.size)
    qtype, qclass = struct.unpack_from(">HH", message, offset)
    offset += 4
    answers = []
    for _ in range(ancount):
        rname, offset = _read_name(message, offset)
        rtype, rclass, _ttl, rdlength = struct.unpack_from(">HHIH", message, offset)
        offset += 10
        answers.append((rname, rtype, rclass, message[offset : offset + rdlength]))
        offset += rdlength
    return DnsReply(qid, flags, (name, qtype, qclass), tuple(answers))


def query_name(n: int) -> str:
    return f"q{n}.{DNS_DOMAIN}"


@dataclass
class DnsRun:
    """What a windowed run of queries got back."""

    sent: int = 0
    matched: int = 0
    query_bytes: int = 0
    reply_bytes: int = 0
    seconds: float = 0.0
    peer: str = ""  # the client socket's address, as the forward's events name it
    mismatched: list[str] = field(default_factory=list)  # replies that fit no query in flight
    lost: list[int] = field(default_factory=list)  # query numbers never answered

    def problems(self) -> str:
        return (
            f"sent {self.sent}, matched {self.matched}, lost {len(self.lost)} "
            f"(first {self.lost[:10]}), mismatched {len(self.mismatched)} "
            f"(first {self.mismatched[:5]})"
        )


def run_dns_queries(
    port: int, count: int, *, window: int = DNS_WINDOW, timeout: float = 120.0
) -> DnsRun:
    """`count` A queries for q<N>.podgate.test to 127.0.0.1:port, at most `window` in flight,
    ids N mod 2^16 (distinct among those in flight). A reply is matched when its id, its
    question (name, A, IN), QR set, rcode 0, and exactly one answer (the name, A, IN,
    DNS_ANSWER) fit a query in flight; anything else is recorded as mismatched."""
    expected_rdata = socket.inet_aton(DNS_ANSWER)
    run = DnsRun()
    in_flight: dict[int, int] = {}  # id -> query number
    started = time.monotonic()
    deadline = started + timeout
    next_n = 0
    last_reply = started
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        host, local_port = sock.getsockname()[:2]
        run.peer = f"{host}:{local_port}"
        while next_n < count or in_flight:
            while next_n < count and len(in_flight) < window:
                query_id = next_n % 0x10000
                assert query_id not in in_flight, "id reused while in flight"
                query = dns_query(query_id, query_name(next_n))
                sock.send(query)
                in_flight[query_id] = next_n
                run.sent += 1
                run.query_bytes += len(query)
                next_n += 1
            now = time.monotonic()
            if now > deadline or now - last_reply > DNS_STALL_SECONDS:
                break
            readable, _, _ = select.select([sock], [], [], 0.1)
            if not readable:
                continue
            while True:
                try:
                    message = sock.recv(MAX_DNS_BYTES)
                except BlockingIOError:
                    break
                last_reply = time.monotonic()
                run.reply_bytes += len(message)
                problem = _check_reply(message, in_flight, expected_rdata)
                if problem:
                    run.mismatched.append(problem)
                else:
                    run.matched += 1
    run.seconds = time.monotonic() - started
    run.lost = sorted(in_flight.values())
    return run


def _check_reply(message: bytes, in_flight: dict[int, int], rdata: bytes) -> str:
    """ "" if `message` answers a query in flight (which is then removed), else what is wrong."""
    try:
        reply = parse_reply(message)
    except (ValueError, IndexError, struct.error) as exc:
        return f"unparsable ({exc}): {message[:40].hex()}"
    n = in_flight.get(reply.id)
    if n is None:
        return f"id {reply.id} not in flight"
    name = query_name(n)
    if reply.question != (name, DNS_TYPE_A, DNS_CLASS_IN):
        return f"id {reply.id}: question {reply.question}, sent {name}"
    if not reply.flags & DNS_FLAG_QR or reply.flags & DNS_RCODE_MASK:
        return f"id {reply.id}: flags {reply.flags:#06x}"
    if reply.answers != ((name, DNS_TYPE_A, DNS_CLASS_IN, rdata),):
        return f"id {reply.id}: answers {reply.answers}"
    del in_flight[reply.id]
    return ""
