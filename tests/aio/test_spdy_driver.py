"""The asyncio SPDY driver (SpdySession/SpdyStream) against itself and against a raw peer.

Both ends run over a real socketpair. Where the peer must misbehave (never reply, send a
broken frame, go away mid-stream) it is a bare SocketStream fed by a sans-IO SpdyConnection,
so the bytes on the wire are exactly what the test wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest

from podgate.aio.errors import BrokenStreamError, ClosedStreamError, StreamResetError
from podgate.aio.spdy import MAX_QUEUED_BYTES_PER_STREAM, SpdySession, SpdyStream
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, ByteStream, SocketStream
from podgate.proto.spdy import (
    DataReceived,
    Event,
    GoAwayReceived,
    Role,
    SpdyConnection,
    StreamOpened,
    StreamReset,
)
from podgate.proto.spdy.frames import encode_control_header, encode_data

# RST_STREAM / GOAWAY status values from the SPDY/3 draft (reference §1.2).
RST_CANCEL = 5
RST_INTERNAL_ERROR = 6
GOAWAY_OK = 0
GOAWAY_PROTOCOL_ERROR = 1
# Control frame type 5 (NOOP) is unknown to spdystream: reading it kills the connection.
NOOP_FRAME_TYPE = 5
# Upper bound for anything that should happen "at once" on loopback.
PROMPT_SECONDS = 5.0

HEADERS = {"streamtype": "data", "port": "8080", "requestid": "0"}


async def socketpair_streams() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


async def receive_all(stream: ByteStream) -> bytes:
    parts = []
    while chunk := await stream.receive():
        parts.append(chunk)
    return b"".join(parts)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@dataclass
class Pair:
    client: SpdySession
    server: SpdySession
    incoming: asyncio.Queue[SpdyStream]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def open_accepted(
        self, headers: Mapping[str, str] = HEADERS
    ) -> tuple[SpdyStream, SpdyStream]:
        """Open a stream from the client, accept it on the server; (client, server) ends."""
        opening = asyncio.create_task(self.client.open_stream(headers))
        peer = await asyncio.wait_for(self.incoming.get(), PROMPT_SECONDS)
        peer.accept()
        return await asyncio.wait_for(opening, PROMPT_SECONDS), peer


async def start_pair(*, server_idle_timeout: float | None = None) -> Pair:
    a, b = await socketpair_streams()
    incoming: asyncio.Queue[SpdyStream] = asyncio.Queue()
    client = SpdySession(a, Role.CLIENT, idle_timeout=None, name="test client")
    server = SpdySession(
        b,
        Role.SERVER,
        on_stream=incoming.put_nowait,
        idle_timeout=server_idle_timeout,
        name="test server",
    )
    pair = Pair(client, server, incoming)
    pair.tasks = [
        asyncio.create_task(client.run(), name="client run"),
        asyncio.create_task(server.run(), name="server run"),
    ]
    return pair


async def stop_pair(pair: Pair) -> None:
    await pair.client.aclose()
    await pair.server.aclose()
    for task in pair.tasks:
        task.cancel()
    await asyncio.gather(*pair.tasks, return_exceptions=True)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await start_pair()
    yield p
    await stop_pair(p)


class RawPeer:
    """The server end as bytes: a SocketStream plus a sans-IO core to build and parse frames."""

    def __init__(self, wire: SocketStream) -> None:
        self.wire = wire
        self.core = SpdyConnection(Role.SERVER)
        self.events: list[Event] = []

    async def read_until(self, predicate: type[Event], *, stream_id: int | None = None) -> Event:
        """Read frames until an event of type `predicate` (for `stream_id`) is seen."""
        async with asyncio.timeout(PROMPT_SECONDS):
            while True:
                for event in self.events:
                    if isinstance(event, predicate) and (
                        stream_id is None or getattr(event, "stream_id", None) == stream_id
                    ):
                        self.events.remove(event)
                        return event
                data = await self.wire.receive()
                if not data:
                    raise AssertionError(f"EOF before {predicate.__name__}; saw {self.events}")
                self.events += self.core.receive_data(data)

    async def flush(self) -> None:
        await self.wire.send(self.core.data_to_send())


@pytest.fixture
async def raw() -> AsyncIterator[tuple[SpdySession, RawPeer]]:
    a, b = await socketpair_streams()
    client = SpdySession(a, Role.CLIENT, idle_timeout=None, name="test client")
    task = asyncio.create_task(client.run(), name="client run")
    peer = RawPeer(b)
    yield client, peer
    await client.aclose()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await b.aclose()


# --------------------------------------------------------------------------- open / data / FIN


async def test_open_accept_data_and_half_close_each_way(pair: Pair) -> None:
    stream, peer = await pair.open_accepted()
    assert peer.headers == HEADERS
    assert stream.stream_id == peer.stream_id == 1  # clients use odd ids from 1 (§1.3)
    data = payload(3 * 1024 * 1024 + 17, seed=1)

    async def upload() -> None:
        await stream.send(data)
        await stream.send_eof()

    task = asyncio.create_task(upload())
    got = await asyncio.wait_for(receive_all(peer), 30)
    await task
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert peer.fin_received and stream.fin_sent
    # Our half is closed, the peer's is not: it can still answer.
    await peer.send(b"answer")
    await peer.send_eof()
    assert await asyncio.wait_for(receive_all(stream), PROMPT_SECONDS) == b"answer"
    # FIN both ways: both sessions forget the stream.
    assert pair.client.stream_count == 0
    assert pair.server.stream_count == 0
    with pytest.raises(ClosedStreamError):
        await stream.send(b"after FIN")


async def test_stream_ids_increase_by_two(pair: Pair) -> None:
    ids = []
    for _ in range(3):
        stream, peer = await pair.open_accepted()
        assert stream.stream_id == peer.stream_id
        ids.append(stream.stream_id)
    assert ids == [1, 3, 5]


async def test_rejected_stream_raises_reset_with_cancel(pair: Pair) -> None:
    opening = asyncio.create_task(pair.client.open_stream(HEADERS))
    peer = await asyncio.wait_for(pair.incoming.get(), PROMPT_SECONDS)
    peer.reset()
    with pytest.raises(StreamResetError) as info:
        await asyncio.wait_for(opening, PROMPT_SECONDS)
    assert info.value.status == RST_CANCEL


async def test_failing_stream_handler_resets_with_internal_error(pair: Pair) -> None:
    def broken_handler(stream: SpdyStream) -> None:
        raise RuntimeError("handler bug")

    pair.server.on_stream = broken_handler
    with pytest.raises(StreamResetError) as info:
        await asyncio.wait_for(pair.client.open_stream(HEADERS), PROMPT_SECONDS)
    assert info.value.status == RST_INTERNAL_ERROR
    # The session survives a stream's failure.
    pair.server.on_stream = pair.incoming.put_nowait
    stream, peer = await pair.open_accepted()
    await stream.send(b"still alive")
    assert await asyncio.wait_for(peer.receive(), PROMPT_SECONDS) == b"still alive"


async def test_reset_mid_stream_ends_both_directions(pair: Pair) -> None:
    stream, peer = await pair.open_accepted()
    await stream.send(b"x")
    assert await asyncio.wait_for(peer.receive(), PROMPT_SECONDS) == b"x"
    peer.reset()
    with pytest.raises(StreamResetError) as info:
        await asyncio.wait_for(stream.receive(), PROMPT_SECONDS)
    assert info.value.status == RST_CANCEL
    with pytest.raises(StreamResetError):
        await stream.send(b"more")
    with pytest.raises(StreamResetError):
        await peer.receive()


async def test_data_sent_before_a_reset_stays_readable(pair: Pair) -> None:
    # The port-forward error text arrives just before the server resets the error stream.
    stream, peer = await pair.open_accepted()
    await peer.send(b"error forwarding port 80")
    peer.reset()
    assert await asyncio.wait_for(stream.receive(), PROMPT_SECONDS) == b"error forwarding port 80"
    with pytest.raises(StreamResetError):
        await stream.receive()


# --------------------------------------------------------------------------- ping


async def test_ping_round_trip_both_directions(pair: Pair) -> None:
    rtt = await pair.client.ping(timeout=PROMPT_SECONDS)
    assert 0 <= rtt < PROMPT_SECONDS
    rtt = await pair.server.ping(timeout=PROMPT_SECONDS)
    assert 0 <= rtt < PROMPT_SECONDS


async def test_unanswered_ping_times_out(raw: tuple[SpdySession, RawPeer]) -> None:
    client, _ = raw  # the raw peer reads nothing, so it echoes nothing
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.ping(timeout=0.2)
    assert 0.2 <= time.monotonic() - started < PROMPT_SECONDS


# --------------------------------------------------------------------------- timeouts


async def test_reply_timeout_raises_broken_and_resets_the_stream(
    raw: tuple[SpdySession, RawPeer],
) -> None:
    client, peer = raw
    started = time.monotonic()
    with pytest.raises(BrokenStreamError, match="SYN_REPLY"):
        await client.open_stream(HEADERS, timeout=0.2)
    assert 0.2 <= time.monotonic() - started < PROMPT_SECONDS
    opened = await peer.read_until(StreamOpened)
    assert isinstance(opened, StreamOpened) and opened.headers == HEADERS
    reset = await peer.read_until(StreamReset, stream_id=opened.stream_id)
    assert isinstance(reset, StreamReset) and reset.status == RST_CANCEL


async def test_idle_timeout_resets_streams_and_says_goaway() -> None:
    pair = await start_pair(server_idle_timeout=0.3)
    try:
        stream, peer = await pair.open_accepted()
        started = time.monotonic()
        server_run = pair.tasks[1]
        await asyncio.wait_for(asyncio.shield(server_run), PROMPT_SECONDS)  # ends cleanly
        assert time.monotonic() - started >= 0.25
        # The client learns it from RST CANCEL on its stream, then GOAWAY.
        with pytest.raises(StreamResetError) as info:
            await asyncio.wait_for(stream.receive(), PROMPT_SECONDS)
        assert info.value.status == RST_CANCEL
        await asyncio.wait_for(pair.client.done.wait(), PROMPT_SECONDS)
        assert pair.client.goaway_received
        with pytest.raises(StreamResetError):
            await peer.receive()
    finally:
        await stop_pair(pair)


async def test_traffic_keeps_an_idle_timeout_from_firing() -> None:
    pair = await start_pair(server_idle_timeout=0.6)
    try:
        stream, peer = await pair.open_accepted()
        for _ in range(10):  # 1 s in all, well past the idle timeout
            await asyncio.sleep(0.1)
            await stream.send(b".")
        assert not pair.server.done.is_set()
        got = b""
        while len(got) < 10:
            got += await asyncio.wait_for(peer.receive(), PROMPT_SECONDS)
        assert got == b"." * 10
    finally:
        await stop_pair(pair)


# --------------------------------------------------------------------------- GOAWAY and teardown


async def test_client_close_resets_streams_and_ends_the_server_session(pair: Pair) -> None:
    _, peer = await pair.open_accepted()
    await pair.client.aclose()
    with pytest.raises(StreamResetError) as info:
        await asyncio.wait_for(peer.receive(), PROMPT_SECONDS)
    assert info.value.status == RST_CANCEL
    await asyncio.wait_for(pair.server.done.wait(), PROMPT_SECONDS)
    assert pair.server.goaway_received
    with pytest.raises(BrokenStreamError):
        await pair.client.open_stream(HEADERS)


async def test_goaway_delivers_queued_data_then_eof_and_ignores_later_frames(
    raw: tuple[SpdySession, RawPeer],
) -> None:
    client, peer = raw
    opening = asyncio.create_task(client.open_stream(HEADERS))
    opened = await peer.read_until(StreamOpened)
    sid = opened.stream_id  # type: ignore[attr-defined]
    peer.core.reply(sid)
    await peer.flush()
    stream = await asyncio.wait_for(opening, PROMPT_SECONDS)
    # DATA, GOAWAY, DATA in one write: the read loop stops at the GOAWAY.
    peer.core.send_data(sid, b"before")
    peer.core.goaway(GOAWAY_OK)
    await peer.wire.send(peer.core.data_to_send() + encode_data(sid, b"after"))
    assert await asyncio.wait_for(receive_all(stream), PROMPT_SECONDS) == b"before"
    await asyncio.wait_for(client.done.wait(), PROMPT_SECONDS)
    assert client.goaway_received
    with pytest.raises(BrokenStreamError):
        await client.open_stream(HEADERS)


async def test_connection_loss_delivers_received_data_then_an_error(
    raw: tuple[SpdySession, RawPeer],
) -> None:
    client, peer = raw
    opening = asyncio.create_task(client.open_stream(HEADERS))
    opened = await peer.read_until(StreamOpened)
    sid = opened.stream_id  # type: ignore[attr-defined]
    peer.core.reply(sid)
    peer.core.send_data(sid, b"partial answer")  # no FIN
    await peer.flush()
    stream = await asyncio.wait_for(opening, PROMPT_SECONDS)
    second = asyncio.create_task(client.open_stream({"streamtype": "error"}))
    await peer.read_until(StreamOpened)
    await peer.wire.aclose()  # TCP close, no GOAWAY
    # What arrived is still read; then, unlike spdystream's EOF, the loss is an error (a
    # runtime that went away must not look like a clean end); a pending open fails.
    assert await asyncio.wait_for(stream.receive(), PROMPT_SECONDS) == b"partial answer"
    with pytest.raises(BrokenStreamError):
        await asyncio.wait_for(stream.receive(), PROMPT_SECONDS)
    with pytest.raises(BrokenStreamError):
        await asyncio.wait_for(second, PROMPT_SECONDS)
    await asyncio.wait_for(client.done.wait(), PROMPT_SECONDS)
    assert client.broken is not None


async def test_unknown_control_frame_gets_goaway_protocol_error(
    raw: tuple[SpdySession, RawPeer],
) -> None:
    client, peer = raw
    await peer.wire.send(encode_control_header(NOOP_FRAME_TYPE, 0, 0))
    goaway = await peer.read_until(GoAwayReceived)
    assert isinstance(goaway, GoAwayReceived) and goaway.status == GOAWAY_PROTOCOL_ERROR
    await asyncio.wait_for(client.done.wait(), PROMPT_SECONDS)
    with pytest.raises(BrokenStreamError):
        await client.open_stream(HEADERS)


# --------------------------------------------------------------------------- backpressure


async def test_slow_reader_stops_the_sender_then_everything_arrives(pair: Pair) -> None:
    stream, peer = await pair.open_accepted()
    data = payload(32 * 1024 * 1024, seed=2)

    async def upload() -> None:
        await stream.send(data)
        await stream.send_eof()

    task = asyncio.create_task(upload())
    await asyncio.sleep(0.5)
    # Nobody read: the sender is held back, and the receiver buffered only its bound.
    assert not task.done()
    assert peer.bytes_received <= MAX_QUEUED_BYTES_PER_STREAM + DEFAULT_RECEIVE_BYTES
    got = await asyncio.wait_for(receive_all(peer), 60)
    await asyncio.wait_for(task, PROMPT_SECONDS)
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()


async def test_concurrent_senders_on_one_session_all_finish(pair: Pair) -> None:
    """Several streams wait for the same congested socket; every one must be woken."""
    streams = [await pair.open_accepted() for _ in range(4)]
    blobs = [payload(8 * 1024 * 1024, seed=10 + i) for i in range(len(streams))]

    async def upload(stream: SpdyStream, data: bytes) -> None:
        await stream.send(data)
        await stream.send_eof()

    senders = [asyncio.create_task(upload(s, d)) for (s, _), d in zip(streams, blobs, strict=True)]
    await asyncio.sleep(0.3)  # let the socket's send buffer fill while nobody reads
    received = await asyncio.wait_for(
        asyncio.gather(*(receive_all(peer) for _, peer in streams)), 60
    )
    done, pending = await asyncio.wait(senders, timeout=PROMPT_SECONDS)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} of {len(senders)} senders never woke up"
    for got, data in zip(received, blobs, strict=True):
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert all(task.exception() is None for task in done)


async def test_data_frames_from_the_peer_reach_the_right_stream(
    raw: tuple[SpdySession, RawPeer],
) -> None:
    """Interleaved DATA of two streams, written as raw frames, split at every byte."""
    client, peer = raw
    sids = []
    streams = []
    for _ in range(2):
        opening = asyncio.create_task(client.open_stream(HEADERS))
        opened = await peer.read_until(StreamOpened)
        sids.append(opened.stream_id)  # type: ignore[attr-defined]
        peer.core.reply(sids[-1])
        await peer.flush()
        streams.append(await asyncio.wait_for(opening, PROMPT_SECONDS))
    wire = b"".join(
        encode_data(sids[i % 2], bytes([65 + i]) * (i + 1), flags=1 if i >= 8 else 0)
        for i in range(10)
    )
    for i in range(len(wire)):
        await peer.wire.send(wire[i : i + 1])
    first, second = await asyncio.wait_for(
        asyncio.gather(receive_all(streams[0]), receive_all(streams[1])), PROMPT_SECONDS
    )
    expected = [b"".join(bytes([65 + i]) * (i + 1) for i in range(k, 10, 2)) for k in (0, 1)]
    assert [first, second] == expected
    assert not any(isinstance(e, DataReceived) for e in peer.events)
