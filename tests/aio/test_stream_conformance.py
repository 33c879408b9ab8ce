"""Every ByteStream implementation in the tree against the one contract (stream_conformance).

Each subject builds a connected `(stream under test, peer)` over the real transport it runs on
in production (TCP, unix sockets, SPDY sessions, WebSocket channels, the SPDY-in-WebSocket
tunnel, UDP, a forwarder process). WAIVERS is the table of checks a stream type cannot meet
by design, each with the reason; everything else must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from stream_conformance import CHECKS

import podgate.aio.spdy
import podgate.aio.streams
import podgate.aio.wschannel
from podgate.aio.datagram import DatagramStream, connected_udp_socket
from podgate.aio.memory import memory_stream_pair
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.streams import ByteStream, SocketStream, start_server, start_unix_server
from podgate.aio.wschannel import ChannelSession, TunnelWire
from podgate.backends.agent import _AgentStream
from podgate.backends.exec import ProcessStream
from podgate.cli.exec import FdStream
from podgate.forwarders import forwarder_argv
from podgate.node.execforward import ExecForwardStream
from podgate.node.upstream import UpstreamStream
from podgate.proto.spdy import Role as SpdyRole
from podgate.proto.wschannel import ChannelConnection, Role, TunnelConnection
from podgate.runtime.sandbox.shim import _Relay, _Tracked
from podgate.streaming.client import ForwardedStream
from podgate.streaming.hooks import ThrottledStream

Pair = tuple[ByteStream, ByteStream]
Factory = Callable[[], contextlib.AbstractAsyncContextManager[Pair]]

V5 = "v5.channel.k8s.io"
# Fast enough that 2 × 16 MiB pass in about a second, slow enough that the bucket works.
THROTTLE_BYTES_PER_SECOND = 64 * 1024 * 1024
# podgate's own forwarder keeps the other direction open this long after one side ends.
FORWARDER_HALF_CLOSE_GRACE_SECONDS = 30.0


@contextlib.asynccontextmanager
async def _tcp_pair(host: str = "127.0.0.1") -> AsyncIterator[tuple[SocketStream, SocketStream]]:
    accepted: asyncio.Queue[SocketStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: SocketStream) -> None:
        await accepted.put(stream)
        await done.wait()

    server = await start_server(handler, host, 0)
    port = server.sockets[0].getsockname()[1]
    client = await SocketStream.connect(host, port)
    peer = await accepted.get()
    try:
        yield client, peer
    finally:
        done.set()
        await client.aclose()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def tcp() -> AsyncIterator[Pair]:
    async with _tcp_pair() as pair:
        yield pair


@contextlib.asynccontextmanager
async def unix(tmp: Path) -> AsyncIterator[Pair]:
    accepted: asyncio.Queue[SocketStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: SocketStream) -> None:
        await accepted.put(stream)
        await done.wait()

    path = str(tmp / "s.sock")
    server = await start_unix_server(handler, path)
    client = await SocketStream.connect_unix(path)
    peer = await accepted.get()
    try:
        yield client, peer
    finally:
        done.set()
        await client.aclose()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def socketpair_adopted() -> AsyncIterator[Pair]:
    """SocketStream.from_socket: how sockets made inside a pod's netns are adopted."""
    x, y = socket.socketpair()
    a, b = await SocketStream.from_socket(x), await SocketStream.from_socket(y)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@contextlib.asynccontextmanager
async def memory() -> AsyncIterator[Pair]:
    a, b = memory_stream_pair()
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@contextlib.asynccontextmanager
async def _spdy_sessions(
    wires: tuple[Any, Any], window: int | None = None
) -> AsyncIterator[tuple[SpdyStream, SpdyStream]]:
    incoming: asyncio.Queue[SpdyStream] = asyncio.Queue()

    def on_stream(stream: SpdyStream) -> None:
        stream.accept()
        incoming.put_nowait(stream)

    client = SpdySession(
        wires[0], SpdyRole.CLIENT, idle_timeout=None, flow_control_window=window, name="client"
    )
    server = SpdySession(
        wires[1],
        SpdyRole.SERVER,
        on_stream=on_stream,
        idle_timeout=None,
        flow_control_window=window,
        name="server",
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        tg.create_task(server.run())
        try:
            a = await client.open_stream({"streamtype": "data", "port": "80", "requestid": "0"})
            b = await incoming.get()
            yield a, b
        finally:
            await client.aclose()
            await server.aclose()


@contextlib.asynccontextmanager
async def spdy() -> AsyncIterator[Pair]:
    x, y = socket.socketpair()
    wires = (await SocketStream.from_socket(x), await SocketStream.from_socket(y))
    async with _spdy_sessions(wires) as pair:
        yield pair


@contextlib.asynccontextmanager
async def spdy_server_side() -> AsyncIterator[Pair]:
    x, y = socket.socketpair()
    wires = (await SocketStream.from_socket(x), await SocketStream.from_socket(y))
    async with _spdy_sessions(wires) as (a, b):
        yield b, a


@contextlib.asynccontextmanager
async def spdy_flow_control() -> AsyncIterator[Pair]:
    x, y = socket.socketpair()
    wires = (await SocketStream.from_socket(x), await SocketStream.from_socket(y))
    async with _spdy_sessions(wires, window=4 * 1024 * 1024) as pair:
        yield pair


@contextlib.asynccontextmanager
async def tunnel() -> AsyncIterator[Pair]:
    x, y = socket.socketpair()
    a, b = await SocketStream.from_socket(x), await SocketStream.from_socket(y)
    wires = (
        TunnelWire(a, TunnelConnection(Role.CLIENT)),
        TunnelWire(b, TunnelConnection(Role.SERVER)),
    )
    async with _spdy_sessions(wires) as pair:
        yield pair


@contextlib.asynccontextmanager
async def ws_channel() -> AsyncIterator[Pair]:
    """Channel 0 of a v5 channel session (stdin one way; the same channel carries both)."""
    x, y = socket.socketpair()
    a, b = await SocketStream.from_socket(x), await SocketStream.from_socket(y)
    client = ChannelSession(a, ChannelConnection(Role.CLIENT, V5), name="client")
    server = ChannelSession(b, ChannelConnection(Role.SERVER, V5), name="server")
    streams = client.stream(0), server.stream(0)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        tg.create_task(server.run())
        try:
            yield streams
        finally:
            await client.aclose()
            await server.aclose()


@contextlib.asynccontextmanager
async def datagram() -> AsyncIterator[Pair]:
    x = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    x.bind(("127.0.0.1", 0))
    y = connected_udp_socket(*x.getsockname())
    x.connect(y.getsockname())
    a, b = DatagramStream(x), DatagramStream(y)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@contextlib.asynccontextmanager
async def throttled() -> AsyncIterator[Pair]:
    async with tcp() as (a, b):
        yield ThrottledStream(a, THROTTLE_BYTES_PER_SECOND), b


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Pair]:
    """The gateway's view of one runtime port-forward pair (data + error stream)."""
    x, y = socket.socketpair()
    wires = (await SocketStream.from_socket(x), await SocketStream.from_socket(y))
    async with _spdy_sessions(wires) as (data, peer):
        error = await data.session.open_stream({"streamtype": "error", "requestid": "0"})
        forwarded = ForwardedStream(data=data, error_stream=error, request_id="0")
        closed: list[bool] = []
        stream = UpstreamStream(forwarded, 80, lambda: closed.append(True))
        try:
            yield stream, peer
        finally:
            await stream.aclose()
        assert closed == [True]


@contextlib.asynccontextmanager
async def exec_forward() -> AsyncIterator[Pair]:
    async with tcp() as (a, b):
        done = asyncio.Event()

        async def forwarder() -> str | None:
            await done.wait()
            return None

        task = asyncio.create_task(forwarder())
        try:
            yield ExecForwardStream(a, task), b
        finally:
            done.set()
            await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def process() -> AsyncIterator[Pair]:
    """podgate's own forwarder process (`podgate agent forward PORT`), as exec-based port
    forwarding runs it inside the container, relaying its stdio to a TCP listener."""
    accepted: asyncio.Queue[SocketStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: SocketStream) -> None:
        await accepted.put(stream)
        await done.wait()

    server = await start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    argv = forwarder_argv(
        f"podgate {sys.executable}", port, half_close_grace=FORWARDER_HALF_CLOSE_GRACE_SECONDS
    )
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    stream = ProcessStream(proc, "127.0.0.1", "error forwarding port: ")
    try:
        peer = await asyncio.wait_for(accepted.get(), 30)
        yield stream, peer
    finally:
        await stream.aclose()
        done.set()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def agent_connection() -> AsyncIterator[Pair]:
    pod = types.SimpleNamespace(id="pod", metadata=types.SimpleNamespace(uid="uid"))
    async with tcp() as (a, b):
        assert isinstance(a, SocketStream)

        async def shim_confirms_the_end() -> None:
            return None

        yield _AgentStream(a, pod, 80, shim_confirms_the_end), b  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def shim_relay() -> AsyncIterator[Pair]:
    async with _tcp_pair() as (a, b), _tcp_pair() as (c, _d):
        relay = _Relay(a, c)
        yield _Tracked(a, relay), b


@contextlib.asynccontextmanager
async def cli_fd() -> AsyncIterator[Pair]:
    """The CLI's stdio descriptor (here one end of a socketpair, as under a supervisor)."""
    x, y = socket.socketpair()
    fd = os.dup(x.fileno())
    x.close()
    stream = FdStream(fd)
    peer = await SocketStream.from_socket(y)
    try:
        yield stream, peer
    finally:
        await stream.aclose()
        os.close(fd)
        await peer.aclose()


SUBJECTS: dict[str, Callable[..., contextlib.AbstractAsyncContextManager[Pair]]] = {
    "socket_tcp": tcp,
    "socket_unix": unix,
    "socket_adopted": socketpair_adopted,
    "memory": memory,
    "spdy_client": spdy,
    "spdy_server": spdy_server_side,
    "spdy_flow_control": spdy_flow_control,
    "spdy_tunnel": tunnel,
    "ws_channel": ws_channel,
    "datagram": datagram,
    "throttled": throttled,
    "upstream": upstream,
    "exec_forward": exec_forward,
    "process": process,
    "agent_connection": agent_connection,
    "shim_relay": shim_relay,
    "cli_fd": cli_fd,
}

_DATAGRAM_NO_EOF = "a UDP flow has no end-of-stream on the wire; send_eof() ends it locally"
_DATAGRAM_FRAMED = "send() takes framed datagrams (podgate.proto.datagram), not arbitrary bytes"
_V5_SERVER_NO_CLOSE = (
    "v5 channels: only the client closes a channel (stdin); the server's channels end with "
    "the WebSocket close, and a channel's aclose() is local"
)
_FD_NO_HALF_CLOSE = "stdio descriptor: EOF is the process closing it, send_eof() is a no-op"
_FD_NOT_OWNED = "stdio descriptor: aclose() restores flags, the fd stays the process's"

_FD_BLOCKING_WRITE = (
    "stdio descriptor: a blocking descriptor is written synchronously (stdout may be shared "
    "with other writers, so it is not made non-blocking)"
)

# (subject, check) -> why the subject cannot meet that check by design.
WAIVERS: dict[tuple[str, str], str] = {
    **{
        ("datagram", check): _DATAGRAM_FRAMED
        for check in (
            "eof_received",
            "eof_sent",
            "max_bytes",
            "empty_send",
            "large_send",
            "buffer_types",
            "cancel_receive",
            "concurrent_receive",
            "concurrent_send",
            "half_close_ours_first",
            "half_close_theirs_first",
            "backpressure_and_aclose_wakes_sender",
            "cancel_send",
        )
    },
    ("datagram", "peer_gone"): _DATAGRAM_NO_EOF,
    **{
        ("ws_channel", check): _V5_SERVER_NO_CLOSE
        for check in (
            "eof_received",
            "half_close_ours_first",
            "half_close_theirs_first",
            "peer_gone",
        )
    },
    **{
        ("cli_fd", check): _FD_NO_HALF_CLOSE
        for check in (
            "send_after_send_eof",
            "eof_sent",
            "half_close_ours_first",
            "half_close_theirs_first",
        )
    },
    **{
        ("cli_fd", check): _FD_BLOCKING_WRITE
        for check in ("large_send", "cancel_send", "concurrent_send")
    },
    **{
        ("cli_fd", check): _FD_NOT_OWNED
        for check in (
            "use_after_close",
            "aclose_wakes_receiver",
            "backpressure_and_aclose_wakes_sender",
        )
    },
}


# Seconds a stalled session or socket lingers at close in these tests. The production graces
# (seconds, so a slow peer still gets its last bytes) are bounded already; the checks here are
# about the streams, and only the many blocked-sender checks would pay for them.
TEST_CLOSE_GRACE_SECONDS = 0.5


@pytest.fixture(autouse=True)
def _short_close_graces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(podgate.aio.spdy, "CLOSE_DRAIN_SECONDS", TEST_CLOSE_GRACE_SECONDS)
    monkeypatch.setattr(podgate.aio.streams, "CLOSE_FLUSH_SECONDS", TEST_CLOSE_GRACE_SECONDS)
    monkeypatch.setattr(podgate.aio.wschannel, "CLOSE_HANDSHAKE_SECONDS", TEST_CLOSE_GRACE_SECONDS)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("subject", list(SUBJECTS))
async def test_conformance(subject: str, check: str, tmp_path: Path) -> None:
    reason = WAIVERS.get((subject, check))
    if reason is not None:
        pytest.xfail(reason)  # recorded in the table; the check is not run
    factory = SUBJECTS[subject]
    cm = factory(tmp_path) if subject == "socket_unix" else factory()
    async with asyncio.timeout(120), cm as (a, b):
        await CHECKS[check](a, b)


def test_waivers_name_real_cases() -> None:
    for subject, check in WAIVERS:
        assert subject in SUBJECTS and check in CHECKS, (subject, check)
