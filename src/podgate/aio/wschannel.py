"""asyncio drivers for the WebSocket channel protocols and the SPDY-in-WebSocket tunnel."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterable

from podgate.aio import heap
from podgate.aio.errors import (
    BrokenStreamError,
    ClosedStreamError,
    ConflictGuard,
    StalledStreamError,
    StreamError,
    fresh,
)
from podgate.aio.spdy import STALLED_STREAM_RESET_SECONDS
from podgate.aio.streams import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    SocketStream,
    drain_unless_ended,
)
from podgate.proto.errors import ProtocolError
from podgate.proto.wschannel import (
    ChannelClosed,
    ChannelConnection,
    ChannelData,
    CloseCode,
    CloseReceived,
    TunnelConnection,
    TunnelData,
)

log = logging.getLogger(__name__)

# The exec/attach channels are 0–4; upstream drops messages for any other.
FIRST_UNKNOWN_CHANNEL = 5
# Received bytes one channel may hold unread before the connection stops reading.
MAX_QUEUED_BYTES_PER_CHANNEL = 2 * 1024 * 1024
# Received bytes all the channels of one session may hold unread: the protocol has no flow
# control, so over it the connection stops reading (the sender meets TCP backpressure) however
# many channels (up to 128 ports) share the WebSocket.
MAX_QUEUED_BYTES_PER_SESSION = 8 * MAX_QUEUED_BYTES_PER_CHANNEL
# Largest payload put in one outgoing WebSocket message.
SEND_MESSAGE_BYTES = 256 * 1024
# After our close frame, how long to wait for the peer's before dropping the connection.
CLOSE_HANDSHAKE_SECONDS = 2.0


class ChannelStream(ByteStream):
    """One numbered channel of a WebSocket channel session."""

    def __init__(self, session: ChannelSession, channel: int) -> None:
        self.session = session
        self.channel = channel
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._eof = False
        self._eof_sent = False
        self._closed = False
        # The connection was lost without a close handshake: raised once the data is read.
        self._lost: BrokenStreamError | None = None
        self._ended = asyncio.Event()  # closed by us: wakes a sender on a stalled socket
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._last_read = 0.0  # loop time of the application's last read
        self._full_since = 0.0  # loop time the queue last went over its budget
        self.stalled = asyncio.Event()  # reset for a stalled reader (see _stall)
        self.stall_error: StalledStreamError | None = None

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            while not self._chunks or self._closed:
                if self._closed:
                    raise ClosedStreamError("channel is closed")
                if self._eof:
                    if self._lost is not None:
                        raise fresh(self._lost)
                    return b""
                self._readable.clear()
                await self._readable.wait()
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self._queued -= len(chunk)
        self._last_read = self.session._release(len(chunk))
        if self._queued <= MAX_QUEUED_BYTES_PER_CHANNEL:
            self._writable.set()
        return chunk

    async def send(self, data: Buffer) -> None:
        with self._sending:
            view = memoryview(data).cast("B")
            for start in range(0, len(view), SEND_MESSAGE_BYTES):
                if self._eof_sent or self._closed:
                    raise ClosedStreamError("write on closed channel")
                self.session.send_nowait(self.channel, view[start : start + SEND_MESSAGE_BYTES])
                if not await drain_unless_ended(self.session.drain(), self._ended):
                    raise ClosedStreamError("channel closed while sending")

    async def send_eof(self) -> None:
        """v5 clients signal it with a CLOSE message; elsewhere the channel just goes quiet."""
        if self._eof_sent or self._closed:
            return
        self._eof_sent = True
        self.session.close_channel_nowait(self.channel)
        with contextlib.suppress(StreamError):
            await self.session.drain()

    async def aclose(self) -> None:
        self._closed = True
        self._drop_chunks()
        self._ended.set()
        self._readable.set()
        self._writable.set()

    async def _feed(self, data: bytes) -> None:
        if self._closed or self._eof:
            return
        self._chunks.append(data)
        self._queued += len(data)
        self.session._queued += len(data)
        self._readable.set()
        if self._queued > MAX_QUEUED_BYTES_PER_CHANNEL:
            if self._writable.is_set():
                self._full_since = asyncio.get_running_loop().time()
            self._writable.clear()
            await self._wait_for_reader()
        else:
            await self.session._wait_for_room()

    async def _wait_for_reader(self) -> None:
        """Stop reading the WebSocket until this channel is read. With `stall_reset` (port
        channels, each an independent connection) a reader that makes no progress for
        STALLED_STREAM_RESET_SECONDS has its channel reset instead, so the others go on."""
        if not self.session.stall_reset:
            await self._writable.wait()
            return
        loop = asyncio.get_running_loop()
        while not self._writable.is_set():
            quiet = loop.time() - max(self._last_read, self._full_since)
            if quiet >= STALLED_STREAM_RESET_SECONDS:
                self._stall(quiet)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._writable.wait(), STALLED_STREAM_RESET_SECONDS - quiet)

    def _stall(self, quiet: float) -> None:
        """Reset: drop what is queued and everything the peer still sends here; the reader
        gets a StalledStreamError (the port-forward server reports it on the error channel)."""
        log.warning(
            "%s: channel %d unread for %.0f s with %d bytes queued: reset",
            self.session.name,
            self.channel,
            quiet,
            self._queued,
        )
        self._drop_chunks()
        self.stall_error = StalledStreamError(f"data unread for {quiet:.0f} s, port reset")
        if not self._eof:
            self._lost = self.stall_error
        self._eof = True
        self._readable.set()
        self._writable.set()
        self.stalled.set()

    def _drop_chunks(self) -> None:
        self._chunks.clear()
        self.session._release(self._queued)
        self._queued = 0

    def _end(self, lost: BrokenStreamError | None = None) -> None:
        if not self._eof:
            self._lost = lost
        self._eof = True
        self._readable.set()


class ChannelSession:
    """Runs a ChannelConnection over a socket; channels are ByteStreams."""

    def __init__(
        self,
        wire: SocketStream,
        core: ChannelConnection,
        *,
        name: str = "ws",
        inbound: Iterable[int] | None = None,
        idle_timeout: float | None = None,
        stall_reset: bool = False,
    ) -> None:
        """`stall_reset`: reset a channel whose reader stalls (port channels) instead of
        waiting for it for ever (exec stdin: a command may read it when it likes)."""
        self._wire = wire
        self._core = core
        self._channels: dict[int, ChannelStream] = {}
        # Channels the peer may send on. Data for others is dropped, as upstream does: a
        # channel nobody reads must not stall the ones that are read.
        self._inbound = set(inbound) if inbound is not None else None
        self._idle_timeout = idle_timeout
        self._timeout: asyncio.Timeout | None = None
        self.stall_reset = stall_reset
        self._queued = 0  # bytes received and not yet read, over all channels
        self._room = asyncio.Event()  # set while _queued is within the session's budget
        self._room.set()
        self._last_read = 0.0
        self._over_since = 0.0
        self._wire_closed = False
        self.name = name
        self.close_code: int | None = None
        self.broken: BrokenStreamError | None = None
        self.done = asyncio.Event()

    @property
    def protocol(self) -> str:
        return self._core.protocol

    @property
    def queued_bytes(self) -> int:
        """Bytes received and not yet read, over all streams of the session."""
        return self._queued

    @property
    def can_close_channels(self) -> bool:
        """Whether a channel's EOF can be signalled on its own (v5), not only by closing."""
        return self._core.can_close_channels

    def stream(self, channel: int) -> ChannelStream:
        stream = self._channels.get(channel)
        if stream is None:
            stream = self._channels[channel] = ChannelStream(self, channel)
            if self.done.is_set():
                stream._end()  # looked up after the connection ended: EOF at once
        return stream

    def _accepts(self, channel: int) -> bool:
        if self._inbound is not None:
            return channel in self._inbound
        if self._core.port_channels is not None:
            return True  # the core already keeps only this session's port channels
        return channel < FIRST_UNKNOWN_CHANNEL

    async def run(self) -> None:
        try:
            try:
                async with asyncio.timeout(None) as self._timeout:
                    self._touch()
                    await self._read_loop()
            except TimeoutError:
                # No data either way for that long (pings do not count): an unused session.
                log.info("%s: idle for %.0f s, closing", self.name, self._idle_timeout or 0)
                with contextlib.suppress(ProtocolError):
                    self._core.close(1001, "idle timeout")
                self._flush()
        except StreamError as exc:
            self.broken = BrokenStreamError(str(exc))
        finally:
            self._timeout = None  # finished: sends after the end must not reschedule it
            # Without the peer's close frame the connection was lost, not finished.
            lost = None
            if self.close_code in (None, CloseCode.ABNORMAL):
                lost = self.broken or BrokenStreamError(f"{self.name}: connection lost")
            for stream in self._channels.values():
                stream._end(lost)
            self.done.set()
            heap.release_soon()  # what this session buffered is free now: give it back

    async def _read_loop(self) -> None:
        while True:
            data = await self._wire.receive()
            try:
                events = self._core.receive_data(data if data else None)
            except ProtocolError as exc:
                log.warning("%s: protocol error from peer: %s", self.name, exc)
                self._flush()
                return
            for event in events:
                if isinstance(event, ChannelData):
                    self._touch()
                    if event.data and self._accepts(event.channel):
                        await self.stream(event.channel)._feed(event.data)
                elif isinstance(event, ChannelClosed):
                    self.stream(event.channel)._end()
                elif isinstance(event, CloseReceived):
                    self.close_code = event.code
            self._flush()
            if not data or self.close_code is not None:
                return

    def _release(self, size: int) -> float:
        """`size` queued bytes were read or dropped; the loop time now."""
        now = asyncio.get_running_loop().time()
        self._queued -= size
        self._last_read = now
        if self._queued <= MAX_QUEUED_BYTES_PER_SESSION:
            self._room.set()
        return now

    async def _wait_for_room(self) -> None:
        """Stop reading the WebSocket while the channels together hold more than the
        session's budget; with `stall_reset`, when no channel was read for
        STALLED_STREAM_RESET_SECONDS, reset the one holding the most and read on."""
        loop = asyncio.get_running_loop()
        while self._queued > MAX_QUEUED_BYTES_PER_SESSION and not self._wire_closed:
            if self._room.is_set():
                self._over_since = loop.time()
                self._room.clear()
            if not self.stall_reset:
                await self._room.wait()
                continue
            quiet = loop.time() - max(self._last_read, self._over_since)
            if quiet >= STALLED_STREAM_RESET_SECONDS:
                fullest = max(self._channels.values(), key=lambda c: c._queued)
                fullest._stall(quiet)
                self._over_since = loop.time()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), STALLED_STREAM_RESET_SECONDS - quiet)

    def _touch(self) -> None:
        """Data moved: push the idle deadline out (pings and pongs are not activity)."""
        timeout = self._timeout
        if timeout is not None and self._idle_timeout is not None and not timeout.expired():
            timeout.reschedule(asyncio.get_running_loop().time() + self._idle_timeout)

    def send_nowait(self, channel: int, data: Buffer) -> None:
        if self.broken is not None:
            raise fresh(self.broken)
        self._touch()
        try:
            self._core.send(channel, data)
        except ProtocolError as exc:  # the WebSocket is closing or closed
            raise ClosedStreamError(f"websocket closed: {exc}") from exc
        self._flush()

    def send_ready(self, channel: int) -> None:
        with contextlib.suppress(ProtocolError):
            self._core.send_ready(channel)
        self._flush()

    def close_channel_nowait(self, channel: int) -> None:
        if self._core.can_close_channels:
            with contextlib.suppress(ProtocolError):
                self._core.close_channel(channel)
            self._flush()

    async def drain(self) -> None:
        if self.broken is not None:
            raise fresh(self.broken)
        await self._wire.drain()

    def _flush(self) -> None:
        out = self._core.buffers_to_send()
        if out and self.broken is None:
            try:
                self._wire.writelines(out)
            except StreamError as exc:
                self.broken = BrokenStreamError(str(exc))

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (1000 is what kubectl needs to see EOF), then drop the socket."""
        if self.broken is None and self.close_code is None:
            # Bounded as a whole: a peer that stopped reading must not keep the socket.
            with contextlib.suppress(ProtocolError, StreamError, TimeoutError):
                async with asyncio.timeout(CLOSE_HANDSHAKE_SECONDS):
                    self._core.close(code, reason)
                    self._flush()
                    await self._wire.drain()
                    await self._wire.send_eof()
                    await self.done.wait()
        await self._wire.aclose()
        self._wire_closed = True
        # A read loop parked on a full channel (or a full session) must see the closed wire.
        for stream in self._channels.values():
            stream._writable.set()
        self._room.set()


class TunnelWire:
    """The SPDY byte stream carried in WebSocket binary messages, as a Wire for SpdySession."""

    def __init__(self, wire: SocketStream, core: TunnelConnection) -> None:
        self._wire = wire
        self._core = core
        self._closed = False

    def write(self, data: Buffer) -> None:
        self.writelines((data,))

    def writelines(self, data: Iterable[Buffer]) -> None:
        # One message per batch: message boundaries mean nothing inside the tunnel.
        try:
            self._core.send_buffers(data)
        except ProtocolError as exc:  # the WebSocket is closing or closed
            raise ClosedStreamError(f"websocket tunnel closed: {exc}") from exc
        self._wire.writelines(self._core.buffers_to_send())

    async def drain(self) -> None:
        await self._wire.drain()

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        while True:
            data = await self._wire.receive(max_bytes)
            try:
                events = self._core.receive_data(data if data else None)
            except ProtocolError as exc:
                raise BrokenStreamError(f"websocket tunnel: {exc}") from exc
            out = self._core.buffers_to_send()
            if out:
                with contextlib.suppress(StreamError):
                    self._wire.writelines(out)
            pieces = [e.data for e in events if type(e) is TunnelData]
            if pieces:
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if not data or any(isinstance(e, CloseReceived) for e in events):
                return b""

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ProtocolError, StreamError, TimeoutError):
            async with asyncio.timeout(CLOSE_HANDSHAKE_SECONDS):
                self._core.close(1000)
                self._wire.writelines(self._core.buffers_to_send())
                await self._wire.drain()
        await self._wire.aclose()
