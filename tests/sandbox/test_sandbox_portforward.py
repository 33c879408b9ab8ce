"""CRI port-forward into sandboxed pods: the agent backend end to end (client → runtime → sandbox
shim → hybrid-vsock dial-back → agent in the guest → server), and the proof that the guest is
really apart: the netns backend, forced onto the same pod, finds nothing listening."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pod, Pods, RuntimeDaemon, read_all
from sandbox_support import (
    MIB,
    echo_stream,
    echo_transfer,
    pod_info,
    port_forward,
    run_dir,
    run_pod,
    sandbox_daemon,
    shim_forward,
    shim_stats,
    socket_count,
)

from podgate.aio.errors import StreamError
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.model import ProcessRef
from podgate.streaming.client import PortForwardSession

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

ECHO_PORT = 7201
CLOSED_PORT = 7209
BIG_TRANSFER = 256 * MIB
CONCURRENT = 8
CONCURRENT_TRANSFER = 16 * MIB
SEQUENTIAL = 200
HANDED_TRANSFER = 64 * MIB
# Under the 128 KiB a single argument may have: the greeting travels in the server's argv.
GREETING_BYTES = 96 * 1024
GREETINGS = 20


async def echo_once(session: PortForwardSession, port: int, payload: bytes) -> tuple[bytes, str]:
    forwarded = await session.open(port)
    await forwarded.data.send(payload)
    await forwarded.data.send_eof()
    return await read_all(forwarded.data), await forwarded.error()


async def refused_error(session: PortForwardSession, port: int) -> str:
    forwarded = await session.open(port)
    error = await forwarded.error()
    try:
        leftover = await read_all(forwarded.data)
    except StreamError:
        leftover = b""  # reset, as upstream does
    assert leftover == b""
    return error


async def test_256_mib_to_a_loopback_only_server_in_the_guest(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # The host listens on the same port and never answers: the bytes must reach the guest.
    with socket.create_server(("127.0.0.1", 0)) as host_listener:
        port = host_listener.getsockname()[1]
        pod = await run_pod(pods, "sb-big")
        await pods.server(pod, "echo", "echo", "127.0.0.1", port)
        session = await port_forward(cri, pod, [port])
        try:
            result = await echo_transfer(await session.open(port), BIG_TRANSFER)
        finally:
            await session.aclose()
    assert (result.sent, result.received) == (BIG_TRANSFER, BIG_TRANSFER)
    assert result.received_sha256 == result.sent_sha256
    assert result.error == ""
    stats = await shim_stats(sandbox_runtime, pod)
    assert stats.agent_port_forwards == 1  # through the agent, not the exec fallback
    assert stats.connections_handed_over == 1  # and with no copy in the shim


async def test_8_concurrent_connections_are_handed_over_and_the_shim_holds_none(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await run_pod(pods, "sb-conc")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    shim = sandbox_shim(await pod_info(cri, pod))
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            streams = [await session.open(ECHO_PORT)]
            await streams[0].data.send(b"ping")
            assert await streams[0].data.receive() == b"ping"
            with_one = socket_count(shim.pid)
            streams += [await session.open(ECHO_PORT) for _ in range(CONCURRENT - 1)]
            for forwarded in streams[1:]:  # every one is connected end to end
                await forwarded.data.send(b"ping")
                assert await forwarded.data.receive() == b"ping"
            with_all = socket_count(shim.pid)
        during = await shim_stats(sandbox_runtime, pod)
        results = await asyncio.gather(*(echo_transfer(s, CONCURRENT_TRANSFER) for s in streams))
    finally:
        await session.aclose()
    for result in results:
        assert result.received == CONCURRENT_TRANSFER
        assert result.received_sha256 == result.sent_sha256
        assert result.error == ""
    # The shim passed each agent connection to the runtime and kept no socket of any: seven
    # more connections, not one more socket in the shim (a copy would hold two each).
    assert with_all <= with_one
    assert (during.connections_handed_over, during.connections_active) == (CONCURRENT, 0)
    # A listener lives while a call waits for its dial-back; a freed vsock port is reused.
    assert during.listeners_open == 0
    assert during.vsock_ports_allocated == 1
    assert during.agent_port_forwards == CONCURRENT
    await wait_for_idle(sandbox_runtime, pod)


async def test_a_connection_handed_over_carries_64_mib_each_way(
    pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await run_pod(pods, "sb-handed")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    stream, reply = await shim_forward(sandbox_runtime, pod, ECHO_PORT, hand_over=True)
    try:
        assert reply.handed_over
        assert reply.agent_generation == 1
        during = await shim_stats(sandbox_runtime, pod)
        result = await echo_stream(stream, HANDED_TRANSFER)
    finally:
        await stream.aclose()
    assert (result.sent, result.received) == (HANDED_TRANSFER, HANDED_TRANSFER)
    assert result.received_sha256 == result.sent_sha256
    assert (during.connections_handed_over, during.connections_active) == (1, 0)
    await wait_for_idle(sandbox_runtime, pod)


async def test_a_caller_that_asks_for_no_hand_over_gets_the_shims_copy(
    pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # containerd PR #4814's caller: the shim copies, and both connections share one listener.
    pod = await run_pod(pods, "sb-copied")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    opened = [await shim_forward(sandbox_runtime, pod, ECHO_PORT, hand_over=False)]
    try:
        opened.append(await shim_forward(sandbox_runtime, pod, ECHO_PORT, hand_over=False))
        assert [reply.handed_over for _, reply in opened] == [False, False]
        during = await shim_stats(sandbox_runtime, pod)
        results = await asyncio.gather(
            *(echo_stream(stream, CONCURRENT_TRANSFER) for stream, _ in opened)
        )
    finally:
        for stream, _ in opened:
            await stream.aclose()
    for result in results:
        assert result.received == CONCURRENT_TRANSFER
        assert result.received_sha256 == result.sent_sha256
    assert (during.listeners_open, during.connections_active) == (1, 2)
    assert (during.listeners_opened, during.vsock_ports_allocated) == (1, 1)
    assert during.connections_handed_over == 0
    await wait_for_idle(sandbox_runtime, pod)


async def test_a_greeting_sent_before_the_hand_over_arrives_whole(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # The server writes at once and closes: its bytes (and EOF) may reach the shim before it
    # passes the connection on, and must still come first, in order.
    greeting = os.urandom(GREETING_BYTES // 2).hex()
    pod = await run_pod(pods, "sb-greet")
    await pods.server(pod, "greet", "reply", "127.0.0.1", ECHO_PORT, reply=greeting)
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            for _ in range(GREETINGS):
                forwarded = await session.open(ECHO_PORT)
                assert await read_all(forwarded.data) == greeting.encode()
                assert await forwarded.error() == ""
    finally:
        await session.aclose()
    stats = await shim_stats(sandbox_runtime, pod)
    assert stats.connections_handed_over == GREETINGS


def sandbox_shim(info: dict[str, object]) -> ProcessRef:
    extra = info["extra"]
    assert isinstance(extra, dict)
    return ProcessRef(**extra["sandbox_shim"])


async def wait_for_idle(daemon: RuntimeDaemon, pod: Pod) -> None:
    """Until the shim has no connection and no listener left (closed at refcount zero)."""
    async with asyncio.timeout(WAIT_SECONDS):
        while True:
            stats = await shim_stats(daemon, pod)
            if (stats.connections_active, stats.listeners_open) == (0, 0):
                break
            await asyncio.sleep(0.05)
    assert not list(run_dir(daemon, pod).glob("v.sock_*"))


async def test_ipv6_only_server_is_reached(cri: pb_grpc.RuntimeServiceStub, pods: Pods) -> None:
    pod = await run_pod(pods, "sb-v6")
    await pods.server(pod, "echo6", "echo", "::1", ECHO_PORT)
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            assert await echo_once(session, ECHO_PORT, b"over ::1") == (b"over ::1", "")
    finally:
        await session.aclose()


async def test_closed_port_is_refused_inside_the_sandbox_and_the_session_goes_on(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await run_pod(pods, "sb-closed")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    session = await port_forward(cri, pod, [])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            error = await refused_error(session, CLOSED_PORT)
            assert await echo_once(session, ECHO_PORT, b"still here") == (b"still here", "")
    finally:
        await session.aclose()
    # The agent's words (containerd's, said of the sandbox), behind the shim's and the
    # streaming server's; a refusal is final: no fallback to the exec backend.
    assert error == (
        f"error forwarding port {CLOSED_PORT} to pod {pod.id}, uid {pod.uid}: "
        f"port {CLOSED_PORT} refused inside the sandbox: "
        f"failed to connect to localhost:{CLOSED_PORT} inside the sandbox, "
        f"IPv4: dial tcp4 127.0.0.1:{CLOSED_PORT}: connect: connection refused "
        f"IPv6 dial tcp6 [::1]:{CLOSED_PORT}: connect: connection refused "
    )
    stats = await shim_stats(sandbox_runtime, pod)
    assert stats.agent_port_forwards == 2
    await wait_for_idle(sandbox_runtime, pod)


async def test_200_sequential_connections_reuse_one_vsock_port(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await run_pod(pods, "sb-seq")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    directory = run_dir(sandbox_runtime, pod)
    seen: set[str] = set()
    most_at_once = 0
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        async with asyncio.timeout(120):
            for i in range(SEQUENTIAL):
                payload = b"request %d" % i
                assert await echo_once(session, ECHO_PORT, payload) == (payload, "")
                listeners = {p.name for p in directory.glob("v.sock_*")}
                seen |= listeners
                most_at_once = max(most_at_once, len(listeners))
    finally:
        await session.aclose()
    await wait_for_idle(sandbox_runtime, pod)
    stats = await shim_stats(sandbox_runtime, pod)
    # One agent call per connection, and never more than a couple of dial-back ports: a freed
    # port is handed out again (a new connection may arrive before the last one is released).
    assert stats.agent_port_forwards == SEQUENTIAL
    assert 1 <= stats.vsock_ports_allocated <= 2
    assert most_at_once <= 2
    assert len(seen) <= 2
    assert stats.listeners_opened <= SEQUENTIAL


@pytest.fixture(scope="module")
def netns_forced() -> Iterator[RuntimeDaemon]:
    with sandbox_daemon(["--backend", "sandboxed=netns"]) as daemon:
        yield daemon


async def test_netns_backend_forced_on_a_sandboxed_pod_is_refused(
    netns_forced: RuntimeDaemon,
) -> None:
    async with netns_forced.connect() as rt:
        pods = Pods(rt)
        try:
            pod = await run_pod(pods, "sb-netns")
            await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
            session = await port_forward(rt, pod, [ECHO_PORT])
            try:
                async with asyncio.timeout(WAIT_SECONDS):
                    error = await refused_error(session, ECHO_PORT)
            finally:
                await session.aclose()
        finally:
            await pods.remove_all()
    # The server listens in the guest; the pod's netns (containerd's path) has nothing.
    prefix = f"error forwarding port {ECHO_PORT} to pod {pod.id}, uid {pod.uid}: "
    assert error.startswith(prefix + 'failed to execute portforward in network namespace "')
    assert f'failed to connect to localhost:{ECHO_PORT} inside namespace "{pod.id}"' in error
    assert "connection refused" in error
