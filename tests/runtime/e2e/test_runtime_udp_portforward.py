"""UDP port-forward through the real runtime into a real pod (the netns backend): the URL CRI
hands out, podgate's client offering the UDP extension, a UDP echo bound to the pod's own
127.0.0.1, and 10,000 datagrams with unique sequence numbers, every reply matched.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pod, Pods, stream_target, wait_for_log

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.proto.datagram import DatagramDecoder, encode_datagram
from podgate.streaming.client import PortForwardSession
from udp_support import DATAGRAMS, UDP_ECHO_SERVER, exchange_framed

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]


async def udp_echo_pod(pods: Pods, name: str, port: int) -> Pod:
    pod = await pods.run(name)
    argv = [sys.executable, "-c", UDP_ECHO_SERVER, "127.0.0.1", str(port)]
    container = await pods.create(pod, "udp-echo", argv)
    await wait_for_log(pods.rt, container, b"listening")
    return pod


async def connect(
    rt: pb_grpc.RuntimeServiceStub, pod: Pod, *, websocket: bool = False
) -> PortForwardSession:
    url = (await rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id))).url
    endpoint, path = stream_target(url)
    return await PortForwardSession.connect(endpoint, path, websocket=websocket, udp=True)


@pytest.mark.parametrize("websocket", [False, True], ids=["spdy", "websocket-tunnel"])
async def test_10000_datagrams_to_a_loopback_only_udp_server_in_the_pod(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, websocket: bool
) -> None:
    # The host has its own socket on the same port: the datagrams must reach the pod's
    # 127.0.0.1, never this one.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as host_socket:
        host_socket.bind(("127.0.0.1", 0))
        host_socket.setblocking(False)
        port = host_socket.getsockname()[1]
        pod = await udp_echo_pod(pods, f"udp-{'ws' if websocket else 'spdy'}", port)
        session = await connect(cri, pod, websocket=websocket)
        try:
            assert session.supports_udp
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


async def test_udp_and_tcp_pairs_share_one_session(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    port = 5300
    pod = await udp_echo_pod(pods, "udp-mixed", port)
    await pods.server(pod, "tcp-echo", "echo", "127.0.0.1", port)  # TCP on the same number
    session = await connect(cri, pod)
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            udp = await session.open(port, "udp")
            tcp = await session.open(port)
            await tcp.data.send(b"tcp bytes")
            await tcp.data.send_eof()
            await udp.data.send(encode_datagram(b"one") + encode_datagram(b""))
            decoder = DatagramDecoder()
            replies: list[bytes] = []
            while len(replies) < 2:
                replies += decoder.feed(await udp.data.receive())
            assert sorted(replies) == [b"", b"one"]
            echoed = b""
            while chunk := await tcp.data.receive():
                echoed += chunk
            assert echoed == b"tcp bytes"
            assert await tcp.error() == ""
    finally:
        await session.aclose()
