"""UDP port-forward into a sandboxed pod through the agent backend (runtime -> shim -> agent in
the guest, which opens the UDP socket and relays framed datagrams over its dial-back
connection), and the exec backend's clear refusal.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pod, Pods, RuntimeDaemon, stream_target, wait_for_log
from sandbox_support import run_pod, sandbox_daemon, shim_forward, shim_stats

from podgate.aio.errors import StreamError
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.proto.datagram import DatagramDecoder, encode_datagram
from podgate.streaming.client import PortForwardSession
from udp_support import DATAGRAMS, UDP_ECHO_SERVER, exchange_framed

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

UDP_PORT = 5353


async def udp_echo(pods: Pods, pod: Pod, port: int) -> None:
    argv = [sys.executable, "-c", UDP_ECHO_SERVER, "127.0.0.1", str(port)]
    container = await pods.create(pod, "udp-echo", argv)
    await wait_for_log(pods.rt, container, b"listening")


async def connect(rt: pb_grpc.RuntimeServiceStub, pod: Pod) -> PortForwardSession:
    url = (await rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id))).url
    endpoint, path = stream_target(url)
    return await PortForwardSession.connect(endpoint, path, udp=True)


async def test_10000_datagrams_to_a_loopback_only_udp_server_in_the_guest(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # The host has its own socket on the same port: the datagrams must reach the guest.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as host_socket:
        host_socket.bind(("127.0.0.1", 0))
        host_socket.setblocking(False)
        port = host_socket.getsockname()[1]
        pod = await run_pod(pods, "sb-udp")
        await udp_echo(pods, pod, port)
        session = await connect(cri, pod)
        try:
            forwarded = await session.open(port, "udp")
            tally = await exchange_framed(forwarded.data, DATAGRAMS)
            assert (tally.sent, tally.matched, tally.unmatched) == (DATAGRAMS, DATAGRAMS, [])
            await forwarded.data.send_eof()
            async with asyncio.timeout(WAIT_SECONDS):
                assert await forwarded.data.receive() == b""
                assert await forwarded.error() == ""
        finally:
            await session.aclose()
        with pytest.raises(BlockingIOError):
            host_socket.recv(65535)
    stats = await shim_stats(sandbox_runtime, pod)
    assert stats.agent_port_forwards == 1  # through the agent, not the exec fallback
    assert stats.connections_handed_over == 1  # and with no copy in the shim


async def test_udp_and_tcp_to_one_port_number_use_separate_dial_back_pools(
    pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # Asked of the shim directly without hand-over, so that it copies and each connection
    # holds its pool while it lasts.
    pod = await run_pod(pods, "sb-mixed")
    await udp_echo(pods, pod, UDP_PORT)
    await pods.server(pod, "tcp-echo", "echo", "127.0.0.1", UDP_PORT)
    udp, _ = await shim_forward(sandbox_runtime, pod, UDP_PORT, hand_over=False, protocol="udp")
    try:
        tcp, _ = await shim_forward(sandbox_runtime, pod, UDP_PORT, hand_over=False)
        try:
            async with asyncio.timeout(WAIT_SECONDS):
                await tcp.send(b"tcp")
                assert await tcp.receive() == b"tcp"
                await udp.send(encode_datagram(b"udp"))
                assert DatagramDecoder().feed(await udp.receive()) == [b"udp"]
                during = await shim_stats(sandbox_runtime, pod)
                await tcp.send_eof()
                assert await tcp.receive() == b""
                await udp.send_eof()
                assert await udp.receive() == b""
        finally:
            await tcp.aclose()
    finally:
        await udp.aclose()
    # (container, port, protocol) keys the pool: two listeners, two vsock ports.
    assert (during.listeners_open, during.connections_active) == (2, 2)
    assert during.vsock_ports_allocated >= 2


# --------------------------------------------------------------------------- exec backend


@pytest.fixture(scope="module")
def exec_daemon() -> Iterator[RuntimeDaemon]:
    with sandbox_daemon(["--backend", "=exec", "--backend", "sandboxed=exec"]) as daemon:
        yield daemon


@pytest.fixture
async def exec_pods(exec_daemon: RuntimeDaemon) -> AsyncIterator[Pods]:
    async with exec_daemon.connect() as rt:
        made = Pods(rt)
        try:
            yield made
        finally:
            await made.remove_all()


@pytest.mark.parametrize("handler", ["", "sandboxed"])
async def test_exec_backend_refuses_udp_clearly(exec_pods: Pods, handler: str) -> None:
    pod = await run_pod(exec_pods, f"exec-udp-{handler or 'plain'}", handler)
    await udp_echo(exec_pods, pod, UDP_PORT)
    session = await connect(exec_pods.rt, pod)
    try:
        assert session.supports_udp  # the runtime has the extension; the backend cannot do it
        async with asyncio.timeout(WAIT_SECONDS):
            forwarded = await session.open(UDP_PORT, "udp")
            error = await forwarded.error()
            with pytest.raises(StreamError):
                while await forwarded.data.receive():
                    pass
    finally:
        await session.aclose()
    assert error == (
        f"error forwarding port {UDP_PORT} to pod {pod.id}, uid {pod.uid}: "
        "UDP port-forward is not supported by the exec backend"
    )
