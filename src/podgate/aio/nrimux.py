"""asyncio driver for NRI's connection multiplexer: logical `Wire`s over one trunk `Wire`.

Usage (either end of an NRI connection)::

    mux = Mux(trunk, name="nri plugin 10-logger")   # trunk: a SocketStream, say
    plugin_conn = mux.conn(PLUGIN_SERVICE_CONN)      # a Wire for ConnID 1
    runtime_conn = mux.conn(RUNTIME_SERVICE_CONN)    # a Wire for ConnID 2
    mux.start()                                      # or: await mux.run() in your own task
    ...  # TtrpcServer().serve(plugin_conn), TtrpcClient(runtime_conn).call(...)
    await mux.aclose()                               # closes the trunk and every conn

The reader does not start by itself: open the connections you serve first, then `start()` (a
task the Mux owns) or `await run()` (in a task you own). Frames that arrive before a ConnID is
opened are dropped, as in Go, so this is how the runtime side gets Go's "blocked read until
registration is awaited". `closed` is set once the trunk is gone; `error` says why, if it failed.

Writes (`write`/`writelines`) are synchronous and go through a per-connection `TtrpcFramer`, so
the frames each connection produces reach the trunk whole and in order, in the shape a Go peer
can read (see `podgate.proto.nrimux`). `drain()` is the trunk's drain. `receive()` returns that
connection's payload bytes, b"" once the trunk ended cleanly or the Mux was closed, and raises
`BrokenStreamError` when the trunk failed. `aclose()` on a connection closes only it: frames
for it are dropped from then on and the trunk stays up.

Each connection queues at most `READ_QUEUE_FRAMES` frames. Like Go's mux, overflowing a queue
is fatal for the trunk and every connection on it: the mux never stops reading the trunk for
one slow reader, because the other connection's replies travel on the same trunk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterable

from podgate.aio.errors import BrokenStreamError, ClosedStreamError, StreamError
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, Wire
from podgate.proto.errors import LocalProtocolError
from podgate.proto.nrimux import (
    MAX_CONN_ID,
    PLUGIN_SERVICE_CONN,
    RESERVED_CONN_ID,
    RUNTIME_SERVICE_CONN,
    MuxDecoder,
    MuxFrame,
    MuxProtocolError,
    TtrpcFramer,
)

__all__ = [
    "PLUGIN_SERVICE_CONN",
    "READ_QUEUE_FRAMES",
    "RUNTIME_SERVICE_CONN",
    "Mux",
    "MuxWire",
]

log = logging.getLogger(__name__)

# Frames one logical connection may hold unread; Go's readQueueLen. Overflow kills the trunk.
READ_QUEUE_FRAMES = 256
QUEUE_OVERFLOW_MESSAGE = "failed to queue payload for reading"  # Go's text for an overflow


class MuxWire:
    """One logical connection of a `Mux`; a `Wire` for a ttrpc client or server."""

    def __init__(self, mux: Mux, conn_id: int) -> None:
        self._mux = mux
        self.conn_id = conn_id
        self._framer = TtrpcFramer(conn_id)
        self._frames: collections.deque[bytes] = collections.deque()
        self._readable = asyncio.Event()
        self._closed = False  # closed by us
        self._eof = False  # the trunk is gone
        self._error: str | None = None  # why the trunk failed, if it did

    @property
    def peername(self) -> str:
        """For log lines (the ttrpc driver names its connection with it)."""
        return f"{self._mux.name} conn {self.conn_id}"

    @property
    def closed(self) -> bool:
        return self._closed or self._eof

    # -- Wire
    def write(self, data: Buffer) -> None:
        self._check_writable()
        frames = self._framer.feed(data)
        if frames:
            self._mux._write(frames)

    def writelines(self, data: Iterable[Buffer]) -> None:
        self._check_writable()
        frames: list[bytes] = []
        for chunk in data:
            frames += self._framer.feed(chunk)
        if frames:
            self._mux._write(frames)

    async def drain(self) -> None:
        self._check_writable()
        await self._mux._drain()

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """The next payload bytes (several queued frames at once, up to `max_bytes`)."""
        while not self._frames:
            if self._closed:
                raise ClosedStreamError("connection is closed")
            if self._eof:
                if self._error is not None:
                    raise BrokenStreamError(self._error)
                return b""
            self._readable.clear()
            await self._readable.wait()
        if self._closed:
            raise ClosedStreamError("connection is closed")
        chunk = self._frames.popleft()
        if len(chunk) > max_bytes:
            self._frames.appendleft(chunk[max_bytes:])
            return chunk[:max_bytes]
        if self._frames and len(chunk) + len(self._frames[0]) <= max_bytes:
            parts = [chunk]
            size = len(chunk)
            while self._frames and size + len(self._frames[0]) <= max_bytes:
                part = self._frames.popleft()
                parts.append(part)
                size += len(part)
            chunk = b"".join(parts)
        return chunk

    async def aclose(self) -> None:
        """Close this connection only; the trunk and other connections stay up."""
        if self._closed:
            return
        self._closed = True
        self._frames.clear()
        self._readable.set()
        self._mux._forget(self)

    # -- called by the Mux
    def _deliver(self, payload: bytes) -> bool:
        """Queue a frame; False when the queue is full (fatal for the trunk)."""
        if self._closed:
            return True
        if len(self._frames) >= self._mux.read_queue_frames:
            return False
        if payload:
            self._frames.append(payload)
            self._readable.set()
        return True

    def _trunk_closed(self, error: str | None) -> None:
        self._eof = True
        self._error = error
        self._readable.set()

    def _check_writable(self) -> None:
        if self._closed:
            raise ClosedStreamError("write on a closed connection")
        if self._eof:
            raise BrokenStreamError(self._error or "mux closed")


class Mux:
    """Logical connections (`conn(id)`) over one trunk `Wire`; see the module docstring."""

    def __init__(
        self, wire: Wire, *, name: str = "nri mux", read_queue_frames: int = READ_QUEUE_FRAMES
    ) -> None:
        if read_queue_frames < 1:
            raise ValueError("read_queue_frames must be at least 1")
        self.name = name
        self.read_queue_frames = read_queue_frames
        self.closed = asyncio.Event()  # set once the trunk has been closed
        self.error: str | None = None  # why the trunk failed; None after a clean end
        self._wire = wire
        self._decoder = MuxDecoder()
        self._conns: dict[int, MuxWire] = {}
        self._shut_down = False
        self._running = False
        self._reader: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    def conn(self, conn_id: int) -> MuxWire:
        """The logical connection `conn_id` (the same object until it is closed)."""
        if not RESERVED_CONN_ID < conn_id <= MAX_CONN_ID:
            raise LocalProtocolError(f"ConnID {conn_id} is reserved or out of range")
        existing = self._conns.get(conn_id)
        if existing is not None:
            return existing
        wire = MuxWire(self, conn_id)
        if self._shut_down:
            wire._trunk_closed(self.error)
        else:
            self._conns[conn_id] = wire
        return wire

    def start(self) -> None:
        """Run the trunk reader in a task owned by the Mux (`aclose()` ends it)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self.run(), name=f"{self.name} reader"
            )

    async def run(self) -> None:
        """Read the trunk and dispatch frames until it ends; then close everything.

        Never raises for anything the peer does; `error` records a failure.
        """
        if self._running:
            raise RuntimeError(f"{self.name}: the reader is already running")
        self._running = True
        error: str | None = None
        try:
            while not self._shut_down:
                data = await self._wire.receive()
                if not data:
                    self._decoder.receive_eof()
                    break
                error = self._dispatch(self._decoder.receive_data(data))
                if error is not None:
                    break
        except MuxProtocolError as exc:
            error = exc.message
        except StreamError as exc:
            error = str(exc) or type(exc).__name__
        finally:
            if error is not None and not self._shut_down:
                log.warning("%s: closing the trunk: %s", self.name, error)
            self._shutdown(error)
            await self._wait_closer()

    async def aclose(self) -> None:
        """Close the trunk and every logical connection; stop the reader. Idempotent."""
        self._shutdown(None)
        await self._wait_closer()
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task() and not reader.done():
            reader.cancel()
            await asyncio.wait([reader])

    async def wait_closed(self) -> None:
        await self.closed.wait()

    async def __aenter__(self) -> Mux:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals
    def _dispatch(self, frames: list[MuxFrame]) -> str | None:
        for frame in frames:
            conn = self._conns.get(frame.conn_id)
            if conn is None:
                log.debug("%s: dropped a frame for unopened conn %d", self.name, frame.conn_id)
            elif not conn._deliver(frame.payload):
                return f"{QUEUE_OVERFLOW_MESSAGE} (conn {frame.conn_id})"
        return None

    def _write(self, frames: list[bytes]) -> None:
        try:
            self._wire.writelines(frames)
        except StreamError as exc:
            self._shutdown(f"failed to write to trunk: {exc}")
            raise

    async def _drain(self) -> None:
        try:
            await self._wire.drain()
        except StreamError as exc:
            self._shutdown(f"failed to write to trunk: {exc}")
            raise

    def _forget(self, conn: MuxWire) -> None:
        if self._conns.get(conn.conn_id) is conn:
            del self._conns[conn.conn_id]

    def _shutdown(self, error: str | None) -> None:
        """Mark everything closed now (synchronously) and close the trunk in the background."""
        if self._shut_down:
            return
        self._shut_down = True
        self.error = error
        for conn in self._conns.values():
            conn._trunk_closed(error)
        self._conns.clear()
        self._closer = asyncio.get_running_loop().create_task(
            self._close_trunk(), name=f"{self.name} close"
        )

    async def _close_trunk(self) -> None:
        try:
            with contextlib.suppress(StreamError):
                await self._wire.aclose()
        finally:
            self.closed.set()

    async def _wait_closer(self) -> None:
        if self._closer is not None:
            await asyncio.shield(self._closer)
