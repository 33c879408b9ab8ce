"""SPDY DATA payloads spliced in the kernel between a session's socket and a pod's socket.

The usual path reads every DATA payload out of the client's socket into Python, queues it on
its SpdyStream, and a copy task writes it into the pod's socket (and the reverse). When the
session's wire is a plain socket (TCP or unix: no TLS, no WebSocket tunnel) and the pod side of
a forward is one too, `splice_forward` lets the payload go around Python:

- client → pod: the session reads its socket itself (its transport stops reading), frame
  headers and control frames exactly (SpdyConnection.bytes_wanted). Inside the payload of a
  DATA frame whose stream's pod socket is ready, the bytes go client socket → pipe → pod
  socket with os.splice, and the SPDY core is told how many went around it
  (SpdyConnection.skip_data): windows, FIN and stream state stay exact. Payload that did come
  through Python (read before a stream spliced) is written to the pod socket directly.
- pod → client: the pod socket is spliced into a pipe (n bytes); then, once the session's
  transport holds nothing unsent, the DATA header for n bytes and the pipe go into the client's
  socket within one callback. What the socket does not take at once is read out of the pipe and
  handed to the transport behind the header, so nothing interleaves inside a frame.

A pod socket is "ready" when nothing of its stream waits anywhere else: no chunk queued on the
SpdyStream, nothing unsent in the pod's transport, room in its pipe (what a busy pod socket did
not take stays there and is spliced when the socket is writable). When it is not (a slow pod),
bytes take the usual path with all its budgets, stall resets and flow control, and the fast
path resumes once that path has drained. A copy task still carries that path and the client's
EOF and errors into the pod, exactly as podgate.aio.splice does, so every end of a forward
behaves as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from podgate.aio.errors import (
    BrokenStreamError,
    ClosedStreamError,
    StalledStreamError,
    StreamError,
    fresh,
)
from podgate.aio.ksplice import PIPE_BYTES, pipe, wait_ready
from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS, SpliceResult, splice, wait_pumps
from podgate.aio.streams import (
    DEFAULT_RECEIVE_BYTES,
    ByteStream,
    SocketStream,
    drain_unless_ended,
)
from podgate.proto.errors import ProtocolError

if TYPE_CHECKING:
    from podgate.aio.spdy import SpdySession, SpdyStream

__all__ = [
    "KernelReads",
    "KernelSpliceable",
    "PodSink",
    "PodSocket",
    "ReadWaiter",
    "SharedSocket",
    "send_spliced_frame",
    "splice_forward",
]

_FLAGS: Final = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


def _read_out(r: int, size: int) -> bytes:
    """Exactly `size` bytes that are in the pipe `r` (they are there: nothing can block)."""
    parts = []
    while size:
        part = os.read(r, size)
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


class ReadWaiter:
    """Waits for a descriptor to become readable. The loop's registration is kept between
    waits that follow each other (adding and removing it for every wait costs a handle and two
    epoll_ctl calls, once per spliced frame), and dropped as soon as it fires while nobody
    waits, so unread bytes never make the loop spin."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._registered = False

    async def wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        if not self._registered:
            self._loop.add_reader(self._fd, self._fire)
            self._registered = True
        try:
            await waiter
        finally:
            self._waiter = None

    def _fire(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.close()  # nobody waits: stop polling until the next wait
        else:
            waiter.set_result(None)

    def close(self) -> None:
        """Drop the registration (before the descriptor is closed)."""
        if self._registered:
            self._loop.remove_reader(self._fd)
            self._registered = False


class SharedSocket:
    """A duplicate of the session's socket, for the session's own reads and spliced writes.

    uvloop refuses add_reader/add_writer on the descriptor its transport owns; a duplicate
    works. It is closed once the session is done with it and no spliced write still uses it
    (closing a descriptor a wait is registered on would leave the loop polling a number that
    may be reused). Writers waiting for the socket to drain share one add_writer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self._users = 1  # the session
        self._loop = asyncio.get_running_loop()
        self._writable: list[asyncio.Future[None]] = []

    def acquire(self) -> SharedSocket:
        self._users += 1
        return self

    def release(self) -> None:
        self._users -= 1
        if not self._users:
            for waiter in self._writable:  # none is left after every user released
                waiter.cancel()
            self.sock.close()

    async def wait_writable(self) -> None:
        waiter = self._loop.create_future()
        if not self._writable:
            self._loop.add_writer(self.fd, self._wake_writers)
        self._writable.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._writable:
                self._writable.remove(waiter)
                if not self._writable:
                    self._loop.remove_writer(self.fd)

    def _wake_writers(self) -> None:
        self._loop.remove_writer(self.fd)
        waiters, self._writable = self._writable, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class PodSink:
    """The pod side of a spliced forward, as the session's read loop writes into it: a pipe
    of its own and a duplicate of the pod socket to splice into, and the pod's SocketStream
    for what must queue.

    Payload is spliced into the pipe, then from the pipe into the pod as far as its socket
    takes it. What a busy socket did not take stays in the pipe and a drain task splices it
    when the socket is writable: the bytes stay out of Python, and the read loop moves on
    (it never waits for one pod). Until the pipe is empty the sink is not ready, so later
    payload queues the usual way, and the copy task waits for `drained` before it writes."""

    def __init__(self, target: PodSocket, sock: socket.socket) -> None:
        self.target = target
        self.pod = target.stream
        self.sock = sock
        self.fd = sock.fileno()
        self.moved = 0  # payload bytes written into the pod by the read loop
        self.spliced = 0  # ... of which went through the pipe (never in Python)
        self.error: BrokenStreamError | None = None
        self.failed = asyncio.Event()
        self.drained = asyncio.Event()  # the pipe is empty
        self.drained.set()
        self._progress = asyncio.Event()  # the pipe gave some bytes to the pod
        self._pipe = pipe()
        self._in_pipe = 0
        self._drainer: asyncio.Task[None] | None = None
        # The copy task took a queued chunk and has not written it yet: later payload must
        # not overtake it.
        self.holding = False
        # The pipe took no more though the session's socket had bytes (its capacity counts
        # pages, not bytes): not ready to splice until it drained some.
        self.full = False

    @property
    def pipe_in(self) -> int:
        """The pipe's write end, for a splice from the session's socket (only when ready)."""
        return self._pipe[1]

    @property
    def room(self) -> int:
        """Bytes the pipe may still take (at most: see `full`)."""
        return PIPE_BYTES - self._in_pipe

    def ready(self, *, splicing: bool = False) -> bool:
        """Whether payload may go on now, behind everything sent before: a write straight
        to the socket (the pipe must be empty), or with `splicing` into the pipe (it must have
        room: FIFO, so behind what it holds)."""
        pod = self.pod
        return (
            self.error is None
            and (self._in_pipe < PIPE_BYTES and not self.full if splicing else not self._in_pipe)
            and not self.holding
            and not pod.eof_sent
            and not pod.write_buffer_size
            and not pod.transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        """A payload piece that came through Python (with a frame header)."""
        try:
            self.pod.write(data)
        except StreamError as exc:
            self._fail(str(exc))
            return
        self.moved += len(data)

    def pushed(self, size: int) -> None:
        """`size` bytes were spliced into the pipe: on into the pod, now or when it can."""
        self._in_pipe += size
        self.moved += size
        self.spliced += size
        self._flush()
        if self._in_pipe and self.error is None and self.drained.is_set():
            self.drained.clear()
            self._drainer = asyncio.create_task(self._drain(), name="spdysplice pod drain")

    async def put(self, data: bytes) -> memoryview:
        """For the copy task: queue `data` into the pipe behind what it holds (the pipe is the
        one ordered way into the pod while it holds bytes, and taking the chunk now lets the
        stream's window go back at the pace a slow pod reads); returns the part left once the
        pipe is empty, which goes through the transport."""
        view = memoryview(data)
        while view and self._in_pipe and self.error is None:
            try:
                n = os.write(self._pipe[1], view)
            except BlockingIOError:
                self._progress.clear()
                await self._progress.wait()
                continue
            self._in_pipe += n  # a drain task runs while the pipe holds bytes
            view = view[n:]
        return view

    def _flush(self) -> None:
        try:
            while self._in_pipe:
                self._in_pipe -= os.splice(self._pipe[0], self.fd, self._in_pipe, flags=_FLAGS)
                self.full = False
                self._progress.set()
        except BlockingIOError:
            pass
        except OSError as exc:  # the pod reset or closed its end
            self._fail(str(exc))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._in_pipe and self.error is None:
                await wait_ready(loop.add_writer, loop.remove_writer, self.fd)
                self._flush()
        finally:
            self.drained.set()
            self._progress.set()

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = BrokenStreamError(f"pod connection lost: {reason}")
            self.failed.set()
            self.drained.set()  # nothing will drain: no writer may wait for it
            self._progress.set()

    async def aclose(self) -> None:
        """Stop draining and close the pipe (what is left in it is lost with the forward)."""
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        for fd in self._pipe:
            os.close(fd)


class KernelReads:
    """The session's own reads of its socket, once a stream splices: recv for frame headers,
    control frames and payload that stays in Python; splice for payload that goes to a pod."""

    def __init__(self, shared: SharedSocket, pending: bytes, eof: bool) -> None:
        self._shared = shared
        self._pending = pending  # what the transport had read before the hand-over
        self._eof = eof
        self._readable = ReadWaiter(shared.fd)

    @property
    def buffered(self) -> bool:
        """Bytes read before the hand-over wait to be parsed: nothing may be spliced first."""
        return bool(self._pending) or self._eof

    async def recv(self, size: int) -> bytes | None:
        """Up to `size` bytes, b"" at EOF; None after waiting for the socket (the caller
        looks again at where the input stands)."""
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        if self._eof:
            return b""
        try:
            return self._shared.sock.recv(size)
        except BlockingIOError:
            await self._wait_readable()
            return None
        except OSError as exc:
            raise BrokenStreamError(f"connection lost: {exc}") from exc

    async def splice_payload(self, size: int, sink: PodSink) -> int | None:
        """Splice up to `size` payload bytes from the session's socket into a ready sink: the
        bytes moved (0 at EOF), or None after waiting for the socket."""
        try:
            n = os.splice(self._shared.fd, sink.pipe_in, min(size, sink.room), flags=_FLAGS)
        except BlockingIOError:
            if sink.room < PIPE_BYTES and self._has_bytes():
                sink.full = True  # the pipe, not the socket, said no: take the usual way
            else:
                await self._wait_readable()
            return None
        except OSError as exc:
            raise BrokenStreamError(f"connection lost: {exc}") from exc
        if n:
            sink.pushed(n)
        return n

    async def _wait_readable(self) -> None:
        await self._readable.wait()

    def _has_bytes(self) -> bool:
        """Whether the session's socket has bytes (or EOF) to read now."""
        try:
            self._shared.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the read that follows reports it
        return True

    def close(self) -> None:
        self._readable.close()
        self._shared.release()


async def send_spliced_frame(
    session: SpdySession, shared: SharedSocket, stream: SpdyStream, r: int, size: int
) -> None:
    """Send the `size` bytes in pipe `r` as one DATA frame of `stream`.

    Waits until the session's transport holds nothing unsent (after flushing what the core
    queued), then, without yielding: the core accounts the frame, its header goes to the
    socket, the pipe is spliced after it; whatever the socket did not take is handed to the
    transport in order. Other writers only ever write through the transport, which is empty at
    that moment, so nothing can land inside the frame."""
    wire = session._socket_wire
    assert wire is not None
    while True:
        stream._check_writable()
        if session.broken is not None:
            raise fresh(session.broken)
        session._flush()
        if session.broken is not None:
            raise fresh(session.broken)
        if not wire.write_buffer_size:
            break
        if not await drain_unless_ended(shared.wait_writable(), stream._ended):
            stream._check_writable()
            raise ClosedStreamError("stream ended while sending")
        # The transport flushes from its own callback, maybe after ours in this turn.
        await asyncio.sleep(0)
    try:
        header = session._core.data_header(stream.stream_id, size)
    except ProtocolError as exc:
        raise ClosedStreamError(str(exc)) from exc
    sent = 0
    left = size
    try:
        sent = shared.sock.send(header)
        if sent == len(header):
            while left:
                left -= os.splice(r, shared.fd, left, flags=_FLAGS)
    except BlockingIOError:
        pass
    except OSError as exc:
        # The connection broke inside a frame: nothing more can be written on it.
        session.broken = BrokenStreamError(f"connection lost: {exc}")
        raise fresh(session.broken) from exc
    rest = header[sent:] + _read_out(r, left) if sent < len(header) or left else b""
    if rest:
        try:
            wire.write(rest)
        except StreamError as exc:
            session.broken = BrokenStreamError(f"connection lost: {exc}")
            raise fresh(session.broken) from exc
    stream.bytes_sent += size
    session.spliced_bytes_sent += size - left
    session._touch()
    if wire.writing_paused:
        await stream._drain()
    else:
        # Nothing to wait for; yield anyway, so that a pod that always has more cannot keep
        # the read loop (the peer's RST_STREAM, GOAWAY) from running.
        await asyncio.sleep(0)


@dataclass(frozen=True, slots=True)
class PodSocket:
    """What a pod-side ByteStream that wraps a plain socket lets a splice use: the socket's
    SocketStream, bytes to deliver before the socket's own, what the socket's EOF means (a
    check that raises the wrapper's error, if any), and the wrapper's error for a broken
    socket. A plain SocketStream is its own PodSocket."""

    stream: SocketStream
    pending: bytes = b""
    check_eof: Callable[[], Awaitable[None]] | None = None
    map_error: Callable[[BrokenStreamError], StreamError] | None = None

    def error(self, exc: BrokenStreamError) -> StreamError:
        return exc if self.map_error is None else self.map_error(exc)


class KernelSpliceable(ABC):
    """A pod-side ByteStream over a plain socket that allows splice_forward to use it."""

    @abstractmethod
    def pod_socket(self) -> PodSocket:
        """The socket and the wrapper's semantics (no side effect: asking twice gives the
        same); once a splice took it, the wrapper is not read any more."""


def _pod_socket(pod: ByteStream) -> PodSocket | None:
    if isinstance(pod, KernelSpliceable):
        return pod.pod_socket()
    if isinstance(pod, SocketStream):
        return PodSocket(pod)
    return None


def _spliceable(stream: SpdyStream, pod: ByteStream) -> PodSocket | None:
    """The pod's socket when `splice_forward` takes the kernel path for this pair."""
    target = _pod_socket(pod)
    if (
        target is not None
        and target.stream.can_take_reading()
        and not target.stream.eof_sent
        and stream.session.can_splice
    ):
        return target
    return None


def can_splice(stream: SpdyStream, pod: ByteStream) -> bool:
    """Whether `splice_forward` would take the kernel path for this pair."""
    return _spliceable(stream, pod) is not None


async def splice_forward(
    a: ByteStream,
    stream: SpdyStream,
    pod: ByteStream,
    *,
    grace: float | None = HALF_CLOSE_GRACE_SECONDS,
) -> SpliceResult:
    """podgate.aio.splice.splice(a, pod), with the payload spliced in the kernel where both
    ends allow it. `a` is the SPDY stream `stream` (or a wrapper of it that only adds to its
    EOF); the results, EOF and error semantics are splice's."""
    target = _spliceable(stream, pod)
    if target is None:
        return await splice(a, pod, grace=grace)
    session = stream.session
    sock, pending, eof = target.stream.take_reading()
    pending = target.pending + pending
    sink = PodSink(target, sock)
    shared = session._attach_sink(stream, sink)
    result = SpliceResult()

    def count_in(n: int) -> None:
        result.a_to_b += n

    def count_out(n: int) -> None:
        result.b_to_a += n

    tasks: set[asyncio.Task[None]] = {
        asyncio.create_task(_copy_in(a, pod, sink, count_in), name="spdysplice client->pod"),
        asyncio.create_task(
            _splice_out(a, stream, shared, sink, pending, eof, count_out),
            name="spdysplice pod->client",
        ),
    }
    watcher = asyncio.create_task(_watch(stream, sink), name="spdysplice pod watch")
    try:
        await wait_pumps(tasks, result, grace, watch=watcher)
    finally:
        left = [task for task in (*tasks, watcher) if not task.done()]  # as splice's
        for task in left:
            task.cancel()
        for task in left:
            with contextlib.suppress(asyncio.CancelledError, StreamError):
                await task
        session._detach_sink(stream, sink)
        shared.release()
        await sink.aclose()
        sock.close()
        result.a_to_b += sink.moved
        await asyncio.gather(a.aclose(), pod.aclose(), return_exceptions=True)
    return result


async def _watch(stream: SpdyStream, sink: PodSink) -> None:
    """Ends the forward when a spliced write found the pod gone, or when the stream was reset
    as stalled: the copy task may be the one waiting (on a pod that does not read), and would
    never read the stream to learn of it. Never returns otherwise."""
    failed = asyncio.ensure_future(sink.failed.wait())
    ended = asyncio.ensure_future(stream._ended.wait())
    try:
        await asyncio.wait({failed, ended}, return_when=asyncio.FIRST_COMPLETED)
        if not failed.done() and isinstance(stream._reset, StalledStreamError):
            raise fresh(stream._reset)
        await failed
    finally:
        failed.cancel()
        ended.cancel()
    assert sink.error is not None
    raise sink.target.error(fresh(sink.error))


async def _copy_in(
    a: ByteStream, pod: ByteStream, sink: PodSink, count: Callable[[int], None]
) -> None:
    """Client → pod for what went the usual way (queued on the stream), then EOF; each
    behind what the sink's pipe still holds (into the pipe while it holds bytes)."""
    while True:
        chunk = await a.receive(DEFAULT_RECEIVE_BYTES)
        sink.holding = True
        try:
            rest = await sink.put(chunk) if chunk else None
            if rest is None:  # EOF: after everything the pipe holds
                await sink.drained.wait()
            if sink.error is not None:
                raise sink.target.error(fresh(sink.error))
            if rest is None:
                await pod.send_eof()
                return
            if rest:
                await pod.send(rest)
        finally:
            sink.holding = False
        count(len(chunk))


async def _splice_out(
    a: ByteStream,
    stream: SpdyStream,
    shared: SharedSocket,
    sink: PodSink,
    pending: bytes,
    eof: bool,
    count: Callable[[int], None],
) -> None:
    """Pod → client: splice the pod socket into a pipe, send the pipe as one DATA frame."""
    if pending:  # read by the pod's transport before the hand-over
        await a.send(pending)
        count(len(pending))
    if eof:
        if sink.target.check_eof is not None:
            await sink.target.check_eof()
        await a.send_eof()
        return
    session = stream.session
    readable = ReadWaiter(sink.fd)
    r, w = pipe()
    try:
        while True:
            size = await _send_allowance(stream)
            try:
                n = os.splice(sink.fd, w, size, flags=_FLAGS)
            except BlockingIOError:
                await readable.wait()
                continue
            except OSError as exc:  # the pod reset its end
                raise sink.target.error(BrokenStreamError(str(exc))) from exc
            if n == 0:
                if sink.target.check_eof is not None:
                    await sink.target.check_eof()
                await a.send_eof()
                return
            n += _splice_more(sink.fd, w, size - n)
            await send_spliced_frame(session, shared, stream, r, n)
            count(n)
    finally:
        readable.close()
        os.close(r)
        os.close(w)


def _splice_more(fd: int, w: int, room: int) -> int:
    """What else the pod socket has now, up to `room`, into the same pipe: from a unix socket
    (the agent's dial-back) one splice returns one queued buffer's worth, and every frame
    costs the client a read and a parse."""
    more = 0
    while more < room:
        try:
            n = os.splice(fd, w, room - more, flags=_FLAGS)
        except (BlockingIOError, OSError):
            break  # nothing now, or an error the next splice will see and report
        if n == 0:
            break  # EOF: the next splice sees it too
        more += n
    return more


async def _send_allowance(stream: SpdyStream) -> int:
    """Bytes the next frame may carry: a pipe's worth, within the stream's send window."""
    session = stream.session
    while True:
        stream._check_writable()
        if session.broken is not None:
            raise fresh(session.broken)
        if not session._update_threshold:
            return PIPE_BYTES
        try:
            window = session._core.send_window(stream.stream_id)
        except ProtocolError as exc:
            raise ClosedStreamError(str(exc)) from exc
        if window:
            return min(window, PIPE_BYTES)
        stream._window_open.clear()
        await stream._window_open.wait()
