"""In-memory ByteStream pairs: unit tests and in-process plumbing."""

from __future__ import annotations

import asyncio
import collections

from podgate.aio.errors import BrokenStreamError, ClosedStreamError, ConflictGuard
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream

# Bytes one direction may hold before send() waits: small enough to exercise backpressure.
MEMORY_PIPE_CAPACITY = 256 * 1024


class _Pipe:
    """One direction: bounded bytes, EOF, abort."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.eof = False
        self.broken = False
        self.changed = asyncio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def put(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.broken:
                raise BrokenStreamError("peer closed")
            if self.eof:
                raise ClosedStreamError("write after EOF")
            room = self.capacity - self.size
            if room <= 0:
                await self.changed.wait()
                continue
            piece = bytes(view[:room])
            view = view[room:]
            self.chunks.append(piece)
            self.size += len(piece)
            self._notify()

    async def get(self, max_bytes: int) -> bytes:
        while not self.chunks:
            if self.broken:
                raise BrokenStreamError("peer closed")
            if self.eof:
                return b""
            await self.changed.wait()
        chunk = self.chunks.popleft()
        if len(chunk) > max_bytes:
            self.chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self.size -= len(chunk)
        self._notify()
        return chunk

    def finish(self) -> None:
        self.eof = True
        self._notify()

    def break_(self) -> None:
        self.broken = True
        self._notify()


class MemoryStream(ByteStream):
    def __init__(self, inbound: _Pipe, outbound: _Pipe) -> None:
        self._in = inbound
        self._out = outbound
        self._closed = False
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            try:
                if self._closed:
                    raise ClosedStreamError("stream is closed")
                return await self._in.get(max_bytes)
            except BrokenStreamError:
                if self._closed:  # woken by our own aclose()
                    raise ClosedStreamError("stream is closed") from None
                raise

    async def send(self, data: Buffer) -> None:
        with self._sending:
            if self._closed:
                raise ClosedStreamError("stream is closed")
            try:
                await self._out.put(bytes(data))
            except BrokenStreamError:
                if self._closed:
                    raise ClosedStreamError("stream is closed") from None
                raise

    async def send_eof(self) -> None:
        if not self._closed:
            self._out.finish()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._out.eof:
            self._out.break_()
        if not self._in.eof:
            self._in.break_()


def memory_stream_pair(capacity: int = MEMORY_PIPE_CAPACITY) -> tuple[MemoryStream, MemoryStream]:
    """Two connected ByteStreams, like a socketpair."""
    a_to_b = _Pipe(capacity)
    b_to_a = _Pipe(capacity)
    return MemoryStream(b_to_a, a_to_b), MemoryStream(a_to_b, b_to_a)
