"""asyncio driver for the SPDY/3.1 core: one read loop, one ByteStream per SPDY stream.

The read loop feeds bytes to the sans-IO core and hands each stream's data to that stream's
bounded buffer. Without flow control (every Kubernetes peer) a full buffer makes the read loop
wait, which stops reading the socket: a slow consumer is paid for with TCP backpressure, never
with memory, but it stalls every other stream on the connection too. Kubernetes' SPDY has no
flow control, so this head-of-line blocking is the only backpressure there is; spdystream does
the same.

With flow control (`flow_control_window`, only when the peer is podgate) each stream's sender
waits for window instead, and the receiver hands window back as the application reads. The
peer can never have more than one window of unread data on a stream, so the read loop never
waits for a stream and one stalled stream costs at most its window of memory.

With `kernel_splice` (port-forward over a plain socket), a stream whose payload goes to a pod
socket has the session read its socket itself and splice DATA payloads around Python
(podgate.aio.spdysplice); everything above stays as described, for the bytes that still come
this way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Mapping

from podgate.aio import heap
from podgate.aio.budget import connection_budget
from podgate.aio.errors import (
    BrokenStreamError,
    ClosedStreamError,
    ConflictGuard,
    StalledStreamError,
    StreamError,
    StreamResetError,
    fresh,
)
from podgate.aio.ksplice import PIPE_BYTES
from podgate.aio.spdysplice import KernelReads, PodSink, SharedSocket
from podgate.aio.streams import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    SocketStream,
    Wire,
    drain_unless_ended,
)
from podgate.proto.errors import ProtocolError
from podgate.proto.spdy import (
    MAX_CONCURRENT_STREAMS,
    GoAwayStatus,
    Role,
    RstStatus,
    SpdyConnection,
)
from podgate.proto.spdy.events import (
    ConnectionClosed,
    DataReceived,
    Event,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    SettingsReceived,
    StreamAborted,
    StreamOpened,
    StreamReplied,
    StreamReset,
    WindowUpdated,
    WindowUpdateReceived,
)

log = logging.getLogger(__name__)

# How long a client waits for SYN_REPLY, as client-go's createStreamResponseTimeout.
STREAM_REPLY_TIMEOUT_SECONDS = 30.0
# Received bytes one stream may hold unread before the whole connection stops reading
# (without flow control; with it, the window bounds a stream instead).
MAX_QUEUED_BYTES_PER_STREAM = 2 * 1024 * 1024
# Received bytes all the streams of one session may hold unread (without flow control): over it
# the read loop waits for any reader, so many streams just under their own budget still cost
# the sender's TCP window, not memory (8 streams at their full budget).
MAX_QUEUED_BYTES_PER_SESSION = 8 * MAX_QUEUED_BYTES_PER_STREAM
# Received bytes all sessions without flow control of the process (every kubectl facing the
# gateway) may hold unread together. Over it, a session holding more than PROCESS_SHARE_BYTES
# parks its read loop until the total drops; one holding less reads on, so sessions stalled on
# one never-reading pod cannot stop everyone else's (each keeps at most its share).
MAX_QUEUED_BYTES_PER_PROCESS = 16 * 1024 * 1024
PROCESS_SHARE_BYTES = 256 * 1024
# With flow control, window is handed back once the application has read this fraction
# (1/N) of it: few WINDOW_UPDATE frames, yet a reader that keeps up never lets the sender stall.
WINDOW_UPDATE_DIVISOR = 2
# Without flow control, how long a stream's full queue may go without one read before the
# stream is reset (RST_STREAM CANCEL) so the session reads on: a reader that is merely slow
# reads something well within it; one that is gone must not pin the session for ever. A live
# reader can be held up by its own peer's backpressure (an echo through kubectl, 64 such
# connections on 2 busy cores) for more than 5 s: 5 s reset 50 of 128 healthy connections.
STALLED_STREAM_RESET_SECONDS = 30.0
# client-go pings every 5 s on a direct SPDY connection (10 s inside the WebSocket tunnel).
CLIENT_PING_INTERVAL_SECONDS = 5.0
# Kubernetes' default streaming idle timeout (kubelet, containerd, CRI streaming server). Idle
# here means no data and no new stream: unlike spdystream, PINGs do not keep a session alive.
DEFAULT_IDLE_TIMEOUT_SECONDS = 4 * 3600.0
# How far activity must push the idle deadline before the timer is replaced: an idle session
# may end this much (at most 1/16 of its timeout) before its full idle time.
IDLE_DEADLINE_STEP_SECONDS = 1.0
# How long aclose waits for GOAWAY and the RST_STREAMs to be written before closing anyway.
CLOSE_DRAIN_SECONDS = 5.0
# SPDY DATA payload size podgate sends: large frames cost less per byte, and kubectl's
# framer accepts anything up to the 24-bit limit.
SEND_DATA_FRAME_BYTES = 256 * 1024
# Control frames that cost us work without carrying data (PING, SETTINGS, stray WINDOW_UPDATE,
# RST_STREAM) a peer may send: a burst, refilled at a steady rate. client-go pings every 5 s
# and resets each stream once; a peer far above this is flooding, and gets GOAWAY.
CONTROL_FRAME_BURST = 2000
# Slice of a read holding control frames parsed before the budget is charged (~1,400 PINGs):
# a 256 KiB read of nothing but PINGs would otherwise cost 21,845 parsed frames per flood.
PARSE_SLICE_BYTES = 16 * 1024
CONTROL_FRAMES_PER_SECOND = 500.0
# Streams one session may have open at once by default (a kubectl port-forward uses two per
# connection, so 256 concurrent connections): more are refused with RST_STREAM(REFUSED_STREAM),
# so one session cannot hold unbounded upstream pairs. A server that knows its client may
# allow more (the gateway's configured forwards per session).
MAX_STREAMS_PER_SESSION = 512
_CONTROL_EVENTS = (PingReceived, SettingsReceived, WindowUpdateReceived, StreamReset)


class _ProcessQueue:
    """The bytes queued unread in every session without flow control on one event loop, and
    the sessions whose read loop waits for that total to drop."""

    __slots__ = ("parked", "queued")

    def __init__(self) -> None:
        self.queued = 0
        self.parked: set[SpdySession] = set()

    def release(self, size: int) -> None:
        self.queued -= size
        if self.queued <= MAX_QUEUED_BYTES_PER_PROCESS:
            for session in list(self.parked):
                session._wake_if_room()


_process_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _ProcessQueue] = (
    weakref.WeakKeyDictionary()
)


def _process_queue(loop: asyncio.AbstractEventLoop) -> _ProcessQueue:
    queue = _process_queues.get(loop)
    if queue is None:
        queue = _process_queues[loop] = _ProcessQueue()
    return queue


def process_queued_bytes() -> int:
    """Bytes queued unread in all sessions without flow control on the running loop."""
    return _process_queue(asyncio.get_running_loop()).queued


class ControlBudget:
    """A token bucket of control frames (CONTROL_FRAME_BURST, refilled at
    CONTROL_FRAMES_PER_SECOND). Each session has its own unless it is given one: a gateway
    shares one among all sessions of a user, so a flooder who reconnects gets no fresh burst."""

    __slots__ = ("_stamp", "_tokens", "burst", "rate")

    def __init__(
        self, burst: float = CONTROL_FRAME_BURST, rate: float = CONTROL_FRAMES_PER_SECOND
    ) -> None:
        self.burst = float(burst)
        self.rate = rate
        self._tokens = self.burst
        self._stamp: float | None = None

    def charge(self, count: int, now: float) -> bool:
        """Take `count` frames at loop time `now`; False once the bucket is overdrawn."""
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= count
        return self._tokens >= 0


class SpdyStream(ByteStream):
    """One SPDY stream as a half-closeable ByteStream."""

    def __init__(self, session: SpdySession, stream_id: int, headers: Mapping[str, str]) -> None:
        self.session = session
        self.stream_id = stream_id
        self.headers = dict(headers)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._fin_received = False
        self._fin_sent = False
        self._reset: StreamResetError | None = None
        # The connection was lost before the peer finished: raised once the data is read.
        self._lost: BrokenStreamError | None = None
        self._closed = False
        self._ended = asyncio.Event()  # closed, reset or lost: wakes a sender on a stalled wire
        self._last_read = 0.0  # loop time of the application's last read
        self._full_since = 0.0  # loop time the queue last went over its budget
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._window_open = asyncio.Event()  # flow control: the peer granted more window
        self._consumed = 0  # flow control: bytes read by the application, window not yet returned
        self.bytes_received = 0
        self.bytes_sent = 0
        # The pod socket this stream's payload is spliced into (podgate.aio.spdysplice).
        self._sink: PodSink | None = None

    def __repr__(self) -> str:
        return f"<SpdyStream {self.stream_id} {self.headers}>"

    # -- server side
    def accept(self) -> None:
        """Send SYN_REPLY (empty headers): required before any DATA on a peer's stream."""
        self.session._core.reply(self.stream_id)
        self.session._flush()

    def reset(self, status: int = RstStatus.CANCEL) -> None:
        """Send RST_STREAM unless we already sent FIN (as spdystream); drop buffered data."""
        if self._closed:
            return
        if self._reset is None and not self._fin_sent:
            self.session._core.reset_stream(self.stream_id, status)
            self.session._flush()
        self._finish(StreamResetError("stream reset locally", status))

    # -- ByteStream
    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            return self._take(max_bytes) if self._chunks else await self._wait_chunk(max_bytes)

    async def _wait_chunk(self, max_bytes: int) -> bytes:
        while not self._chunks or self._closed:
            if self._closed:
                raise ClosedStreamError("stream is closed")
            if self._reset is not None:
                raise fresh(self._reset)
            if self._fin_received:
                return b""
            if self._lost is not None:
                raise fresh(self._lost)
            self._readable.clear()
            await self._readable.wait()
        return self._take(max_bytes)

    def _take(self, max_bytes: int) -> bytes:
        if self._closed:
            raise ClosedStreamError("stream is closed")
        self._last_read = self.session._loop.time()
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        elif self._chunks and len(chunk) + len(self._chunks[0]) <= (
            max_bytes := min(max_bytes, self.session._budget.share())
        ):
            # Go peers send 32 KiB frames: hand several on at once, so the next hop makes
            # one large write instead of one per frame.
            parts = [chunk]
            size = len(chunk)
            while self._chunks and size + len(self._chunks[0]) <= max_bytes:
                nxt = self._chunks.popleft()
                parts.append(nxt)
                size += len(nxt)
            chunk = b"".join(parts)
        self._queued -= len(chunk)
        self.session._release(len(chunk))
        if self.session._update_threshold:
            self._consumed += len(chunk)
            if self._consumed >= self.session._update_threshold:
                self._return_window()
        elif self._queued <= MAX_QUEUED_BYTES_PER_STREAM:
            self._writable.set()
        return chunk

    def _sink_ready(self, *, splicing: bool = False) -> PodSink | None:
        """The stream's pod socket, when payload may go into it at once: nothing of the
        stream is queued here or unsent there, so nothing can be overtaken. `splicing`: into
        the sink's pipe, behind what it still holds (a write must find it empty)."""
        sink = self._sink
        if (
            sink is None
            or self._chunks
            or self._closed
            or self._reset is not None
            or self._fin_received
            or not sink.ready(splicing=splicing)
        ):
            return None
        return sink

    def _consumed_outside(self, size: int) -> None:
        """`size` payload bytes reached the pod without the queue (spliced or written)."""
        self.bytes_received += size
        self._last_read = self.session._loop.time()
        if self.session._update_threshold:
            self._consumed += size
            if self._consumed >= self.session._update_threshold:
                self._return_window()

    def _return_window(self) -> None:
        session = self.session
        delta, self._consumed = self._consumed, 0
        if self._fin_received or self._reset is not None or session.broken is not None:
            return  # the peer sends no more here: nothing to return
        with contextlib.suppress(ProtocolError):  # the connection failed meanwhile
            session._core.window_update(self.stream_id, delta)
            session._flush()

    async def send(self, data: Buffer) -> None:
        with self._sending:
            await self._send(data)

    async def _send(self, data: Buffer) -> None:
        self._check_writable()
        if not data:
            return
        session = self.session
        if session.broken is not None:
            raise fresh(session.broken)
        if session._update_threshold:
            await self._send_windowed(memoryview(data).cast("B"))
            return
        try:
            session._core.send_data(self.stream_id, data)
        except ProtocolError as exc:
            raise ClosedStreamError(str(exc)) from exc
        self.bytes_sent += len(data)
        session._touch()
        session._flush()
        await self._drain()

    async def _drain(self) -> None:
        """The session's drain, ended early (with this stream's error) if the stream ends."""
        if not await drain_unless_ended(self.session._drain(), self._ended):
            self._check_writable()
            raise ClosedStreamError("stream ended while sending")

    def _check_writable(self) -> None:
        if self._closed:
            raise ClosedStreamError("write on closed stream")
        if self._reset is not None:
            raise fresh(self._reset)
        if self._fin_sent:
            raise ClosedStreamError("write after EOF")

    async def _send_windowed(self, view: memoryview) -> None:
        """Send as much as the stream's window allows, then wait for the peer to grant more."""
        session = self.session
        core = session._core
        while view:
            # Checked again on every turn: the stream or the connection may end while we wait.
            self._check_writable()
            if session.broken is not None:
                raise fresh(session.broken)
            try:
                window = core.send_window(self.stream_id)
            except ProtocolError as exc:
                raise ClosedStreamError(str(exc)) from exc
            if window == 0:
                self._window_open.clear()
                await self._window_open.wait()
                continue
            piece, view = view[:window], view[window:]
            try:
                core.send_data(self.stream_id, piece)
            except ProtocolError as exc:
                raise ClosedStreamError(str(exc)) from exc
            self.bytes_sent += len(piece)
            session._touch()
            session._flush()
            await self._drain()

    async def send_eof(self) -> None:
        if self._fin_sent or self._reset is not None or self._closed:
            return
        if self.session.broken is not None:
            return
        self._fin_sent = True
        self.session._core.end_stream(self.stream_id)
        self.session._flush()
        if self._fin_received:
            self.session._forget(self.stream_id)
        await self.session._drain()

    async def aclose(self) -> None:
        if self._closed:
            return
        if self.session.broken is None and not (self._fin_sent and self._fin_received):
            self.reset()
        self._finish(None)

    # -- fed by the session's read loop
    async def _feed(self, data: bytes, fin: bool) -> None:
        if self._closed or self._reset is not None:
            return
        if data:
            self._chunks.append(data)
            self._queued += len(data)
            self.session._charge(len(data))
            self.bytes_received += len(data)
            # Under flow control the core already bounds what the peer may send.
            if self._queued > MAX_QUEUED_BYTES_PER_STREAM and not self.session._update_threshold:
                if self._writable.is_set():
                    self._full_since = self.session._loop.time()
                self._writable.clear()
        if fin:
            self._fin_received = True
            if self._fin_sent:
                self.session._forget(self.stream_id)
        self._readable.set()
        if not self._writable.is_set():
            await self._wait_for_reader()
        elif not self.session._update_threshold:
            await self.session._wait_for_room()

    async def _wait_for_reader(self) -> None:
        """Park the read loop (TCP backpressure) until the application reads this stream, but
        not for a reader that makes no progress at all: after `stalled_reset_seconds`
        without a read the stream is reset and the session reads on. Otherwise a consumer that
        is gone for good would pin the session, and with it everything the connection holds,
        even after the peer left (a parked loop never sees the connection end)."""
        while not self._writable.is_set():
            quiet = self.session._loop.time() - max(self._last_read, self._full_since)
            limit = self.session.stalled_reset_seconds
            if quiet >= limit:
                log.warning(
                    "%s: stream %d unread for %.0f s with %d bytes queued: reset",
                    self.session.name,
                    self.stream_id,
                    quiet,
                    self._queued,
                )
                self._stall(quiet)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._writable.wait(), limit - quiet)

    def _stall(self, quiet: float) -> None:
        """RST_STREAM CANCEL for a reader that stalled; it then reads a StalledStreamError."""
        if self._closed:
            return
        if self._reset is None and not self._fin_sent:
            self.session._core.reset_stream(self.stream_id, RstStatus.CANCEL)
            self.session._flush()
        message = f"stream {self.stream_id}: unread for {quiet:.0f} s, reset"
        self._finish(StalledStreamError(message, RstStatus.CANCEL))

    def _finish(self, error: StreamResetError | None, *, keep_data: bool = False) -> None:
        """End the stream: closed by us (error None) or reset. Data the peer sent before its
        RST stays readable (the port-forward error text arrives just before a reset)."""
        if error is not None and self._reset is None:
            self._reset = error
        if error is None:
            self._closed = True
            self._drop_chunks()
        elif not keep_data:
            self._drop_chunks()
        self._ended.set()
        self._readable.set()
        self._writable.set()
        self._window_open.set()
        self.session._forget(self.stream_id)

    def _drop_chunks(self) -> None:
        self._chunks.clear()
        self.session._release(self._queued)
        self._queued = 0

    @property
    def fin_received(self) -> bool:
        return self._fin_received

    @property
    def fin_sent(self) -> bool:
        return self._fin_sent


class SpdySession:
    """Runs a SpdyConnection over a Wire (a socket, or the WebSocket tunnel)."""

    def __init__(
        self,
        wire: Wire,
        role: Role,
        *,
        on_stream: Callable[[SpdyStream], None] | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_SECONDS,
        ping_interval: float | None = None,
        data_frame_bytes: int = SEND_DATA_FRAME_BYTES,
        flow_control_window: int | None = None,
        stalled_reset_seconds: float = STALLED_STREAM_RESET_SECONDS,
        name: str = "spdy",
        max_streams: int = MAX_STREAMS_PER_SESSION,
        control_budget: ControlBudget | None = None,
        on_flood: Callable[[], None] | None = None,
        kernel_splice: bool = False,
    ) -> None:
        """`flow_control_window`: per-stream flow control with this window each way, for a
        peer known to do the same (see the module docstring); None for every Kubernetes peer.
        `stalled_reset_seconds`: see STALLED_STREAM_RESET_SECONDS.
        `max_streams`: streams open at once before the peer's next one is refused.
        `control_budget`: the peer's control frames are charged here (default: a bucket of
        this session's own). `on_flood`: called when the session is ended for a flood.
        `kernel_splice`: streams may splice their payload to a pod socket in the kernel
        (podgate.aio.spdysplice), when the wire is a plain socket."""
        if max_streams < 1:
            raise ValueError("max_streams must be positive")
        self.stalled_reset_seconds = stalled_reset_seconds
        self._wire = wire
        self._core = SpdyConnection(
            role,
            max_data_frame=data_frame_bytes,
            flow_control_window=flow_control_window,
            max_concurrent_streams=max(max_streams, MAX_CONCURRENT_STREAMS),
        )
        self._max_streams = max_streams
        # Consumed bytes that trigger a WINDOW_UPDATE; 0 when flow control is off.
        self._update_threshold = (
            max(1, flow_control_window // WINDOW_UPDATE_DIVISOR) if flow_control_window else 0
        )
        self.on_stream = on_stream
        self._idle_timeout = idle_timeout
        self._ping_interval = ping_interval
        self._streams: dict[int, SpdyStream] = {}
        self._reply_waiters: dict[int, asyncio.Future[None]] = {}
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._timeout: asyncio.Timeout | None = None
        self._loop = asyncio.get_running_loop()
        self.name = name
        self.broken: BrokenStreamError | None = None
        self.goaway_received = False
        self.done = asyncio.Event()
        self._queued = 0  # bytes received and not yet read, over all streams
        self._room = asyncio.Event()  # set while _queued is within the session's budget
        self._room.set()
        self._last_read = self._loop.time()  # the last read on any stream
        self._over_since = self._last_read  # when _queued last went over the budget
        self._control_budget = control_budget or ControlBudget()
        self._budget = connection_budget(self._loop)  # caps how far small frames are joined
        # Without flow control the queues count toward the process's budget (until teardown).
        self._process: _ProcessQueue | None = (
            None if self._update_threshold else _process_queue(self._loop)
        )
        self._on_flood = on_flood
        # Kernel splicing (podgate.aio.spdysplice): only over a plain socket.
        self._socket_wire = wire if kernel_splice and isinstance(wire, SocketStream) else None
        self._shared_socket: SharedSocket | None = None  # once a stream splices
        self._kernel: KernelReads | None = None  # the session reads its socket itself
        self._sinks = 0  # streams with a pod socket attached
        self._unyielded = 0  # bytes spliced since the read loop last let others run
        self.spliced_bytes_received = 0  # payload bytes that went around Python, each way
        self.spliced_bytes_sent = 0

    # -- lifecycle
    async def run(self) -> None:
        """Read until EOF, GOAWAY, a fatal protocol error or the idle timeout."""
        pinger: asyncio.Task[None] | None = None
        if self._ping_interval:
            pinger = asyncio.create_task(self._ping_loop(), name=f"{self.name} ping")
        reason: BaseException | None = None
        try:
            async with asyncio.timeout(None) as self._timeout:
                self._touch()
                while not self.goaway_received:
                    data = await self._read()
                    if data is None:  # payload went around Python, or a wait: look again
                        continue
                    # Only data and new streams count as activity (see _dispatch).
                    reason = await self._feed(data)
                    if reason is not None:
                        break
                    self._flush()
                    if not data:
                        break
                    # One busy session must not monopolise the loop: let others run between
                    # reads even when its socket always has more (after a read's worth: a
                    # session that splices reads little more than frame headers).
                    self._unyielded += len(data)
                    if self._unyielded >= DEFAULT_RECEIVE_BYTES:
                        self._unyielded = 0
                        await asyncio.sleep(0)
        except TimeoutError:
            log.info("%s: idle for %.0f s, closing", self.name, self._idle_timeout or 0)
            reason = TimeoutError("idle timeout")
            self._reset_all()
            with contextlib.suppress(ProtocolError, StreamError):
                self._core.goaway(GoAwayStatus.OK)
                self._flush()
        except StreamError as exc:
            reason = exc
        finally:
            self._timeout = None  # finished: writes after the end must not reschedule it
            if pinger is not None:
                pinger.cancel()
            if self._kernel is not None:
                self._kernel.close()
            self._teardown(reason)
            self.done.set()

    async def _read(self) -> bytes | None:
        """The next read to parse; None when there is none to parse yet (the payload of a
        DATA frame was spliced to its pod, or the socket had to be waited for)."""
        kernel = self._kernel
        if kernel is None:
            wire = self._socket_wire
            if self._shared_socket is None or wire is None or not wire.can_take_reading():
                return await self._wire.receive()
            # A stream splices: read the socket ourselves from now on, after what the
            # transport has read already.
            pending, eof = wire.stop_reading()
            kernel = self._kernel = KernelReads(self._shared_socket.acquire(), pending, eof)
        # While a stream splices, read a frame header or a control frame exactly: the next
        # DATA payload is then spliced whole, none of it through Python.
        size = self._core.bytes_wanted() if self._sinks else DEFAULT_RECEIVE_BYTES
        progress = self._core.data_in_progress()
        if progress is not None and not kernel.buffered:
            stream = self._streams.get(progress.stream_id) if progress.deliver else None
            sink = stream._sink_ready(splicing=True) if stream is not None else None
            if stream is not None and sink is not None:
                spliced = sink.spliced
                moved = await kernel.splice_payload(progress.remaining, sink)
                if moved is None:
                    return None
                if moved == 0:
                    return b""  # EOF inside a frame
                self.spliced_bytes_received += sink.spliced - spliced
                await self._payload_spliced(stream, moved)
                # One busy session must not monopolise the loop (as in run); a yield per
                # pipe's worth, not per frame (a Go peer's frames are 32 KiB).
                self._unyielded += moved
                if self._unyielded >= PIPE_BYTES:
                    self._unyielded = 0
                    await asyncio.sleep(0)
                return None
            size = min(progress.remaining, DEFAULT_RECEIVE_BYTES)
        return await kernel.recv(size)

    async def _payload_spliced(self, stream: SpdyStream, size: int) -> None:
        """`size` payload bytes of the current DATA frame went from our socket to the pod."""
        self._touch()
        events = self._core.skip_data(size)
        stream._consumed_outside(size)
        for event in events:
            await self._dispatch(event)
        self._flush()

    async def _feed(self, data: bytes) -> ProtocolError | None:
        """Parse and dispatch one read; the error that ends the session, if any.

        A read holding control frames is parsed PARSE_SLICE_BYTES at a time, each slice
        charged to the budget before the next is parsed: a flood is refused after one slice
        beyond the budget, not after parsing (and queueing echoes for) a whole read of
        PINGs. A read that starts without control frames is parsed in one go."""
        if not data:
            events = self._core.receive_eof()
            for event in events:
                await self._dispatch(event)
            return None
        pos, probing = 0, True
        while pos < len(data):
            end = pos + PARSE_SLICE_BYTES if probing else len(data)
            try:
                events = self._core.receive_data(data[pos:end])
            except ProtocolError as exc:
                log.warning("%s: protocol error from peer: %s", self.name, exc)
                self._flush()
                return exc
            pos = end
            controls = sum(1 for event in events if isinstance(event, _CONTROL_EVENTS))
            if not self._within_control_budget(controls):
                self._refuse_flood()
                return ProtocolError("control frame flood")
            probing = controls > 0
            for event in events:
                await self._dispatch(event)
        return None

    def _within_control_budget(self, count: int) -> bool:
        """Charge `count` control frames to the session's token bucket."""
        return not count or self._control_budget.charge(count, self._loop.time())

    def _refuse_flood(self) -> None:
        """GOAWAY(PROTOCOL_ERROR) without the echoes this read queued, then the session ends."""
        log.warning("%s: control frame flood from peer, closing with GOAWAY", self.name)
        if self._on_flood is not None:
            self._on_flood()
        self._core.buffers_to_send()  # drop the PING echoes of the flood
        self._reset_all()
        with contextlib.suppress(ProtocolError, StreamError):
            self._core.goaway(GoAwayStatus.PROTOCOL_ERROR)
            self._flush()

    async def aclose(self) -> None:
        """Reset what is still open, say GOAWAY, close the wire (client-go's Close)."""
        if self.broken is None:
            self._reset_all()
            with contextlib.suppress(ProtocolError, StreamError):
                self._core.goaway(GoAwayStatus.OK)
                self._flush()
            # A peer that stopped reading must not keep the wire open (or leak it).
            with contextlib.suppress(StreamError, TimeoutError):
                await asyncio.wait_for(self._drain(), CLOSE_DRAIN_SECONDS)
        self._teardown(None)
        await self._wire.aclose()

    # -- client side
    async def open_stream(
        self, headers: Mapping[str, str], *, timeout: float = STREAM_REPLY_TIMEOUT_SECONDS
    ) -> SpdyStream:
        """SYN_STREAM, then wait for SYN_REPLY; a RST instead raises StreamResetError."""
        if self.broken is not None:
            raise fresh(self.broken)
        stream_id = self._core.open_stream(headers)
        stream = SpdyStream(self, stream_id, headers)
        self._streams[stream_id] = stream
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._reply_waiters[stream_id] = waiter
        self._flush()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            stream.reset()
            raise BrokenStreamError("timeout waiting for SYN_REPLY") from None
        finally:
            self._reply_waiters.pop(stream_id, None)
        return stream

    async def ping(self, timeout: float = 10.0) -> float:
        """Round-trip time of one PING in seconds."""
        if self.broken is not None:
            raise fresh(self.broken)
        ping_id = self._core.ping()
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._ping_waiters[ping_id] = waiter
        start = self._loop.time()
        self._flush()
        if self.broken is not None:  # the write failed: no answer can come
            self._ping_waiters.pop(ping_id, None)
            raise fresh(self.broken)
        try:
            await asyncio.wait_for(waiter, timeout)
        finally:
            self._ping_waiters.pop(ping_id, None)
        return self._loop.time() - start

    # -- internals
    async def _dispatch(self, event: Event) -> None:
        if isinstance(event, DataReceived | StreamOpened):
            self._touch()  # the peer's pings (every 5 s from client-go) are not activity
        if isinstance(event, DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None:
                return
            sink = stream._sink_ready() if event.data else None
            if sink is not None:  # the pod takes it now: no queue, no copy task
                sink.write(event.data)
                stream._consumed_outside(len(event.data))
                if event.fin:
                    await stream._feed(b"", True)
            else:
                await stream._feed(event.data, event.fin)
        elif isinstance(event, StreamOpened):
            stream = SpdyStream(self, event.stream_id, event.headers)
            if len(self._streams) >= self._max_streams:
                log.warning("%s: refusing stream %d: too many open", self.name, event.stream_id)
                self._streams[event.stream_id] = stream
                stream.reset(RstStatus.REFUSED_STREAM)
                return
            self._streams[event.stream_id] = stream
            if event.unidirectional:
                stream._fin_sent = True
            if event.fin:
                stream._fin_received = True
            if self.on_stream is None:
                stream.reset()
            else:
                try:
                    self.on_stream(stream)
                except Exception:
                    log.exception("%s: stream handler failed", self.name)
                    stream.reset(RstStatus.INTERNAL_ERROR)
        elif isinstance(event, StreamReplied):
            waiter = self._reply_waiters.get(event.stream_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if event.fin and event.stream_id in self._streams:
                await self._streams[event.stream_id]._feed(b"", True)
        elif isinstance(event, StreamReset):
            waiter = self._reply_waiters.get(event.stream_id)
            if waiter is not None and not waiter.done():
                waiter.set_exception(StreamResetError("stream reset", event.status))
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._finish(
                    StreamResetError("stream reset by peer", event.status), keep_data=True
                )
        elif isinstance(event, WindowUpdated):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._window_open.set()
        elif isinstance(event, StreamAborted):
            log.warning(
                "%s: stream %d reset: the peer broke flow control (status %d)",
                self.name,
                event.stream_id,
                event.status,
            )
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._finish(StreamResetError("flow control error", event.status))
        elif isinstance(event, PingAcknowledged):
            ping_waiter = self._ping_waiters.get(event.ping_id)
            if ping_waiter is not None and not ping_waiter.done():
                ping_waiter.set_result(None)
        elif isinstance(event, GoAwayReceived):
            self.goaway_received = True
        elif isinstance(event, ConnectionClosed):
            pass

    def _flush(self) -> None:
        buffers = self._core.buffers_to_send()
        if buffers and self.broken is None:
            try:
                self._wire.writelines(buffers)
            except StreamError as exc:
                self.broken = BrokenStreamError(f"connection lost: {exc}")

    async def _drain(self) -> None:
        if self.broken is not None:
            raise fresh(self.broken)
        try:
            await self._wire.drain()
        except StreamError as exc:
            self.broken = BrokenStreamError(f"connection lost: {exc}")
            raise fresh(self.broken) from exc
        # Let the read loop run even when the socket takes everything at once: a writer in a
        # tight loop would otherwise never see the peer's RST_STREAM or GOAWAY.
        await asyncio.sleep(0)

    def _charge(self, size: int) -> None:
        """`size` bytes were queued."""
        self._queued += size
        if self._process is not None:
            self._process.queued += size

    def _release(self, size: int) -> None:
        """`size` queued bytes were read or dropped."""
        self._queued -= size
        self._last_read = self._loop.time()
        if self._process is not None:
            self._process.release(size)
        self._wake_if_room()

    def _over_budget(self) -> bool:
        if self._queued > MAX_QUEUED_BYTES_PER_SESSION:
            return True
        process = self._process
        return (
            process is not None
            and process.queued > MAX_QUEUED_BYTES_PER_PROCESS
            and self._queued > PROCESS_SHARE_BYTES
        )

    def _wake_if_room(self) -> None:
        if not self._over_budget():
            self._room.set()

    async def _wait_for_room(self) -> None:
        """Park the read loop while the session holds more than its budget (the sender then
        meets TCP backpressure). Readers that are merely slow free room; when none has read
        for STALLED_STREAM_RESET_SECONDS the stream holding the most is reset, as a stalled
        stream over its own budget is."""
        while self._over_budget():
            if self._room.is_set():
                self._over_since = self._loop.time()
                self._room.clear()
            quiet = self._loop.time() - max(self._last_read, self._over_since)
            if quiet >= STALLED_STREAM_RESET_SECONDS:
                fullest = max(self._streams.values(), key=lambda s: s._queued, default=None)
                if fullest is None or not fullest._queued:
                    return
                log.warning(
                    "%s: %d bytes unread for %.0f s on the session: stream %d (%d bytes) reset",
                    self.name,
                    self._queued,
                    quiet,
                    fullest.stream_id,
                    fullest._queued,
                )
                fullest._stall(quiet)
                self._over_since = self._loop.time()  # the next one only after another wait
                continue
            if self._process is not None:
                self._process.parked.add(self)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), STALLED_STREAM_RESET_SECONDS - quiet)
            finally:
                if self._process is not None:
                    self._process.parked.discard(self)

    # -- kernel splicing (podgate.aio.spdysplice)
    @property
    def can_splice(self) -> bool:
        """Whether a stream may splice its payload to a pod socket: a plain socket wire."""
        wire = self._socket_wire
        return (
            wire is not None
            and self.broken is None
            and (self._shared_socket is not None or wire.can_take_reading())
        )

    def _attach_sink(self, stream: SpdyStream, sink: PodSink) -> SharedSocket:
        """From now on `stream`'s payload may go to `sink` around Python. Returns the shared
        socket for the caller's spliced frames (released by the caller)."""
        if self._shared_socket is None:
            assert self._socket_wire is not None
            self._shared_socket = SharedSocket(self._socket_wire.duplicate_socket())
        stream._sink = sink
        self._sinks += 1
        return self._shared_socket.acquire()

    def _detach_sink(self, stream: SpdyStream, sink: PodSink) -> None:
        if stream._sink is sink:
            stream._sink = None
        self._sinks -= 1

    def _touch(self) -> None:
        """Data moved or a stream opened: push the idle deadline out. Only that counts as
        activity; PINGs do not, or a client that pings would hold an unused session for ever.

        Moved in steps (IDLE_DEADLINE_STEP_SECONDS, or 1/16 of a short timeout): rescheduling
        replaces a timer, and a busy session touches thousands of times a second."""
        timeout = self._timeout
        idle = self._idle_timeout
        if timeout is None or idle is None or timeout.expired():
            return
        deadline = self._loop.time() + idle
        when = timeout.when()
        if when is not None and deadline - when < min(IDLE_DEADLINE_STEP_SECONDS, idle / 16):
            return
        timeout.reschedule(deadline)

    def _forget(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None and (
            stream._closed
            or stream._reset is not None
            or (stream._fin_sent and stream._fin_received)
        ):
            del self._streams[stream_id]

    def _reset_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.reset()

    def _teardown(self, reason: BaseException | None) -> None:
        if self.broken is None:
            self.broken = BrokenStreamError(f"connection closed{f': {reason}' if reason else ''}")
        for waiter in [*self._reply_waiters.values(), *self._ping_waiters.values()]:
            if not waiter.done():
                waiter.set_exception(fresh(self.broken))
        for stream in list(self._streams.values()):
            # Data already received stays readable. Then, after the peer's GOAWAY, EOF (as
            # spdystream); after a connection lost without one, a stream the peer had not
            # finished raises the loss: a runtime that went away must not look like a clean end.
            if self.goaway_received:
                stream._fin_received = True
            elif not stream._fin_received and stream._reset is None:
                stream._lost = self.broken
            stream._ended.set()
            stream._readable.set()
            stream._writable.set()
            stream._window_open.set()
        self._streams.clear()
        if self._shared_socket is not None:
            # The session's own reference; readers and spliced writes hold their own.
            shared, self._shared_socket = self._shared_socket, None
            shared.release()
        if self._process is not None:
            # What the streams still hold no longer counts: it is read or dropped with them.
            process, self._process = self._process, None
            process.release(self._queued)
        heap.release_soon()  # what this session buffered is free now: give it back

    async def _ping_loop(self) -> None:
        assert self._ping_interval is not None
        while True:
            await asyncio.sleep(self._ping_interval)
            with contextlib.suppress(TimeoutError, StreamError):
                await self.ping(timeout=self._ping_interval)

    @property
    def queued_bytes(self) -> int:
        """Bytes received and not yet read, over all streams of the session."""
        return self._queued

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    @property
    def flow_control_window(self) -> int | None:
        """Each stream's window under flow control, or None (the Kubernetes behaviour)."""
        return self._core.flow_control_window
