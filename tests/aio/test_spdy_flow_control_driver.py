"""The asyncio SPDY driver with per-stream flow control, over a real socketpair.

With flow control on, a stream whose reader never reads costs at most its window and no
longer stops the connection; with it off (every Kubernetes peer) the old head-of-line stall
is kept, and no WINDOW_UPDATE is ever written.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import pytest

from podgate.aio.errors import StreamResetError
from podgate.aio.spdy import (
    MAX_QUEUED_BYTES_PER_STREAM,
    SEND_DATA_FRAME_BYTES,
    SpdySession,
    SpdyStream,
)
from podgate.aio.streams import SocketStream
from podgate.proto.spdy import (
    STREAM_WINDOW_BYTES,
    Event,
    Role,
    SpdyConnection,
    StreamOpened,
    StreamReset,
    WindowUpdated,
    WindowUpdateReceived,
)
from podgate.proto.spdy.frames import encode_data

# The second stream's transfer while the first is stalled, and how long it may take (about a
# second on loopback; the bound only keeps a regression from hanging the run).
TRANSFER_BYTES = 64 * 1024 * 1024
TRANSFER_TIMEOUT_SECONDS = 60.0
# What the stalled stream's writer tries to push (far more than any window or buffer).
STALLED_BYTES = 64 * 1024 * 1024
# How long the stalled writer gets to fill every buffer before the other stream starts.
FILL_SECONDS = 0.5
# Without flow control: how long the second stream is watched to show that it stalls.
STALL_WATCH_SECONDS = 3.0
# Upper bound for anything that should happen "at once" on loopback.
PROMPT_SECONDS = 5.0
# A small window for the byte-exact tests.
SMALL_WINDOW = 64 * 1024
# RST_STREAM status FLOW_CONTROL_ERROR (reference §1.2).
RST_FLOW_CONTROL_ERROR = 7

HEADERS = {"streamtype": "data", "port": "8080", "requestid": "0"}


@dataclass
class Pair:
    client: SpdySession
    server: SpdySession
    incoming: asyncio.Queue[SpdyStream]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def open_accepted(
        self, headers: Mapping[str, str] = HEADERS
    ) -> tuple[SpdyStream, SpdyStream]:
        opening = asyncio.create_task(self.client.open_stream(headers))
        peer = await asyncio.wait_for(self.incoming.get(), PROMPT_SECONDS)
        peer.accept()
        return await asyncio.wait_for(opening, PROMPT_SECONDS), peer


async def socketpair_streams() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


MakePair = Callable[[int | None], Awaitable[Pair]]


@pytest.fixture
async def make_pair() -> AsyncIterator[MakePair]:
    pairs: list[Pair] = []

    async def make(window: int | None) -> Pair:
        a, b = await socketpair_streams()
        incoming: asyncio.Queue[SpdyStream] = asyncio.Queue()
        client = SpdySession(
            a, Role.CLIENT, idle_timeout=None, flow_control_window=window, name="test client"
        )
        server = SpdySession(
            b,
            Role.SERVER,
            on_stream=incoming.put_nowait,
            idle_timeout=None,
            flow_control_window=window,
            name="test server",
        )
        pair = Pair(client, server, incoming)
        pair.tasks = [
            asyncio.create_task(client.run(), name="client run"),
            asyncio.create_task(server.run(), name="server run"),
        ]
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        # The server first: after a stall the client's socket may be full, and closing the
        # server's end lets the client's final drain fail at once.
        await pair.server.aclose()
        await pair.client.aclose()
        for task in pair.tasks:
            task.cancel()
        await asyncio.gather(*pair.tasks, return_exceptions=True)


async def upload(stream: SpdyStream, data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(data), 1 << 20):
        await stream.send(view[start : start + (1 << 20)])
    await stream.send_eof()


async def digest_of(stream: SpdyStream) -> tuple[str, int]:
    sha = hashlib.sha256()
    size = 0
    while chunk := await stream.receive():
        sha.update(chunk)
        size += len(chunk)
    return sha.hexdigest(), size


async def stall_then_transfer(
    pair: Pair,
) -> tuple[SpdyStream, asyncio.Task[None], bytes, asyncio.Future[tuple[None, tuple[str, int]]]]:
    """Stream 1 writes into a reader that never reads; then stream 3 starts a 64 MiB upload
    and its reader hashes everything. Returns the stalled server end, its writer, the payload
    and the transfer task."""
    stalled_client, stalled_server = await pair.open_accepted()
    stalled_writer = asyncio.create_task(upload(stalled_client, os.urandom(STALLED_BYTES)))
    await asyncio.sleep(FILL_SECONDS)
    assert not stalled_writer.done()
    moving_client, moving_server = await pair.open_accepted()
    data = os.urandom(TRANSFER_BYTES)
    transfer = asyncio.gather(upload(moving_client, data), digest_of(moving_server))
    return stalled_server, stalled_writer, data, transfer


async def test_a_stalled_stream_does_not_stop_the_others(make_pair: MakePair) -> None:
    pair = await make_pair(STREAM_WINDOW_BYTES)
    started = time.monotonic()
    stalled_server, stalled_writer, data, transfer = await stall_then_transfer(pair)
    started += FILL_SECONDS
    # The read loop still answers at once while one stream sits on a full window.
    await pair.client.ping(timeout=PROMPT_SECONDS)
    _, (digest, size) = await asyncio.wait_for(transfer, TRANSFER_TIMEOUT_SECONDS)
    elapsed = time.monotonic() - started
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), TRANSFER_BYTES)
    # The stalled stream holds at most one window, unread, and its writer is still waiting.
    assert 0 < stalled_server.bytes_received <= STREAM_WINDOW_BYTES
    assert not stalled_writer.done()
    assert pair.client._core.send_window(1) == STREAM_WINDOW_BYTES - stalled_server.bytes_received
    print(f"64 MiB beside a stalled stream in {elapsed:.2f} s")


async def test_a_stalled_stream_resumes_once_read(make_pair: MakePair) -> None:
    pair = await make_pair(SMALL_WINDOW)
    client_end, server_end = await pair.open_accepted()
    data = os.urandom(8 * 1024 * 1024 + 5)
    writer = asyncio.create_task(upload(client_end, data))
    await asyncio.sleep(0.3)
    assert server_end.bytes_received == SMALL_WINDOW
    assert not writer.done()
    digest, size = await asyncio.wait_for(digest_of(server_end), TRANSFER_TIMEOUT_SECONDS)
    await asyncio.wait_for(writer, PROMPT_SECONDS)
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))


async def test_without_flow_control_a_stalled_stream_stops_the_connection(
    make_pair: MakePair,
) -> None:
    """The Kubernetes behaviour, kept for every non-podgate peer: one full stream buffer
    pauses the read loop, so nothing else on the connection is read (a new stream's
    SYN_STREAM, a PING) until the stalled stream is read."""
    pair = await make_pair(None)
    stalled_client, stalled_server = await pair.open_accepted()
    data = os.urandom(STALLED_BYTES)
    writer = asyncio.create_task(upload(stalled_client, data))
    await asyncio.sleep(FILL_SECONDS)
    opening = asyncio.create_task(pair.client.open_stream(HEADERS))
    with pytest.raises(TimeoutError):
        await pair.client.ping(timeout=STALL_WATCH_SECONDS)
    assert pair.incoming.empty()
    assert not opening.done()
    # One frame past the bound at most: the read loop stops after the frame that filled it.
    assert stalled_server.bytes_received <= MAX_QUEUED_BYTES_PER_STREAM + SEND_DATA_FRAME_BYTES
    # Reading the stalled stream releases the connection: the new stream arrives after it.
    digest = await asyncio.wait_for(digest_of(stalled_server), TRANSFER_TIMEOUT_SECONDS)
    assert digest == (hashlib.sha256(data).hexdigest(), STALLED_BYTES)
    peer = await asyncio.wait_for(pair.incoming.get(), PROMPT_SECONDS)
    peer.accept()
    await asyncio.wait_for(opening, PROMPT_SECONDS)
    await asyncio.wait_for(writer, PROMPT_SECONDS)


# --------------------------------------------------------------------------- against raw bytes


class RawPeer:
    """The server end as bytes: a SocketStream plus a sans-IO core to build and parse frames."""

    def __init__(self, wire: SocketStream, window: int | None) -> None:
        self.wire = wire
        self.core = SpdyConnection(Role.SERVER, flow_control_window=window)
        self.events: list[Event] = []

    async def pump(self, seconds: float) -> None:
        """Read and parse whatever arrives for `seconds`."""
        try:
            async with asyncio.timeout(seconds):
                while data := await self.wire.receive():
                    self.events += self.core.receive_data(data)
        except TimeoutError:
            pass

    async def flush(self) -> None:
        await self.wire.send(self.core.data_to_send())


MakeRaw = Callable[[int | None, int | None], Awaitable[tuple[SpdySession, "RawPeer"]]]


@pytest.fixture
async def raw_client() -> AsyncIterator[MakeRaw]:
    made: list[tuple[SpdySession, asyncio.Task[None], SocketStream]] = []

    async def make(window: int | None, peer_window: int | None) -> tuple[SpdySession, RawPeer]:
        a, b = await socketpair_streams()
        client = SpdySession(
            a, Role.CLIENT, idle_timeout=None, flow_control_window=window, name="test client"
        )
        task = asyncio.create_task(client.run(), name="client run")
        made.append((client, task, b))
        return client, RawPeer(b, peer_window)

    yield make
    for client, task, b in made:
        await client.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await b.aclose()


async def open_raw(client: SpdySession, peer: RawPeer) -> SpdyStream:
    opening = asyncio.create_task(client.open_stream(HEADERS))
    while not any(isinstance(e, StreamOpened) for e in peer.events):
        await peer.pump(0.05)
    opened = next(e for e in peer.events if isinstance(e, StreamOpened))
    peer.events.remove(opened)
    peer.core.reply(opened.stream_id)
    await peer.flush()
    return await asyncio.wait_for(opening, PROMPT_SECONDS)


async def test_window_is_returned_in_batches_of_half_a_window(raw_client: MakeRaw) -> None:
    client, peer = await raw_client(SMALL_WINDOW, SMALL_WINDOW)
    stream = await open_raw(client, peer)
    sid = stream.stream_id
    peer.core.send_data(sid, bytes(SMALL_WINDOW))
    await peer.flush()
    got = 0
    while got < SMALL_WINDOW // 2 - 1:
        got += len(await stream.receive(SMALL_WINDOW // 2 - 1 - got))
    await peer.pump(0.2)
    assert [e for e in peer.events if not isinstance(e, StreamOpened)] == []
    got += len(await stream.receive(1))  # now exactly half the window has been read
    await peer.pump(0.2)
    assert peer.events == [WindowUpdated(sid, SMALL_WINDOW // 2)]
    peer.events.clear()
    while got < SMALL_WINDOW:
        got += len(await stream.receive())
    await peer.pump(0.2)
    assert peer.events == [WindowUpdated(sid, SMALL_WINDOW // 2)]
    assert peer.core.send_window(sid) == SMALL_WINDOW


async def test_a_peer_overrunning_the_window_loses_that_stream_only(raw_client: MakeRaw) -> None:
    # The peer's own core has flow control off, so it can send past our window.
    client, peer = await raw_client(SMALL_WINDOW, None)
    first = await open_raw(client, peer)
    second = await open_raw(client, peer)
    wire = encode_data(first.stream_id, bytes(SMALL_WINDOW + 1)) + encode_data(
        second.stream_id, b"fine", flags=1
    )
    await peer.wire.send(wire)
    with pytest.raises(StreamResetError) as caught:
        async with asyncio.timeout(PROMPT_SECONDS):
            while await first.receive():
                pass
    assert caught.value.status == RST_FLOW_CONTROL_ERROR
    assert await asyncio.wait_for(second.receive(), PROMPT_SECONDS) == b"fine"
    assert await asyncio.wait_for(second.receive(), PROMPT_SECONDS) == b""
    await peer.pump(0.2)
    assert peer.events == [StreamReset(first.stream_id, RST_FLOW_CONTROL_ERROR)]


async def test_without_flow_control_no_window_update_is_ever_written(raw_client: MakeRaw) -> None:
    client, peer = await raw_client(None, None)
    stream = await open_raw(client, peer)
    size = 16 * 1024 * 1024
    peer.core.send_data(stream.stream_id, bytes(size), fin=True)
    sender = asyncio.create_task(peer.flush())
    got = 0
    while chunk := await asyncio.wait_for(stream.receive(), PROMPT_SECONDS):
        got += len(chunk)
    await asyncio.wait_for(sender, PROMPT_SECONDS)
    await peer.pump(0.3)
    assert got == size
    assert not any(isinstance(e, WindowUpdateReceived) for e in peer.events)
    assert peer.events == []


async def test_a_reset_wakes_a_sender_waiting_for_window(raw_client: MakeRaw) -> None:
    client, peer = await raw_client(SMALL_WINDOW, SMALL_WINDOW)
    stream = await open_raw(client, peer)
    sender = asyncio.create_task(stream.send(bytes(SMALL_WINDOW + 1)))
    await peer.pump(0.2)
    assert not sender.done()
    peer.core.reset_stream(stream.stream_id)
    await peer.flush()
    with pytest.raises(StreamResetError):
        await asyncio.wait_for(sender, PROMPT_SECONDS)
