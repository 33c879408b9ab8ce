"""`podgate node` in front of containerd, a CRI runtime that is not podgate's: real kubectl
(every version profile of e2e_support) lists pods that containerd runs, execs into them,
attaches, reads logs and port-forwards.

The gateway only sees containerd through CRI (Version, the pod and container lists and
statuses, Exec/Attach/PortForward URLs) and containerd's own streaming server (plain HTTP
SPDY, its copy of the kubelet's cri/streaming), so this checks podgate's CRI client and its
SPDY client against independent implementations of both. containerd 1.6 offers exec over SPDY
up to v4.channel.k8s.io and port-forward over plain SPDY only, so every kubectl transport
(WebSocket v5, the WebSocket tunnel, SPDY) is translated by the gateway. The pods use the host
network (no CNI needed); the main container is a busybox echo server.

Expected values come from the Kubernetes contract, not from podgate: kubectl exits with the
remote exit code (k8s-streaming.md §4), `sha256sum` prints `<hex>  -` for stdin, and an echo
server returns exactly what it got.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from containerd_support import Containerd, missing_tools, private_containerd
from e2e_support import (
    Kubectl,
    Profile,
    Received,
    exchange_tcp,
    free_port,
    kubectl_binary,
    profile_params,
    sha256_hex,
    stop_process,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="containerd and runc need root"),
]

POD = "ctrd-demo"
NAMESPACE = "default"
CONTAINER = "echo"
MIB = 1024 * 1024
# From starting `podgate node` to its ready line (certificates are made on first start).
NODE_READY_SECONDS = 30.0
# Until the echo server in the container accepts connections.
LISTEN_SECONDS = 20.0
# One forwarded connection's round trip of PORTFORWARD_BYTES through two SPDY hops.
TRANSFER_SECONDS = 60.0
# Big enough for many SPDY frames and flow-control windows each way, small enough to be quick.
PORTFORWARD_BYTES = 4 * MIB
# Forwarded connections open at once over the one upstream session the gateway keeps per pod.
PARALLEL_CONNECTIONS = 3
# Piped to `kubectl exec -i`: several stdin frames and a half-close at the end.
EXEC_STDIN_BYTES = 1 * MIB
# A refused forward closes the local connection, and kubectl exits, within this (~0.1 s here).
REFUSED_SECONDS = 5.0
# One interactive exec: each step waits at most this long.
TTY_SECONDS = 20.0
READY = re.compile(rb"podgate node ready api=(\S+) runtime=(.*?) kubeconfig=(\S+)")


@dataclass(frozen=True, slots=True)
class Stack:
    containerd: Containerd
    sandbox_id: str
    container_id: str
    pod_uid: str
    echo_port: int
    runtime: str  # what the ready line says the runtime is
    kubeconfig: str
    home_root: Path

    @property
    def kubectl(self) -> Kubectl:
        return Kubectl(kubectl_binary("1.33"), self.kubeconfig, self.home_root)

    def kubectl_as(self, profile: Profile) -> Kubectl:
        return Kubectl.for_profile(profile, self.kubeconfig, self.home_root)

    def portforward_calls(self) -> int:
        """CRI PortForward calls containerd has logged so far."""
        log = self.containerd.log_path.read_text(errors="replace")
        return log.count(f'Portforward for \\"{self.sandbox_id}\\" returns URL')


def wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_node(state_dir: Path, cri_socket: Path) -> tuple[Node, re.Match[bytes]]:
    log_path = state_dir.parent / "node.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "podgate",
                "node",
                "--state-dir",
                str(state_dir),
                "--cri-socket",
                str(cri_socket),
                "--port",
                "0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    node = Node(proc, log_path)
    deadline = time.monotonic() + NODE_READY_SECONDS
    while not (match := READY.search(log_path.read_bytes())):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            pytest.fail(f"podgate node printed no ready line:\n{node.log()}")
        time.sleep(0.05)
    return node, match


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tools, why = missing_tools()
    if tools is None:
        pytest.skip(why)
    kubectl_binary("1.33")  # skips early when kubectl is missing
    work = Path(tempfile.mkdtemp(prefix="pgnode"))
    try:
        with private_containerd(tools) as ctrd:
            port = free_port()
            # The kubelet's record of the spec's ports, which containerd hands back verbatim.
            ports = json.dumps([{"containerPort": port, "protocol": "TCP"}])
            pod = ctrd.run_pod(
                POD,
                NAMESPACE,
                ["sh", "-c", f"echo serving on {port}; exec nc -ll -p {port} -e cat"],
                container=CONTAINER,
                annotations={"io.kubernetes.container.ports": ports},
            )
            ctrd.wait_running(pod.container_id)
            wait_listening(port, LISTEN_SECONDS)
            node, ready = start_node(work / "state", ctrd.socket)
            try:
                kubeconfig = ready[3].decode()
                home = work / "homes"
                home.mkdir()
                yield Stack(
                    containerd=ctrd,
                    sandbox_id=pod.sandbox_id,
                    container_id=pod.container_id,
                    pod_uid=pod.uid,
                    echo_port=port,
                    runtime=ready[2].decode(),
                    kubeconfig=kubeconfig,
                    home_root=home,
                )
            finally:
                stop_process(node.proc)
            assert node.proc.returncode == 0, node.log()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def kubectl_ok(stack: Stack, *args: str, stdin: bytes = b"") -> bytes:
    done = stack.kubectl.run(list(args), stdin=stdin)
    assert done.returncode == 0, (args, done.returncode, done.stderr.decode(errors="replace"))
    return done.stdout


def test_node_names_containerd_as_its_runtime(stack: Stack) -> None:
    # containerd's CRI Version answer: RuntimeName "containerd", RuntimeVersion its release.
    name, _, version = stack.runtime.partition(" ")
    assert name == "containerd"
    assert re.match(r"v?\d+\.\d+\.\d+", version), stack.runtime


def test_get_pods_lists_the_containerd_pod_running(stack: Stack) -> None:
    table = kubectl_ok(stack, "get", "pods").decode()
    rows = [line.split() for line in table.splitlines()]
    assert rows[0][:3] == ["NAME", "READY", "STATUS"], table
    (row,) = [r for r in rows[1:] if r[0] == POD]
    assert row[1:3] == ["1/1", "Running"], table

    pod = json.loads(kubectl_ok(stack, "get", "pod", POD, "-o", "json"))
    assert pod["metadata"]["name"] == POD
    assert pod["metadata"]["namespace"] == NAMESPACE
    assert pod["metadata"]["uid"] == stack.pod_uid
    assert pod["status"]["phase"] == "Running"
    (spec,) = pod["spec"]["containers"]
    assert spec["name"] == CONTAINER
    assert spec["ports"] == [{"containerPort": stack.echo_port, "protocol": "TCP"}]
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] is True
    assert status["containerID"].endswith(stack.container_id)


@pytest.mark.parametrize("profile", profile_params())
def test_exec_relays_output_and_exit_code(stack: Stack, profile: Profile) -> None:
    kubectl = stack.kubectl_as(profile)
    done = kubectl.run(["exec", POD, "--", "sh", "-c", "echo hi; echo oops >&2; exit 3"])
    assert done.stdout == b"hi\n"
    assert done.returncode == 3, done.stderr
    # kubectl prints client-go's text for the exit code after the command's own stderr.
    assert done.stderr.splitlines() == [b"oops", b"command terminated with exit code 3"]


@pytest.mark.parametrize("profile", profile_params())
def test_exec_stdin_reaches_the_process_whole(stack: Stack, profile: Profile) -> None:
    kubectl = stack.kubectl_as(profile)
    data = os.urandom(EXEC_STDIN_BYTES)
    done = kubectl.run(["exec", "-i", POD, "--", "sha256sum"], stdin=data)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{sha256_hex(data)}  -\n".encode()


def test_exec_of_a_missing_command_fails_with_the_runtime_error(stack: Stack) -> None:
    done = stack.kubectl.run(["exec", POD, "--", "/no/such/binary"])
    # k8s-streaming.md §4: a runtime failure is an InternalError Status, which kubectl prints
    # as `error: <message>` and exits 1; the message ends in the runtime's (runc's) own text.
    assert (done.returncode, done.stdout) == (1, b"")
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        b"error: Internal error occurred: error executing command in container: "
    ), line
    assert line.endswith(
        b'exec: "/no/such/binary": stat /no/such/binary: no such file or directory: unknown'
    ), line


@pytest.mark.parametrize("profile", profile_params())
def test_exec_tty_sees_the_terminal_size_and_its_changes(stack: Stack, profile: Profile) -> None:
    kubectl = stack.kubectl_as(profile)
    # The first size travels apart from the upgrade (kubectl-api-surface.md §6.1), so the
    # script waits until a size is set (busybox `stty size` prints nothing on stdout while it
    # is 0x0); then for the next one, after our resize.
    script = (
        'until s=$(stty size 2>/dev/null) && [ -n "$s" ]; do sleep 0.05; done; echo "first $s"; '
        'while [ "$(stty size)" = "$s" ]; do sleep 0.05; done; echo "then $(stty size)"; '
        "exit 4"
    )
    args = ["exec", "-it", POD, "--", "sh", "-c", script]
    with kubectl.pty_session(args, rows=33, cols=101) as session:
        first = session.expect(re.compile(rb"first ([^\r]*)\r\n"), TTY_SECONDS)
        assert first[1] == b"33 101", bytes(session.output)
        session.resize(40, 120)
        session.expect(re.compile(rb"then 40 120\r\n"), TTY_SECONDS)
        assert session.wait(TTY_SECONDS) == 4


@pytest.mark.parametrize("profile", profile_params())
def test_attach_relays_stdin_and_output(stack: Stack, profile: Profile) -> None:
    # A pod of its own: its stdin closes after the first attach, and the container exits.
    name = f"ctrd-attach-{profile.name.replace('.', '-')}"
    pod = stack.containerd.run_pod(
        name,
        NAMESPACE,
        ["sh", "-c", 'while read line; do echo "got $line"; done; echo bye'],
        container="reader",
        stdin_once=True,
    )
    stack.containerd.wait_running(pod.container_id)
    done = stack.kubectl_as(profile).run(["attach", "-i", name], stdin=b"a\nb\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"got a\ngot b\nbye\n"


def test_logs_show_the_container_output(stack: Stack) -> None:
    out = kubectl_ok(stack, "logs", POD)
    assert out == f"serving on {stack.echo_port}\n".encode()


@pytest.mark.parametrize("profile", profile_params())
def test_port_forward_echoes_bytes_exactly(stack: Stack, profile: Profile) -> None:
    kubectl = stack.kubectl_as(profile)
    local = free_port()
    payloads = [os.urandom(PORTFORWARD_BYTES) for _ in range(PARALLEL_CONNECTIONS)]
    results: list[Received | BaseException | None] = [None] * len(payloads)

    def run(i: int) -> None:
        try:
            # The echo server answers as bytes arrive; reading stops at len(data), so no
            # half-close is needed (containerd gives the other direction 1 s after one ends).
            results[i] = exchange_tcp(local, payloads[i], TRANSFER_SECONDS, half_close=False)
        except BaseException as exc:
            results[i] = exc

    calls = stack.portforward_calls()
    with kubectl.port_forward(POD, local, stack.echo_port) as forwarder:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(payloads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TRANSFER_SECONDS + 10)
        # One more after the others are done: the gateway's pooled upstream session is reused.
        again = os.urandom(PORTFORWARD_BYTES)
        last = exchange_tcp(local, again, TRANSFER_SECONDS, half_close=False)
        assert forwarder.proc.poll() is None, forwarder.stderr
    for data, got in zip(payloads, results, strict=True):
        if isinstance(got, BaseException):
            raise got
        assert got is not None, "transfer did not finish"
        assert (got.nbytes, got.sha256) == (len(data), sha256_hex(data))
    assert (last.nbytes, last.sha256) == (len(again), sha256_hex(again))
    assert "error" not in forwarder.stderr.lower(), forwarder.stderr
    # Every connection went over one upstream session (a pooled one from an earlier test, or
    # the one made here): containerd handed out at most one more streaming URL.
    assert stack.portforward_calls() - calls <= 1


# containerd 1.6 sends FIN on the data stream before it writes the error text (its
# portForward closes the stream, then the handler writes the error): the gateway must still
# relay that text, which often arrives in a later read than the FIN.
@pytest.mark.parametrize("profile", profile_params())
def test_port_forward_to_a_closed_port_reports_containerd_error(
    stack: Stack, profile: Profile
) -> None:
    kubectl = stack.kubectl_as(profile)
    closed = free_port()  # nothing listens there, on the host network the pod shares
    local = free_port()
    with kubectl.port_forward(POD, local, closed) as forwarder:
        with socket.create_connection(("127.0.0.1", local), timeout=REFUSED_SECONDS) as sock:
            sock.settimeout(REFUSED_SECONDS)
            try:
                first = sock.recv(1024)
            except ConnectionResetError:
                first = b""
        assert first == b""
        # kubectl-api-surface.md §8: error text on the pair's error stream is printed after
        # "an error occurred forwarding L -> R: ", and kubectl gives up on the pod (rc 1).
        returncode = forwarder.wait_exit(REFUSED_SECONDS)
    stderr = forwarder.stderr
    assert returncode == 1, stderr
    assert stderr.splitlines()[-1] == "error: lost connection to pod", stderr
    # containerd's text (k8s-streaming.md §3), relayed unchanged.
    assert (
        f"an error occurred forwarding {local} -> {closed}: "
        f"error forwarding port {closed} to pod {stack.sandbox_id}, uid "
    ) in stderr, stderr
    assert f"dial tcp4 127.0.0.1:{closed}: connect: connection refused" in stderr, stderr


def test_exec_forwarder_reaches_a_containerd_pod_through_cri_exec(stack: Stack) -> None:
    """`podgate node --portforward-via exec`'s path, against containerd: no CRI PortForward,
    a forwarder found in the busybox image (`busybox nc`) run through CRI Exec instead."""
    import asyncio
    import hashlib
    import os

    from podgate.node.cri_client import CriClient
    from podgate.node.upstream import CriTarget
    from podgate.streaming.target import PodRef

    before = stack.portforward_calls()
    payload = os.urandom(2 << 20)

    async def forward() -> bytes:
        client = CriClient(str(stack.containerd.socket))
        target = CriTarget(client, via_exec=True)
        try:
            async with asyncio.timeout(60):
                stream = await target.open_port(
                    PodRef(NAMESPACE, POD, stack.pod_uid, stack.sandbox_id), stack.echo_port
                )
                received = bytearray()

                async def upload() -> None:
                    for start in range(0, len(payload), 64 * 1024):
                        await stream.send(payload[start : start + 64 * 1024])

                uploader = asyncio.create_task(upload())
                # busybox nc does not pass on a half-close: read until all came back.
                while len(received) < len(payload):
                    chunk = await stream.receive()
                    assert chunk, f"EOF after {len(received)} bytes"
                    received += chunk
                await uploader
                await stream.aclose()
                return bytes(received)
        finally:
            await target.aclose()
            await client.close()

    got = asyncio.run(forward())
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    assert stack.portforward_calls() == before  # CRI PortForward was never used
