"""A SPDY peer that abuses the session: control-frame floods and unbounded stream counts.

The peer is a bare socket fed with frames built by hand, so the flood is exactly what the
test wrote; the session under test is the asyncio driver every podgate server runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from podgate.aio.errors import BrokenStreamError, ClosedStreamError
from podgate.aio.spdy import (
    CONTROL_FRAME_BURST,
    MAX_QUEUED_BYTES_PER_STREAM,
    MAX_STREAMS_PER_SESSION,
    PARSE_SLICE_BYTES,
    ControlBudget,
    SpdySession,
    SpdyStream,
)
from podgate.aio.streams import SocketStream
from podgate.aio.wschannel import TunnelWire
from podgate.proto.spdy import GoAwayReceived, Role, SpdyConnection, StreamReset
from podgate.proto.spdy.events import Event, PingAcknowledged, PingReceived, StreamReplied
from podgate.proto.spdy.frames import GoAwayStatus, RstStatus, encode_ping
from podgate.proto.wschannel import Role as WsRole
from podgate.proto.wschannel import TunnelConnection

PROMPT_SECONDS = 20.0
# Far above the burst: what a flooding client sends in well under a second.
FLOOD_PINGS = 20 * CONTROL_FRAME_BURST
PING_FRAME_BYTES = len(encode_ping(1))
# The stall limit of the session under test: short, so the test does not wait the default.
STALL_LIMIT_SECONDS = 2.0


class Peer:
    """The client end as bytes: a socket plus a sans-IO core to build and parse frames."""

    def __init__(self, wire: SocketStream) -> None:
        self.wire = wire
        self.core = SpdyConnection(Role.CLIENT)
        self.events: list[Event] = []

    async def read_all(self) -> None:
        """Read until the server closes the connection (a close with our flood still unread
        in its socket is a reset: what arrived before it counts)."""
        with contextlib.suppress(BrokenStreamError):
            async with asyncio.timeout(PROMPT_SECONDS):
                while data := await self.wire.receive():
                    self.events += self.core.receive_data(data)


@pytest.fixture
async def served() -> AsyncIterator[tuple[SpdySession, Peer, list[SpdyStream]]]:
    a, b = socket.socketpair()
    server_wire, peer_wire = await SocketStream.from_socket(a), await SocketStream.from_socket(b)
    accepted: list[SpdyStream] = []

    def on_stream(stream: SpdyStream) -> None:
        stream.accept()
        accepted.append(stream)

    server = SpdySession(
        server_wire, Role.SERVER, on_stream=on_stream, idle_timeout=None, name="server"
    )

    async def serve() -> None:
        try:
            await server.run()
        finally:
            await server.aclose()  # as the streaming servers do when the session ends

    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve())
        yield server, Peer(peer_wire), accepted
        await server.aclose()
    await peer_wire.aclose()


async def test_ping_flood_gets_goaway_instead_of_echoes(
    served: tuple[SpdySession, Peer, list[SpdyStream]],
) -> None:
    server, peer, _ = served
    flood = b"".join(encode_ping(2 * i + 1) for i in range(FLOOD_PINGS))
    await peer.wire.send(flood)
    await peer.read_all()
    goaways = [e for e in peer.events if isinstance(e, GoAwayReceived)]
    echoes = [e for e in peer.events if isinstance(e, PingAcknowledged)]
    assert [g.status for g in goaways] == [GoAwayStatus.PROTOCOL_ERROR]
    # Echoed at most the burst the budget allows, never the whole flood.
    assert len(echoes) <= CONTROL_FRAME_BURST
    assert server.done.is_set()


async def test_ping_flood_is_refused_before_a_whole_read_is_parsed(
    served: tuple[SpdySession, Peer, list[SpdyStream]],
) -> None:
    """Each slice of a read is charged to the budget before the next is parsed: the flood
    costs the session the burst plus one slice of parsed PINGs, not whole reads of them."""
    server, peer, _ = served
    parsed = 0
    receive_data = server._core.receive_data

    def counting(data: bytes) -> list[Event]:
        nonlocal parsed
        events = receive_data(data)
        parsed += sum(isinstance(e, PingReceived) for e in events)
        return events

    server._core.receive_data = counting  # type: ignore[method-assign]
    await peer.wire.send(b"".join(encode_ping(2 * i + 1) for i in range(FLOOD_PINGS)))
    await peer.read_all()
    assert any(isinstance(e, GoAwayReceived) for e in peer.events)
    one_slice = PARSE_SLICE_BYTES // PING_FRAME_BYTES + 1
    assert CONTROL_FRAME_BURST < parsed <= CONTROL_FRAME_BURST + 2 * one_slice, parsed


async def test_pings_at_client_go_rate_are_all_answered(
    served: tuple[SpdySession, Peer, list[SpdyStream]],
) -> None:
    _, peer, _ = served
    for _ in range(50):
        peer.core.ping()
        await peer.wire.send(peer.core.data_to_send())
    echoes = 0
    async with asyncio.timeout(PROMPT_SECONDS):
        while echoes < 50:
            data = await peer.wire.receive()
            assert data, "server closed a well-behaved session"
            echoes += sum(isinstance(e, PingAcknowledged) for e in peer.core.receive_data(data))
    assert not any(isinstance(e, GoAwayReceived) for e in peer.events)


async def test_streams_beyond_the_cap_are_refused(
    served: tuple[SpdySession, Peer, list[SpdyStream]],
) -> None:
    server, peer, accepted = served
    extra = 10
    for i in range(MAX_STREAMS_PER_SESSION + extra):
        peer.core.open_stream({"streamtype": "data", "port": "80", "requestid": str(i)})
    await peer.wire.send(peer.core.data_to_send())
    replied = refused = 0
    async with asyncio.timeout(PROMPT_SECONDS):
        while replied + refused < MAX_STREAMS_PER_SESSION + extra:
            data = await peer.wire.receive()
            assert data
            for event in peer.core.receive_data(data):
                replied += isinstance(event, StreamReplied)
                if isinstance(event, StreamReset):
                    assert event.status == RstStatus.REFUSED_STREAM
                    refused += 1
    assert (replied, refused) == (MAX_STREAMS_PER_SESSION, extra)
    assert len(accepted) == MAX_STREAMS_PER_SESSION
    assert server.stream_count == MAX_STREAMS_PER_SESSION


async def test_tunnel_closed_under_a_writer_is_a_stream_error_not_a_traceback() -> None:
    """After the tunnel's WebSocket closed, a SPDY write (a late RST_STREAM, PING or data)
    used to raise wsproto's LocalProtocolError out of the session: now a ClosedStreamError
    the session turns into `broken`."""
    a, b = socket.socketpair()
    wire = TunnelWire(await SocketStream.from_socket(a), TunnelConnection(WsRole.CLIENT))
    peer = await SocketStream.from_socket(b)
    await wire.aclose()
    with pytest.raises(ClosedStreamError):
        wire.writelines([b"late frame"])
    session = SpdySession(wire, Role.CLIENT, idle_timeout=None)
    with pytest.raises(BrokenStreamError):
        await session.ping(timeout=PROMPT_SECONDS)
    await peer.aclose()


async def test_a_reader_that_never_reads_cannot_pin_the_session_after_the_peer_left() -> None:
    """Without flow control a full stream parks the read loop; if nobody ever reads it, the
    stream is reset after the session's stall limit and the loop reads on, so the peer's
    leaving is seen and the session (its socket, its buffers) is released."""
    a, b = socket.socketpair()
    client_wire, server_wire = await SocketStream.from_socket(a), await SocketStream.from_socket(b)
    accepted: list[SpdyStream] = []

    def on_stream(stream: SpdyStream) -> None:
        stream.accept()
        accepted.append(stream)  # and never read

    server = SpdySession(
        server_wire,
        Role.SERVER,
        on_stream=on_stream,
        idle_timeout=None,
        stalled_reset_seconds=STALL_LIMIT_SECONDS,
    )
    client = SpdySession(client_wire, Role.CLIENT, idle_timeout=None)
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(server.run())
        tg.create_task(client.run())
        stream = await client.open_stream({"streamtype": "data", "port": "80", "requestid": "0"})
        sender = tg.create_task(stream.send(bytes(4 * MAX_QUEUED_BYTES_PER_STREAM)))
        await asyncio.sleep(0.5)
        assert not sender.done()  # held by backpressure, not buffered
        sender.cancel()
        client_wire.abort()  # the client leaves abruptly
        async with asyncio.timeout(STALL_LIMIT_SECONDS + PROMPT_SECONDS):
            await serving
        await server.aclose()
        await client.aclose()
    assert server.stream_count == 0
    assert accepted and accepted[0]._chunks == collections.deque()


async def test_sessions_sharing_a_budget_share_its_burst() -> None:
    """A gateway gives all sessions of one user one budget: the user's next session gets no
    fresh burst. The first session floods (and is told so through on_flood); the second is
    refused after a few frames beyond what the first left, not after a burst of its own."""
    budget = ControlBudget()
    floods: list[str] = []
    parsed: list[int] = []

    async def flooded_session(name: str) -> list[Event]:
        a, b = socket.socketpair()
        server_wire = await SocketStream.from_socket(a)
        peer = Peer(await SocketStream.from_socket(b))
        server = SpdySession(
            server_wire,
            Role.SERVER,
            idle_timeout=None,
            name=name,
            control_budget=budget,
            on_flood=lambda: floods.append(name),
        )
        count = 0
        receive_data = server._core.receive_data

        def counting(data: bytes) -> list[Event]:
            nonlocal count
            events = receive_data(data)
            count += sum(isinstance(e, PingReceived) for e in events)
            return events

        server._core.receive_data = counting  # type: ignore[method-assign]

        async def serve() -> None:
            try:
                await server.run()
            finally:
                await server.aclose()  # as the streaming servers do when the session ends

        running = asyncio.create_task(serve())
        await peer.wire.send(b"".join(encode_ping(2 * i + 1) for i in range(FLOOD_PINGS)))
        await peer.read_all()
        await running
        await peer.wire.aclose()
        parsed.append(count)
        return peer.events

    first = await flooded_session("first")
    second = await flooded_session("second")
    for events in (first, second):
        assert [e.status for e in events if isinstance(e, GoAwayReceived)] == [
            GoAwayStatus.PROTOCOL_ERROR
        ]
    assert floods == ["first", "second"]
    one_slice = PARSE_SLICE_BYTES // PING_FRAME_BYTES + 1
    assert parsed[0] > CONTROL_FRAME_BURST
    # The second session starts with the first's debt (less what the short gap refilled).
    assert parsed[1] <= 2 * one_slice, parsed
