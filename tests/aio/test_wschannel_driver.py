"""The asyncio WebSocket drivers: ChannelSession (exec/attach and port-forward channels) and
TunnelWire (SPDY inside WebSocket), over a real socketpair.

Where one end must misbehave it is a bare SocketStream driven by wsproto, so the frames on the
wire are exactly what the test wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, TextMessage
from wsproto.events import Event as WsEvent

from podgate.aio.errors import BrokenStreamError, StreamResetError
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.wschannel import ChannelSession, TunnelWire
from podgate.proto.spdy import Role as SpdyRole
from podgate.proto.spdy import SpdyConnection
from podgate.proto.wschannel import (
    ChannelConnection,
    PortForwardChannels,
    Role,
    TunnelConnection,
)

# RFC 6455 close codes.
NORMAL = 1000
PROTOCOL_ERROR = 1002
UNSUPPORTED_DATA = 1003
ABNORMAL = 1006
MESSAGE_TOO_BIG = 1009
PROMPT_SECONDS = 5.0

# Channels 0-4 are stdin, stdout, stderr, error and resize (§5.3); port-forward uses 0-3.
FIRST_UNUSED_CHANNEL = 5
V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
CHANNEL_PROTOCOLS = [
    V5,
    V4,
    "v4.base64.channel.k8s.io",
    "base64.channel.k8s.io",
    "channel.k8s.io",
]


async def socketpair_streams() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


async def receive_all(stream: ByteStream) -> bytes:
    parts = []
    while chunk := await stream.receive():
        parts.append(chunk)
    return b"".join(parts)


async def receive_exactly(stream: ByteStream, size: int) -> bytes:
    parts = []
    got = 0
    while got < size:
        chunk = await stream.receive()
        assert chunk, f"EOF after {got} of {size} bytes"
        parts.append(chunk)
        got += len(chunk)
    data = b"".join(parts)
    assert len(data) == size
    return data


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@dataclass
class Sessions:
    client: ChannelSession
    server: ChannelSession
    server_wire: SocketStream
    tasks: list[asyncio.Task[None]]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()
        await self.server.aclose()


async def start_sessions(
    protocol: str,
    *,
    server_core: ChannelConnection | None = None,
    client_core: ChannelConnection | None = None,
) -> Sessions:
    a, b = await socketpair_streams()
    client = ChannelSession(
        a, client_core or ChannelConnection(Role.CLIENT, protocol), name="test client"
    )
    server = ChannelSession(
        b, server_core or ChannelConnection(Role.SERVER, protocol), name="test server"
    )
    for session in (client, server):
        for channel in range(FIRST_UNUSED_CHANNEL):
            session.stream(channel)  # handlers take their channels before data flows
    tasks = [asyncio.create_task(client.run()), asyncio.create_task(server.run())]
    return Sessions(client, server, b, tasks)


class RawWs:
    """One end as bytes: a SocketStream and a wsproto connection."""

    def __init__(self, wire: SocketStream, kind: ConnectionType) -> None:
        self.wire = wire
        self.ws = Connection(kind)

    async def send(self, event: WsEvent) -> None:
        await self.wire.send(self.ws.send(event))

    async def next_close(self) -> CloseConnection:
        async with asyncio.timeout(PROMPT_SECONDS):
            while True:
                data = await self.wire.receive()
                self.ws.receive_data(data or None)
                for event in self.ws.events():
                    if isinstance(event, CloseConnection):
                        return event
                if not data:
                    raise AssertionError("EOF without a close frame")


# --------------------------------------------------------------------------- channel sessions


@pytest.mark.parametrize("protocol", CHANNEL_PROTOCOLS)
async def test_channels_carry_exact_bytes_each_way(protocol: str) -> None:
    s = await start_sessions(protocol)
    try:
        stdin = payload(1024 * 1024 + 3, seed=1)
        stdout = payload(300 * 1024, seed=2)
        upload = asyncio.create_task(s.client.stream(0).send(stdin))
        await s.server.stream(1).send(stdout)
        await s.server.stream(2).send(b"on stderr")
        await s.server.stream(3).send(b"status")
        got_in = await asyncio.wait_for(receive_exactly(s.server.stream(0), len(stdin)), 30)
        await upload
        assert got_in == stdin
        assert await receive_exactly(s.client.stream(1), len(stdout)) == stdout
        assert await receive_exactly(s.client.stream(2), 9) == b"on stderr"
        assert await receive_exactly(s.client.stream(3), 6) == b"status"
    finally:
        await s.close()


async def test_v5_close_signal_is_stdin_eof() -> None:
    s = await start_sessions(V5)
    try:
        await s.client.stream(0).send(b"last words")
        await s.client.stream(0).send_eof()
        got = await asyncio.wait_for(receive_all(s.server.stream(0)), PROMPT_SECONDS)
        assert got == b"last words"
        # Only that input ended: others still work.
        await s.client.stream(4).send(b'{"Width":1,"Height":2}\n')
        resize = await asyncio.wait_for(s.server.stream(4).receive(), PROMPT_SECONDS)
        assert resize == b'{"Width":1,"Height":2}\n'
    finally:
        await s.close()


async def test_v4_has_no_close_signal() -> None:
    s = await start_sessions(V4)
    try:
        await s.client.stream(0).send(b"data")
        await s.client.stream(0).send_eof()  # nothing to send in v4
        await s.client.stream(4).send(b"later")  # messages arrive in order
        assert await asyncio.wait_for(s.server.stream(4).receive(), PROMPT_SECONDS) == b"later"
        assert await s.server.stream(0).receive() == b"data"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.server.stream(0).receive(), 0.1)
    finally:
        await s.close()


async def test_server_close_1000_is_eof_on_every_client_channel() -> None:
    s = await start_sessions(V5)
    try:
        status = s.client.stream(3)
        await s.server.stream(1).send(b"bye")
        started = time.monotonic()
        await asyncio.wait_for(s.server.aclose(NORMAL), PROMPT_SECONDS)
        # The client answered the close frame, so the server did not wait out its 2 s.
        assert time.monotonic() - started < 1.5
        await asyncio.wait_for(s.client.done.wait(), PROMPT_SECONDS)
        assert s.client.close_code == NORMAL
        assert s.client.broken is None
        assert await receive_all(s.client.stream(1)) == b"bye"
        assert await receive_all(status) == b""
    finally:
        await s.close()


async def test_channel_first_used_after_the_end_reads_eof() -> None:
    """A handler that looks up its channel only after the peer went away (a port-forward
    task starting late) must see EOF, not wait forever."""
    s = await start_sessions(V5)
    try:
        s.server_wire.abort()
        await asyncio.wait_for(s.client.done.wait(), PROMPT_SECONDS)
        late = s.client.stream(FIRST_UNUSED_CHANNEL + 1)
        assert await asyncio.wait_for(receive_all(late), PROMPT_SECONDS) == b""
    finally:
        await s.close()


async def test_end_without_close_frame_is_1006() -> None:
    s = await start_sessions(V5)
    try:
        stdout = s.client.stream(1)
        s.server_wire.abort()
        await asyncio.wait_for(s.client.done.wait(), PROMPT_SECONDS)
        assert s.client.close_code == ABNORMAL
        # A connection lost without the close handshake is an error, not a clean end.
        with pytest.raises(BrokenStreamError):
            await receive_all(stdout)
    finally:
        await s.close()


async def test_oversize_message_closes_with_1009() -> None:
    limit = 64 * 1024
    core = ChannelConnection(Role.SERVER, V5, max_message_bytes=limit)
    s = await start_sessions(V5, server_core=core)
    try:
        await s.client.stream(0).send(bytes(limit + 1))  # one message: channel byte + payload
        await asyncio.wait_for(s.client.done.wait(), PROMPT_SECONDS)
        assert s.client.close_code == MESSAGE_TOO_BIG
        await asyncio.wait_for(s.server.done.wait(), PROMPT_SECONDS)
    finally:
        await s.close()


async def test_text_message_to_a_v5_client_closes_with_1003() -> None:
    a, b = await socketpair_streams()
    client = ChannelSession(a, ChannelConnection(Role.CLIENT, V5), name="test client")
    task = asyncio.create_task(client.run())
    server = RawWs(b, ConnectionType.SERVER)
    try:
        await server.send(TextMessage(data="1hello"))
        close = await server.next_close()
        assert close.code == UNSUPPORTED_DATA
        await asyncio.wait_for(client.done.wait(), PROMPT_SECONDS)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await b.aclose()


@pytest.mark.parametrize(
    "message",
    [b"\xff", b"\xff\x00\x00", b"\xff\x07"],
    ids=["too-short", "too-long", "unknown-channel"],
)
async def test_malformed_v5_close_message_closes_with_1002(message: bytes) -> None:
    a, b = await socketpair_streams()
    server = ChannelSession(b, ChannelConnection(Role.SERVER, V5), name="test server")
    task = asyncio.create_task(server.run())
    client = RawWs(a, ConnectionType.CLIENT)
    try:
        await client.send(BytesMessage(data=message))
        close = await client.next_close()
        assert close.code == PROTOCOL_ERROR
        await asyncio.wait_for(server.done.wait(), PROMPT_SECONDS)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.aclose()
        await a.aclose()


async def test_slow_reader_holds_back_the_sender() -> None:
    s = await start_sessions(V5)
    try:
        data = payload(16 * 1024 * 1024, seed=3)
        upload = asyncio.create_task(s.client.stream(0).send(data))
        await asyncio.sleep(0.5)
        assert not upload.done()  # nobody reads channel 0 yet
        got = await asyncio.wait_for(receive_exactly(s.server.stream(0), len(data)), 60)
        await asyncio.wait_for(upload, PROMPT_SECONDS)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    finally:
        await s.close()


async def test_unread_channel_does_not_stall_the_others() -> None:
    """Data for a channel nobody reads (unrequested, or >= 5) must not stop stdin: upstream
    drops such messages."""
    s = await start_sessions(V5)
    try:
        stdin = s.server.stream(0)  # the one input the server handler uses
        await s.client.stream(9).send(bytes(3 * 1024 * 1024))
        await s.client.stream(0).send(b"stdin after the junk")
        await s.client.stream(0).send_eof()
        got = await asyncio.wait_for(receive_all(stdin), PROMPT_SECONDS)
        assert got == b"stdin after the junk"
    finally:
        await s.close()


# --------------------------------------------------------------------------- port-forward channels


async def test_port_forward_channels_strip_port_headers() -> None:
    ports = [80, 8080]
    client_core = ChannelConnection(
        Role.CLIENT, V4, port_channels=PortForwardChannels(ports, Role.CLIENT)
    )
    s = await start_sessions(V4, client_core=client_core)
    try:
        # The server's first message on every channel is its port, uint16 little-endian.
        for index, port in enumerate(ports):
            s.server.send_nowait(2 * index, port.to_bytes(2, "little"))
            s.server.send_nowait(2 * index + 1, port.to_bytes(2, "little"))
        await s.server.stream(0).send(b"from 80")
        await s.server.stream(3).send(b"error on 8080")
        await s.server.stream(2).send(b"from 8080")
        assert await receive_exactly(s.client.stream(0), 7) == b"from 80"
        assert await receive_exactly(s.client.stream(2), 9) == b"from 8080"
        assert await receive_exactly(s.client.stream(3), 13) == b"error on 8080"
        await s.client.stream(2).send(b"to 8080")  # the client sends no prefix
        assert await receive_exactly(s.server.stream(2), 7) == b"to 8080"
    finally:
        await s.close()


async def test_port_header_for_the_wrong_port_closes_with_1002() -> None:
    client_core = ChannelConnection(
        Role.CLIENT, V4, port_channels=PortForwardChannels([80], Role.CLIENT)
    )
    s = await start_sessions(V4, client_core=client_core)
    try:
        s.server.send_nowait(0, (81).to_bytes(2, "little"))
        await asyncio.wait_for(s.client.done.wait(), PROMPT_SECONDS)
        await asyncio.wait_for(s.server.done.wait(), PROMPT_SECONDS)
        assert s.server.close_code == PROTOCOL_ERROR
    finally:
        await s.close()


# --------------------------------------------------------------------------- the SPDY tunnel


@dataclass
class Tunnel:
    client: SpdySession
    server: SpdySession
    incoming: asyncio.Queue[SpdyStream]
    tasks: list[asyncio.Task[None]]

    async def close(self) -> None:
        await self.client.aclose()
        await self.server.aclose()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def tunnel() -> AsyncIterator[Tunnel]:
    a, b = await socketpair_streams()
    incoming: asyncio.Queue[SpdyStream] = asyncio.Queue()
    client = SpdySession(
        TunnelWire(a, TunnelConnection(Role.CLIENT)), SpdyRole.CLIENT, idle_timeout=None
    )
    server = SpdySession(
        TunnelWire(b, TunnelConnection(Role.SERVER)),
        SpdyRole.SERVER,
        on_stream=incoming.put_nowait,
        idle_timeout=None,
    )
    t = Tunnel(client, server, incoming, [])
    t.tasks = [asyncio.create_task(client.run()), asyncio.create_task(server.run())]
    yield t
    await t.close()


async def test_spdy_through_the_tunnel_both_ways(tunnel: Tunnel) -> None:
    opening = asyncio.create_task(tunnel.client.open_stream({"streamtype": "data", "port": "1"}))
    peer = await asyncio.wait_for(tunnel.incoming.get(), PROMPT_SECONDS)
    assert peer.headers == {"streamtype": "data", "port": "1"}
    peer.accept()
    stream = await asyncio.wait_for(opening, PROMPT_SECONDS)
    up = payload(2 * 1024 * 1024 + 5, seed=4)
    down = payload(2 * 1024 * 1024 + 9, seed=5)

    async def send(s: SpdyStream, data: bytes) -> None:
        await s.send(data)
        await s.send_eof()

    senders = [asyncio.create_task(send(stream, up)), asyncio.create_task(send(peer, down))]
    got_up, got_down = await asyncio.wait_for(
        asyncio.gather(receive_all(peer), receive_all(stream)), 30
    )
    await asyncio.gather(*senders)
    assert got_up == up and got_down == down
    assert 0 <= await tunnel.client.ping(timeout=PROMPT_SECONDS) < PROMPT_SECONDS


async def test_close_1000_inside_the_tunnel_is_eof(tunnel: Tunnel) -> None:
    opening = asyncio.create_task(tunnel.client.open_stream({"streamtype": "error"}))
    peer = await asyncio.wait_for(tunnel.incoming.get(), PROMPT_SECONDS)
    peer.accept()
    stream = await asyncio.wait_for(opening, PROMPT_SECONDS)
    await peer.send(b"last")
    await tunnel.server.aclose()  # RST, GOAWAY, then a WebSocket close 1000
    await asyncio.wait_for(tunnel.client.done.wait(), PROMPT_SECONDS)
    assert tunnel.client.goaway_received
    assert await stream.receive() == b"last"
    with pytest.raises(StreamResetError):  # reset by the server's close
        await stream.receive()


async def test_tunnel_accepts_kubectl_style_fragments_and_empty_messages() -> None:
    """kubectl writes each framer field as its own message and empty DATA as an empty one."""
    a, b = await socketpair_streams()
    incoming: asyncio.Queue[SpdyStream] = asyncio.Queue()
    server = SpdySession(
        TunnelWire(b, TunnelConnection(Role.SERVER)),
        SpdyRole.SERVER,
        on_stream=incoming.put_nowait,
        idle_timeout=None,
    )
    task = asyncio.create_task(server.run())
    raw = RawWs(a, ConnectionType.CLIENT)
    core = SpdyConnection(SpdyRole.CLIENT)
    try:
        sid = core.open_stream({"streamtype": "data", "port": "7", "requestid": "0"})
        core.send_data(sid, b"hello tunnel")
        core.end_stream(sid)
        spdy_bytes = core.data_to_send()
        cuts = [2, 2, 4, 4, 4, 1, 1]
        pos = 0
        for size in [*cuts, *([3] * len(spdy_bytes))]:
            if pos >= len(spdy_bytes):
                break
            await raw.send(BytesMessage(data=spdy_bytes[pos : pos + size]))
            await raw.send(BytesMessage(data=b""))
            pos += size
        peer = await asyncio.wait_for(incoming.get(), PROMPT_SECONDS)
        assert peer.headers == {"streamtype": "data", "port": "7", "requestid": "0"}
        peer.accept()
        assert await asyncio.wait_for(receive_all(peer), PROMPT_SECONDS) == b"hello tunnel"
    finally:
        await server.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await a.aclose()


async def test_text_message_in_the_tunnel_breaks_it_with_1003() -> None:
    a, b = await socketpair_streams()
    server = SpdySession(
        TunnelWire(b, TunnelConnection(Role.SERVER)), SpdyRole.SERVER, idle_timeout=None
    )
    task = asyncio.create_task(server.run())
    raw = RawWs(a, ConnectionType.CLIENT)
    try:
        await raw.send(TextMessage(data="not binary"))
        await asyncio.wait_for(server.done.wait(), PROMPT_SECONDS)
        assert server.broken is not None
        await server.aclose()
        close = await raw.next_close()
        assert close.code == UNSUPPORTED_DATA
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await a.aclose()
