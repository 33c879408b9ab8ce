"""Half-closeable byte streams: the one interface between podgate's layers.

Everything that carries the bytes of one connection or one exec stdio — a TCP socket, a SPDY
stream, a WebSocket channel, a pipe — is a `ByteStream`. `receive()` returns b"" once the peer
has finished sending; `send_eof()` finishes our direction while still reading.

`SocketStream` is the transport-backed implementation. It is built on `asyncio.Protocol` (not
StreamReader/StreamWriter) with pause/resume flow control both ways, and it doubles as the
`Wire` that protocol drivers write framed output to.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import ssl
import stat
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, cast

from podgate.aio import tls
from podgate.aio.budget import ConnectionBudget, connection_budget
from podgate.aio.errors import (
    BrokenStreamError,
    ClosedStreamError,
    ConflictGuard,
    map_os_errors,
)
from podgate.aio.tasks import TaskSet

log = logging.getLogger(__name__)

# Largest chunk handed out by one receive(): bigger reads cost fewer wake-ups per byte.
DEFAULT_RECEIVE_BYTES = 256 * 1024
# What a connection may hold unread before its transport stops reading (TCP backpressure), and
# reads at once, is its share of the process's budget (podgate.aio.budget), not a fixed mark.
# Bytes the kernel send path may queue in the transport before writers wait. (A share of the
# budget here too cost 12 % of the soak's throughput at 64 forwards and did not lower its peak.)
SEND_HIGH_WATER = 1024 * 1024
SEND_LOW_WATER = 256 * 1024
# How long aclose() lets the transport flush what completed sends left queued before it
# aborts: a peer that stopped reading must not keep the socket (and its buffer) forever.
CLOSE_FLUSH_SECONDS = 2.0

Buffer = bytes | bytearray | memoryview
_Handler = Callable[["SocketStream"], Awaitable[None]]


class ByteStream(ABC):
    """A half-closeable, bidirectional byte stream."""

    @abstractmethod
    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Next chunk of at most `max_bytes`; b"" once the peer sent EOF."""

    @abstractmethod
    async def send(self, data: Buffer) -> None:
        """Send all of `data`, waiting while the peer is slow."""

    @abstractmethod
    async def send_eof(self) -> None:
        """Finish our direction; receiving goes on."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close both directions and release resources. Idempotent."""

    async def __aenter__(self) -> ByteStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def drain_unless_ended(drain: Awaitable[None], ended: asyncio.Event) -> bool:
    """Wait for a shared wire's drain, or until `ended` is set; True if the drain completed.

    One stream of a multiplexed session must not keep its sender waiting on the session's
    stalled wire once that stream was closed or reset."""
    waiter = asyncio.ensure_future(drain)
    if not waiter.done():
        ender = asyncio.ensure_future(ended.wait())
        try:
            await asyncio.wait({waiter, ender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ender.cancel()
            if not waiter.done():
                waiter.cancel()
                # Reap it: a drain cancelled here must not log "exception never retrieved".
                await asyncio.gather(waiter, return_exceptions=True)
        if waiter.cancelled():
            return False
    waiter.result()
    return True


class Wire(Protocol):
    """What a protocol driver needs below it: ordered synchronous writes, a drain, reads."""

    def write(self, data: Buffer) -> None: ...

    def writelines(self, data: Iterable[Buffer]) -> None: ...

    async def drain(self) -> None: ...

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes: ...

    async def aclose(self) -> None: ...


class _Scratch:
    """One read buffer per event loop: a read fills it and is copied out at once, so every
    connection of the loop can use the same one (as the loop's own transports do)."""

    __slots__ = ("view",)

    def __init__(self) -> None:
        self.view = memoryview(bytearray(DEFAULT_RECEIVE_BYTES))


_scratches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Scratch] = (
    weakref.WeakKeyDictionary()
)


def _scratch(loop: asyncio.AbstractEventLoop) -> memoryview:
    scratch = _scratches.get(loop)
    if scratch is None:
        scratch = _scratches[loop] = _Scratch()
    return scratch.view


class _StreamProtocol(asyncio.BufferedProtocol):
    """asyncio Protocol feeding a SocketStream, with flow control in both directions.

    Buffered: each read is sized to the connection's share of the process budget, so a
    connection over its share holds at most one read more (a plain Protocol gets whatever the
    transport read, up to 256 KiB). Over TLS (podgate.aio.tls) the decrypted records fill the
    same buffers."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._budget: ConnectionBudget = connection_budget(loop)
        self._scratch = _scratch(loop)
        self._busy = False  # counted in the budget's busy connections
        self._finished = False  # the connection is lost or closed: never busy again
        self.transport: asyncio.Transport | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._reading_paused = False
        self._data_waiter: asyncio.Future[None] | None = None
        # Several writers (the streams of one SPDY session) may wait on one transport at once.
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._writing_paused = False
        # SocketStream.set_consumer's consumer: bytes go to it before the queue.
        self.consumer: Callable[[bytes], bool] | None = None
        # Closed by our side: waiting readers and writers end with ClosedStreamError.
        self.local_closed = False
        self.closed = loop.create_future()

    # -- the process budget
    def _update_busy(self) -> None:
        """Count this connection among the busy ones while it holds received bytes."""
        busy = not self._finished and self._buffered > 0
        if busy != self._busy:
            self._busy = busy
            self._budget.busy += 1 if busy else -1

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(SEND_HIGH_WATER, SEND_LOW_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        size = min(len(self._scratch), self._budget.share())
        return self._scratch[:size]

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._scratch[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self.consumer is not None and not self._chunks and self.consumer(data):
            return
        self._chunks.append(data)
        self._buffered += len(data)
        self._update_busy()
        if self._buffered >= self._budget.share() and not self._reading_paused:
            assert self.transport is not None
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake_reader()
        # Keep our sending half open. TLS has no half-close: there False closes the connection.
        return self.transport is None or self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self._error is None:
            self._error = exc
        self._finished = True
        self._update_busy()
        self._eof = True
        self._wake_reader()
        self._wake_writers()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_writers()

    # -- helpers for SocketStream
    def _wake_writers(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def close_locally(self) -> None:
        self.local_closed = True
        self._finished = True
        self._update_busy()
        self._wake_reader()
        self._wake_writers()

    def _wake_reader(self) -> None:
        if self._data_waiter is not None and not self._data_waiter.done():
            self._data_waiter.set_result(None)

    async def read(self, max_bytes: int) -> bytes:
        # Coalesced up to our share only: a joined chunk is one more copy in flight.
        max_bytes = min(max_bytes, self._budget.share())
        while not self._chunks or self.local_closed:
            if self.local_closed:
                raise ClosedStreamError("stream is closed")
            if self._eof:
                if self._error is not None:
                    raise BrokenStreamError(str(self._error)) from self._error
                return b""
            self._data_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._data_waiter
            finally:
                self._data_waiter = None
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        elif len(self._chunks) and len(chunk) < max_bytes:
            # Coalesce small chunks so framed protocols see fewer, larger reads.
            parts = [chunk]
            size = len(chunk)
            while self._chunks and size + len(self._chunks[0]) <= max_bytes:
                nxt = self._chunks.popleft()
                parts.append(nxt)
                size += len(nxt)
            chunk = b"".join(parts)
        self._buffered -= len(chunk)
        self._update_busy()
        if self._reading_paused and self._buffered <= self._budget.share() // 4:
            assert self.transport is not None
            self._reading_paused = False
            self.transport.resume_reading()
        return chunk

    def unread(self, data: bytes) -> None:
        """Put bytes back in front (what followed an HTTP request head)."""
        if data:
            self._chunks.appendleft(data)
            self._buffered += len(data)
            self._update_busy()
            self._wake_reader()

    async def drain(self) -> None:
        if self.transport is None or self.transport.is_closing():
            if self._error is not None:
                raise BrokenStreamError(str(self._error))
            if self.transport is not None and self.closed.done():
                raise ClosedStreamError("connection closed")
            return
        if not self._writing_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)
        if self.local_closed:
            raise ClosedStreamError("stream closed while sending")
        if self._error is not None:
            raise BrokenStreamError(str(self._error))


class SocketStream(ByteStream):
    """A ByteStream (and Wire) over an asyncio transport: TCP, TLS or a unix socket."""

    def __init__(self, protocol: _StreamProtocol) -> None:
        assert protocol.transport is not None
        self._protocol = protocol
        self.transport: asyncio.Transport = protocol.transport
        self._eof_sent = False
        self._closed = False
        self._handed_over = False  # to a kernel splice: a duplicate fd shares the socket
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")
        # A send() was interrupted (cancelled or failed) with its bytes still queued: the
        # byte stream is torn, so aclose() aborts instead of flushing.
        self._send_torn = False

    # -- constructors
    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> SocketStream:
        loop = asyncio.get_running_loop()
        proto = _StreamProtocol()
        with map_os_errors():
            if ssl_context is None:
                await loop.create_connection(lambda: proto, host, port)
            else:
                hostname = host if server_hostname is None else server_hostname
                secure = tls.client_side(proto, ssl_context, hostname)
                await loop.create_connection(lambda: secure, host, port)
                await secure.wait_handshake()
        stream = cls(proto)
        stream.set_nodelay()
        return stream

    @classmethod
    async def connect_unix(
        cls,
        path: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> SocketStream:
        """Connect to a unix socket (a runtime's streaming server may listen on one)."""
        loop = asyncio.get_running_loop()
        proto = _StreamProtocol()
        with map_os_errors():
            if ssl_context is None:
                await loop.create_unix_connection(lambda: proto, path)
            else:
                secure = tls.client_side(proto, ssl_context, server_hostname)
                await loop.create_unix_connection(lambda: secure, path)
                await secure.wait_handshake()
        return cls(proto)

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> SocketStream:
        """Adopt an already connected socket (e.g. one made inside a pod's netns)."""
        loop = asyncio.get_running_loop()
        with map_os_errors():
            _, proto = await loop.connect_accepted_socket(_StreamProtocol, sock)
        stream = cls(proto)
        stream.set_nodelay()
        return stream

    @staticmethod
    def protocol_factory() -> _StreamProtocol:
        return _StreamProtocol()

    # -- ByteStream
    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        if self._closed:
            raise ClosedStreamError("stream is closed")
        with self._receiving:
            return await self._protocol.read(max_bytes)

    async def send(self, data: Buffer) -> None:
        with self._sending:
            self._send_torn = True
            self.write(data)
            await self.drain()
            self._send_torn = False

    async def send_eof(self) -> None:
        if self._eof_sent or self._closed:
            return
        self._eof_sent = True
        if self.transport.can_write_eof() and not self.transport.is_closing():
            try:
                self.transport.write_eof()
            except OSError as exc:
                raise BrokenStreamError(str(exc)) from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_hand_over()
        self._protocol.close_locally()
        if self._send_torn:
            self.transport.abort()
        else:
            self.transport.close()
        try:
            async with asyncio.timeout(CLOSE_FLUSH_SECONDS):
                await asyncio.shield(self._protocol.closed)
        except TimeoutError:
            self.transport.abort()
            await asyncio.shield(self._protocol.closed)
        except asyncio.CancelledError:
            # A closer cancelled mid-flush must not leave the socket to a peer that never
            # reads: its buffer would never drain, and the descriptor would stay for good.
            self.transport.abort()
            raise

    def abort(self) -> None:
        """Close at once, discarding unsent data (a reset for TCP peers)."""
        self._closed = True
        self._end_hand_over()
        self._protocol.close_locally()
        self.transport.abort()

    def _end_hand_over(self) -> None:
        # Closing our fd would leave the socket alive under the splice's duplicate: shut it
        # down, so that a splice still running sees the end.
        if self._handed_over:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    # -- Wire
    def write(self, data: Buffer) -> None:
        if self._eof_sent or self._closed:
            raise ClosedStreamError("write after EOF or close")
        if self.transport.is_closing():
            raise BrokenStreamError("connection lost")
        self.transport.write(data)

    def writelines(self, data: Iterable[Buffer]) -> None:
        if self._eof_sent or self._closed:
            raise ClosedStreamError("write after EOF or close")
        if self.transport.is_closing():
            raise BrokenStreamError("connection lost")
        self.transport.writelines(data)

    async def drain(self) -> None:
        await self._protocol.drain()

    def unread(self, data: bytes) -> None:
        self._protocol.unread(data)

    def set_consumer(self, consumer: Callable[[bytes], bool] | None) -> None:
        """Offer arriving bytes to `consumer`, from the event loop's callback, whenever none
        wait to be received; it returns False to leave them to receive() after all. For a
        relay whose usual step needs no waiting: handing bytes to a task that receive()s them
        costs a wake-up of that task for each read, more than such a step itself."""
        self._protocol.consumer = consumer

    @property
    def writing_paused(self) -> bool:
        """The transport holds more than its high-water mark: writers should drain first."""
        return self._protocol._writing_paused

    # -- details
    def set_nodelay(self) -> None:
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    @property
    def peername(self) -> object:
        return self.transport.get_extra_info("peername")

    def can_hand_over(self) -> bool:
        """Whether take_socket() would succeed: a plain open socket, nothing left unsent."""
        t = self.transport
        return not (
            t.get_extra_info("socket") is None
            or t.get_extra_info("sslcontext") is not None
            or self._closed
            or self._eof_sent
            or t.is_closing()
            or t.get_write_buffer_size()
            or self._protocol._error is not None
        )

    def take_socket(self, *, give_away: bool = False) -> tuple[socket.socket, bytes, bool]:
        """Hand the connection over to a kernel splice (podgate.aio.ksplice): reading stops
        for good; returns a duplicate of the socket, the bytes received and not yet read, and
        whether EOF came already. Closing this stream still closes the connection, unless
        `give_away` (the socket goes to another owner, e.g. another process over SCM_RIGHTS):
        then closing it only drops this stream's descriptor."""
        if not self.can_hand_over():
            raise ClosedStreamError("the connection cannot be handed over")
        self._handed_over = not give_away
        dup = self.duplicate_socket()
        pending, eof = self.stop_reading()
        return dup, pending, eof

    def can_take_reading(self) -> bool:
        """Whether take_reading() would succeed: a plain socket (not TLS), open, unbroken."""
        t = self.transport
        return not (
            t.get_extra_info("socket") is None
            or t.get_extra_info("sslcontext") is not None
            or self._closed
            or t.is_closing()
            or self._protocol._error is not None
        )

    def take_reading(self) -> tuple[socket.socket, bytes, bool]:
        """Take over reading for good (podgate.aio.spdysplice): the transport stops reading,
        writes still go through it. Returns a duplicate of the socket to read (and splice)
        from, the bytes received and not yet read, and whether EOF came already.

        The caller must close the duplicate before this stream is closed: the socket lives on
        as long as either descriptor does."""
        dup = self.duplicate_socket()
        pending, eof = self.stop_reading()
        return dup, pending, eof

    def duplicate_socket(self) -> socket.socket:
        """A non-blocking duplicate of the socket (uvloop refuses add_reader/add_writer on
        the descriptor its transport owns). Close it before this stream is closed."""
        if not self.can_take_reading():
            raise ClosedStreamError("the socket cannot be shared")
        fd = self.transport.get_extra_info("socket").fileno()
        dup = socket.socket(fileno=os.dup(fd))
        dup.setblocking(False)
        return dup

    def stop_reading(self) -> tuple[bytes, bool]:
        """Stop the transport's reading for good, for a caller that reads a duplicate of the
        socket itself: the bytes received and not yet read, and whether EOF came already."""
        if not self.can_take_reading():
            raise ClosedStreamError("reading cannot be taken over")
        protocol = self._protocol
        protocol._reading_paused = True  # read() must never resume the transport
        self.transport.pause_reading()
        pending = b"".join(protocol._chunks)
        protocol._chunks.clear()
        protocol._buffered = 0
        protocol._update_busy()
        return pending, protocol._eof

    @property
    def write_buffer_size(self) -> int:
        """Bytes written and not yet taken by the socket."""
        return self.transport.get_write_buffer_size()

    @property
    def eof_sent(self) -> bool:
        return self._eof_sent or self._closed

    @property
    def at_eof(self) -> bool:
        return self._protocol._eof and not self._protocol._chunks

    async def wait_closed(self) -> None:
        await asyncio.shield(self._protocol.closed)


async def start_server(
    handler: _Handler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    backlog: int = 1024,
    tasks: TaskSet | None = None,
) -> asyncio.Server:
    """Listen on host:port and run `handler(stream)` in a task for each connection.

    The tasks belong to `tasks` (the caller's, to drain them on shutdown) or to a set of the
    server's own."""
    loop = asyncio.get_running_loop()
    owner = tasks if tasks is not None else TaskSet(f"server {host}:{port}", log)

    def factory() -> asyncio.BaseProtocol:
        return _secured(_AcceptingProtocol(handler, owner), ssl_context)

    return await loop.create_server(factory, host, port, backlog=backlog)


def remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a previous run; anything else at `path` is an error."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
    except FileNotFoundError:
        return
    os.unlink(path)


async def start_unix_server(
    handler: _Handler,
    path: str,
    *,
    ssl_context: ssl.SSLContext | None = None,
    mode: int = 0o600,
    tasks: TaskSet | None = None,
) -> asyncio.Server:
    """Listen on a unix socket (a stale socket file is replaced; permissions set to `mode`);
    connection tasks belong to `tasks` as for start_server."""
    loop = asyncio.get_running_loop()
    owner = tasks if tasks is not None else TaskSet(f"server {path}", log)
    remove_stale_socket(path)
    server = await loop.create_unix_server(
        lambda: _secured(_AcceptingProtocol(handler, owner), ssl_context), path
    )
    os.chmod(path, mode)
    return server


def _secured(protocol: _StreamProtocol, ssl_context: ssl.SSLContext | None) -> asyncio.BaseProtocol:
    """The protocol a server's transport gets: `protocol`, or TLS in front of it."""
    return protocol if ssl_context is None else tls.server_side(protocol, ssl_context)


class _AcceptingProtocol(_StreamProtocol):
    def __init__(self, handler: _Handler, tasks: TaskSet) -> None:
        super().__init__()
        self._handler = handler
        self._tasks = tasks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        stream = SocketStream(self)
        stream.set_nodelay()
        try:
            self._tasks.spawn(_run_handler(self._handler, stream), name=f"conn {stream.peername}")
        except RuntimeError:
            stream.abort()  # the server is shutting down: no new connection is served


async def _run_handler(handler: _Handler, stream: SocketStream) -> None:
    try:
        await handler(stream)
    finally:
        await stream.aclose()
