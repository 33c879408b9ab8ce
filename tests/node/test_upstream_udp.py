"""CriTarget and UDP: the pooled upstream session offers the extension; a runtime that takes it
carries UDP flows, one that does not (an upstream-style server) makes a UDP forward fail with
"runtime does not support UDP port-forward", and TCP is unaffected either way. Both runtimes
here are in-process streaming servers in front of a loopback UDP echo.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import cast

import pytest

from podgate.aio.http import next_request
from podgate.aio.spdy import SpdySession
from podgate.aio.streams import SocketStream, start_server
from podgate.node.cri_client import CriClient
from podgate.node.upstream import EXEC_NO_UDP, RUNTIME_NO_UDP, CriTarget
from podgate.proto.spdy import Role
from podgate.proto.upgrade import Accepted, ServerHandshake, StreamKind, negotiate
from podgate.streaming.client import Endpoint, PortForwardSession
from podgate.streaming.local import LocalTarget
from podgate.streaming.portforward import SpdyPortForwardServer
from podgate.streaming.server import StreamRequest, serve_stream
from podgate.streaming.target import PodRef, TargetError
from udp_support import UdpEcho, exchange_framed

UDP_PORT = 5353
POD = PodRef("default", "gw", "uid-gw", "s" * 64)
STEP_SECONDS = 10.0


class FakeCri:
    """The one CRI call CriTarget makes for port-forward: a URL to the runtime's server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls = 0

    async def port_forward_url(self, sandbox_id: str) -> str:
        self.calls += 1
        return self.url


@contextlib.asynccontextmanager
async def runtime(*, extension: bool, echo: UdpEcho) -> AsyncIterator[str]:
    """A runtime's streaming server on loopback: podgate's (`extension`) or an upstream-style
    one that knows only portforward.k8s.io. Yields its URL."""
    target = LocalTarget(udp_port_map={UDP_PORT: echo.port})

    async def handle(conn: SocketStream) -> None:
        handshake = ServerHandshake()
        request = await next_request(conn, handshake)
        if request is None:
            return
        if extension:
            await serve_stream(
                conn, handshake, request, StreamRequest(StreamKind.PORTFORWARD, POD), target
            )
            return
        decision = negotiate(request.method, request.headers, StreamKind.PORTFORWARD)
        assert isinstance(decision, Accepted)
        conn.write(handshake.accept(decision))
        conn.unread(handshake.trailing_data)
        server = SpdyPortForwardServer(POD, target)
        session = SpdySession(conn, Role.SERVER)
        session.on_stream = server.on_stream
        await server.serve(session)

    server = await start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/portforward/tok"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def gateway(target: CriTarget) -> AsyncIterator[Endpoint]:
    """podgate's port-forward handler in front of `target`, as the node gateway serves it."""

    async def handle(conn: SocketStream) -> None:
        handshake = ServerHandshake()
        request = await next_request(conn, handshake)
        if request is not None:
            await serve_stream(
                conn, handshake, request, StreamRequest(StreamKind.PORTFORWARD, POD), target
            )

    server = await start_server(handle, "127.0.0.1", 0)
    try:
        yield Endpoint("127.0.0.1", server.sockets[0].getsockname()[1])
    finally:
        server.close()


@pytest.fixture
async def echo() -> AsyncIterator[UdpEcho]:
    echo = UdpEcho()
    try:
        yield echo
    finally:
        echo.close()


async def test_a_podgate_runtime_carries_udp(echo: UdpEcho) -> None:
    async with runtime(extension=True, echo=echo) as url:
        cri = FakeCri(url)
        target = CriTarget(cast(CriClient, cri))
        try:
            async with asyncio.timeout(STEP_SECONDS):
                stream = await target.open_port(POD, UDP_PORT, protocol="udp")
                try:
                    tally = await exchange_framed(stream, 1000)
                finally:
                    await stream.aclose()
            assert (tally.matched, tally.unmatched) == (1000, [])
            ((session,),) = target.pooled_sessions.values()
            assert session.protocol == "udp.portforward.podgate.io"
        finally:
            await target.aclose()


async def test_a_runtime_without_the_extension_refuses_udp_only(echo: UdpEcho) -> None:
    async with runtime(extension=False, echo=echo) as url:
        target = CriTarget(cast(CriClient, FakeCri(url)))
        try:
            async with asyncio.timeout(STEP_SECONDS):
                with pytest.raises(TargetError) as info:
                    await target.open_port(POD, UDP_PORT, protocol="udp")
                assert (
                    str(info.value) == RUNTIME_NO_UDP == "runtime does not support UDP port-forward"
                )
                ((session,),) = target.pooled_sessions.values()
                assert session.protocol == "portforward.k8s.io"
        finally:
            await target.aclose()


@pytest.mark.parametrize("extension", [True, False], ids=["podgate-runtime", "upstream-runtime"])
async def test_through_the_gateway_handler(echo: UdpEcho, extension: bool) -> None:
    async with runtime(extension=extension, echo=echo) as url:
        target = CriTarget(cast(CriClient, FakeCri(url)))
        try:
            async with gateway(target) as endpoint, asyncio.timeout(STEP_SECONDS):
                session = await PortForwardSession.connect(endpoint, "/portforward", udp=True)
                try:
                    assert session.supports_udp  # the gateway has it, whatever the runtime
                    forwarded = await session.open(UDP_PORT, "udp")
                    if extension:
                        tally = await exchange_framed(forwarded.data, 1000)
                        assert (tally.matched, tally.unmatched) == (1000, [])
                        await forwarded.data.send_eof()
                        assert await forwarded.data.receive() == b""
                        assert await forwarded.error() == ""
                    else:
                        assert await forwarded.error() == (
                            f"error forwarding port {UDP_PORT} to pod {POD.sandbox_id}, "
                            f"uid {POD.uid}: runtime does not support UDP port-forward"
                        )
                finally:
                    await session.aclose()
        finally:
            await target.aclose()


async def test_exec_forwarding_refuses_udp() -> None:
    target = CriTarget(cast(CriClient, FakeCri("http://127.0.0.1:1/unused")), via_exec=True)
    with pytest.raises(TargetError) as info:
        await target.open_port(POD, UDP_PORT, protocol="udp")
    assert str(info.value) == EXEC_NO_UDP
    await target.aclose()
