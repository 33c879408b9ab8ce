"""Exec, attach and port-forward through the URLs CRI hands out, with podgate's own client.

Wire expectations come from k8s-streaming.md: exit codes travel in the v4+ Status (128 + signal
for a killed process), a tty has no stderr and takes resize events, port-forward reports a
failed dial as `error forwarding port <p> to pod <sandbox id>, uid <uid>: <err>` on the pair's
error stream without ending the session (§7.1), and CRI streaming tokens are single-use (an
unknown or used one is a 404 "404 page not found", Go's http.NotFound) with at most 1000 in
flight, past which CRI answers ResourceExhausted (§7.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import grpc
import pytest
from runtime_e2e_support import (
    WAIT_SECONDS,
    Feed,
    Pod,
    Pods,
    Resizes,
    RuntimeDaemon,
    Sink,
    read_all,
    rpc_error,
    stream_target,
)

from podgate.aio.errors import StreamError
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.streaming.client import (
    ExecResult,
    PortForwardSession,
    UpgradeError,
    exec_spdy,
    exec_websocket,
)

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

MIB = 1024 * 1024
# The large port-forward transfer, both ways at once through an echo server.
TRANSFER_BYTES = 256 * MIB
TRANSFER_CHUNK = MIB
# The streaming server's cap on outstanding CRI streaming requests (k8s-streaming.md §7.2).
MAX_IN_FLIGHT = 1000
ECHO_PORT = 7001
CLOSED_PORT = 7009
TRANSPORTS = ["spdy", "websocket"]
TOKEN = re.compile(r"[A-Za-z0-9_-]{8}")


async def run_exec(
    transport: str,
    url: str,
    *,
    stdin: Feed | None = None,
    stdout: Sink | None = None,
    stderr: Sink | None = None,
    tty: bool = False,
    resizes: Resizes | None = None,
) -> ExecResult:
    endpoint, path = stream_target(url)
    sizes = resizes.sizes() if resizes is not None else None
    run = exec_spdy if transport == "spdy" else exec_websocket
    async with asyncio.timeout(WAIT_SECONDS):
        return await run(
            endpoint, path, stdin=stdin, stdout=stdout, stderr=stderr, tty=tty, resizes=sizes
        )


async def exec_url(
    rt: pb_grpc.RuntimeServiceStub,
    container: str,
    cmd: list[str],
    *,
    stdin: bool = False,
    tty: bool = False,
) -> str:
    request = pb.ExecRequest(
        container_id=container, cmd=cmd, stdin=stdin, stdout=True, stderr=not tty, tty=tty
    )
    return (await rt.Exec(request)).url


async def sleeper(pods: Pods, name: str) -> tuple[Pod, str]:
    pod = await pods.run(name)
    return pod, await pods.create(pod, "main", ["sleep", "1000"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("script", "code"), [("exit 0", 0), ("exit 3", 3), ("kill -9 $$", 137)])
async def test_exec_exit_codes_and_output(
    runtime_daemon: RuntimeDaemon,
    cri: pb_grpc.RuntimeServiceStub,
    pods: Pods,
    transport: str,
    script: str,
    code: int,
) -> None:
    _, container = await sleeper(pods, f"exec-{transport}-{code}")
    url = await exec_url(cri, container, ["sh", "-c", f"echo out; echo err >&2; {script}"])
    # <streaming base>/exec/<token>; a token is 8 URL-safe base64 characters (§7.2).
    assert url.startswith(f"{runtime_daemon.streaming_base}/exec/"), url
    assert TOKEN.fullmatch(url.rsplit("/", 1)[1]), url
    stdout, stderr = Sink(), Sink()
    result = await run_exec(transport, url, stdout=stdout, stderr=stderr)
    assert result.exit_code == code
    assert (bytes(stdout.data), bytes(stderr.data)) == (b"out\n", b"err\n")


def _kill_commands_under(daemon_pid: int, argv: bytes) -> None:
    """SIGKILL the daemon's descendants running `argv` (NUL-joined): a failed run of the test
    below leaves the daemon asleep in the kernel until its command gets input or dies."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    for pid, cmdline in commands.items():
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != daemon_pid:
            ancestor = parents.get(ancestor, 0)
        if ancestor == daemon_pid and cmdline == argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_command_that_splices_its_input_to_its_output_does_not_stop_the_daemon(
    runtime_daemon: RuntimeDaemon, cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    """busybox cat copies a socket stdin with sendfile, and while it waits for input it holds
    the lock of its stdout if that is a pipe: a daemon reading that pipe sleeps in the kernel,
    event loop and all, and the input cat waits for never comes (kubectl exec -i … cat hung)."""
    busybox = shutil.which("busybox")
    assert busybox is not None, "busybox (busybox-static) is not installed"
    _, container = await sleeper(pods, f"exec-splice-{transport}")
    url = await exec_url(cri, container, [busybox, "cat"], stdin=True)
    stdin, stdout = Feed(), Sink()
    session = asyncio.create_task(run_exec(transport, url, stdin=stdin, stdout=stdout))
    lines = [f"line {n}\n".encode() for n in range(5)]
    try:
        for n, line in enumerate(lines):
            stdin.put(line)
            await stdout.wait_for(b"".join(lines[: n + 1]), session=session)
            # The daemon goes on answering while cat waits for the next line.
            async with asyncio.timeout(WAIT_SECONDS):
                await cri.Version(pb.VersionRequest())
        stdin.close()
        result = await session
    finally:
        if not session.done():
            session.cancel()
            _kill_commands_under(runtime_daemon.process.pid, f"{busybox}\0cat\0".encode())
    assert result.exit_code == 0
    assert bytes(stdout.data) == b"".join(lines)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_stdin_round_trip(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    _, container = await sleeper(pods, f"exec-stdin-{transport}")
    url = await exec_url(cri, container, ["sh", "-c", "cat; echo done"], stdin=True)
    payload = os.urandom(300_000)
    stdin, stdout, stderr = Feed(payload[:1000], payload[1000:], eof=True), Sink(), Sink()
    result = await run_exec(transport, url, stdin=stdin, stdout=stdout, stderr=stderr)
    assert result.exit_code == 0
    assert bytes(stdout.data) == payload + b"done\n"
    assert stderr.data == b""


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_tty_sees_every_resize(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    _, container = await sleeper(pods, f"exec-tty-{transport}")
    # Prints the first size, then waits for the terminal to change to 132x43.
    script = (
        'stty size; while :; do s=$(stty size); [ "$s" = "43 132" ] && { echo "now $s"; exit 0; }; '
        "sleep 0.05; done"
    )
    url = await exec_url(cri, container, ["sh", "-c", script], tty=True)
    resizes, stdout = Resizes(), Sink()
    resizes.push(100, 30)
    session = asyncio.create_task(
        run_exec(transport, url, stdout=stdout, tty=True, resizes=resizes)
    )
    try:
        await stdout.wait_for(b"30 100\r\n", session=session)
        resizes.push(132, 43)
        result = await session
    finally:
        resizes.close()
        session.cancel()
    assert result.exit_code == 0
    # A tty turns "\n" into "\r\n"; stdout is the terminal, there is no separate stderr.
    assert bytes(stdout.data) == b"30 100\r\nnow 43 132\r\n"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_attach_stdin_once_cat(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    pod = await pods.run(f"attach-{transport}")
    container = await pods.create(pod, "cat", ["cat"], stdin=True, stdin_once=True)
    url = (
        await cri.Attach(
            pb.AttachRequest(container_id=container, stdin=True, stdout=True, stderr=True)
        )
    ).url
    assert "/attach/" in url
    stdin, stdout, stderr = Feed(b"hello attach\n"), Sink(), Sink()
    session = asyncio.create_task(
        run_exec(transport, url, stdin=stdin, stdout=stdout, stderr=stderr)
    )
    try:
        # cat answers while stdin is still open
        await stdout.wait_for(b"hello attach\n", session=session)
        stdin.put(b"second line\n")
        await stdout.wait_for(b"second line\n", session=session)
        stdin.close()  # stdin_once: the container's stdin closes, cat exits
        result = await session
    finally:
        session.cancel()
    assert result.exit_code == 0
    assert bytes(stdout.data) == b"hello attach\nsecond line\n"
    assert stderr.data == b""
    status = await pods.wait_state(container, pb.CONTAINER_EXITED)
    assert status.exit_code == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_attach_tty_sees_resize(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    pod = await pods.run(f"attach-tty-{transport}")
    # Silent until its terminal is 132x43 (a new pty is 0x0), then says so and exits.
    script = (
        'while :; do s=$(stty size); [ "$s" = "43 132" ] && { echo "now $s"; exit 0; }; '
        "sleep 0.05; done"
    )
    container = await pods.create(pod, "shell", ["sh", "-c", script], stdin=True, tty=True)
    request = pb.AttachRequest(container_id=container, stdin=True, stdout=True, tty=True)
    url = (await cri.Attach(request)).url
    resizes, stdout = Resizes(), Sink()
    resizes.push(132, 43)
    try:
        result = await run_exec(
            transport, url, stdin=Feed(), stdout=stdout, tty=True, resizes=resizes
        )
    finally:
        resizes.close()
    assert result.exit_code == 0
    assert bytes(stdout.data) == b"now 43 132\r\n"
    status = await pods.wait_state(container, pb.CONTAINER_EXITED)
    assert status.exit_code == 0


async def port_forward(
    rt: pb_grpc.RuntimeServiceStub, pod: Pod, ports: list[int], *, websocket: bool = False
) -> PortForwardSession:
    url = (await rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=ports))).url
    assert "/portforward/" in url
    endpoint, path = stream_target(url)
    return await PortForwardSession.connect(endpoint, path, websocket=websocket)


async def echo_once(session: PortForwardSession, port: int, payload: bytes) -> tuple[bytes, str]:
    forwarded = await session.open(port)
    await forwarded.data.send(payload)
    await forwarded.data.send_eof()
    return await read_all(forwarded.data), await forwarded.error()


async def test_port_forward_256_mib_to_loopback_only_server(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    # The host listens on the same port on its own loopback and never answers: the forward
    # must reach the pod's 127.0.0.1, not the host's.
    with socket.create_server(("127.0.0.1", 0)) as host_listener:
        port = host_listener.getsockname()[1]
        pod = await pods.run("pf-big")
        await pods.server(pod, "echo", "echo", "127.0.0.1", port)
        await transfer_256_mib(cri, pod, port)


async def transfer_256_mib(cri: pb_grpc.RuntimeServiceStub, pod: Pod, port: int) -> None:
    session = await port_forward(cri, pod, [port])
    try:
        forwarded = await session.open(port)
        sent, received = hashlib.sha256(), hashlib.sha256()
        received_bytes = 0

        async def upload() -> None:
            for _ in range(TRANSFER_BYTES // TRANSFER_CHUNK):
                chunk = os.urandom(TRANSFER_CHUNK)
                sent.update(chunk)
                await forwarded.data.send(chunk)
            await forwarded.data.send_eof()

        async def download() -> None:
            nonlocal received_bytes
            while chunk := await forwarded.data.receive():
                received.update(chunk)
                received_bytes += len(chunk)

        async with asyncio.timeout(60), asyncio.TaskGroup() as group:
            group.create_task(upload())
            group.create_task(download())
        assert received_bytes == TRANSFER_BYTES
        assert received.hexdigest() == sent.hexdigest()
        assert await forwarded.error() == ""
    finally:
        await session.aclose()


async def test_port_forward_to_ipv6_only_listener(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("pf-v6")
    await pods.server(pod, "echo6", "echo", "::1", ECHO_PORT)
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            assert await echo_once(session, ECHO_PORT, b"over ::1") == (b"over ::1", "")
    finally:
        await session.aclose()


async def test_port_forward_closed_port_reports_error_and_session_survives(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("pf-closed")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    session = await port_forward(cri, pod, [])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            refused = await session.open(CLOSED_PORT)
            error = await refused.error()
            prefix = f"error forwarding port {CLOSED_PORT} to pod {pod.id}, uid {pod.uid}: "
            assert error.startswith(prefix), error
            assert "refused" in error[len(prefix) :], error
            try:
                leftover = await read_all(refused.data)
            except StreamError:
                leftover = b""  # reset, as upstream does
            assert leftover == b""
            # The same connection still forwards.
            assert await echo_once(session, ECHO_PORT, b"still here") == (b"still here", "")
    finally:
        await session.aclose()


async def test_port_forward_over_websocket_tunnel(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("pf-tunnel")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    session = await port_forward(cri, pod, [ECHO_PORT], websocket=True)
    try:
        payload = os.urandom(3 * MIB)
        async with asyncio.timeout(WAIT_SECONDS):
            data = await session.open(ECHO_PORT)

            async def upload() -> None:
                await data.data.send(payload)
                await data.data.send_eof()

            uploader = asyncio.create_task(upload())
            echoed = await read_all(data.data, limit=len(payload) + 1)
            await uploader
        assert echoed == payload
    finally:
        await session.aclose()


async def test_streaming_urls_are_single_use(cri: pb_grpc.RuntimeServiceStub, pods: Pods) -> None:
    pod, container = await sleeper(pods, "tokens")
    url = await exec_url(cri, container, ["echo", "once"])
    stdout = Sink()
    assert (await run_exec("spdy", url, stdout=stdout, stderr=Sink())).exit_code == 0
    assert stdout.data == b"once\n"
    endpoint, path = stream_target(url)
    with pytest.raises(UpgradeError) as refused:
        await exec_spdy(endpoint, path, stdout=Sink(), stderr=Sink())
    assert refused.value.status == 404
    assert refused.value.body == b"404 page not found\n"

    # The same holds for a port-forward URL, over the other transport.
    url = (await cri.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[1]))).url
    endpoint, path = stream_target(url)
    first = await PortForwardSession.connect(endpoint, path)
    await first.aclose()
    with pytest.raises(UpgradeError) as refused:
        await PortForwardSession.connect(endpoint, path, websocket=True)
    assert refused.value.status == 404

    # A well-formed token that was never issued is refused the same way.
    with pytest.raises(UpgradeError) as refused:
        await PortForwardSession.connect(endpoint, "/portforward/AAAAAAAA")
    assert refused.value.status == 404


async def test_at_most_1000_outstanding_streaming_requests(fresh_daemon: RuntimeDaemon) -> None:
    async with fresh_daemon.connect() as rt:
        pods = Pods(rt)
        try:
            pod = await pods.run("in-flight")
            request = pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[80])
            urls = [(await rt.PortForward(request)).url for _ in range(MAX_IN_FLIGHT)]
            assert len(set(urls)) == MAX_IN_FLIGHT
            error = await rpc_error(rt.PortForward(request))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "maximum number of in-flight requests exceeded"
            # Exec and Attach draw on the same cache.
            container = await pods.create(pod, "main", ["sleep", "1000"])
            exec_request = pb.ExecRequest(container_id=container, cmd=["true"], stdout=True)
            error = await rpc_error(rt.Exec(exec_request))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            # Using a URL frees its slot: exactly one more call succeeds.
            endpoint, path = stream_target(urls[0])
            session = await PortForwardSession.connect(endpoint, path)
            await session.aclose()
            await rt.PortForward(request)
            error = await rpc_error(rt.PortForward(request))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await pods.remove_all()
