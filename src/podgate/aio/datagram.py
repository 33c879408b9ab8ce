"""A connected UDP socket as a ByteStream of framed datagrams (podgate.proto.datagram).

This is what the pod end of a UDP port-forward looks like to the layers above: `send()` takes
framed bytes in any chunking and sends one datagram per complete frame; `receive()` returns
the datagrams that arrived, framed. So splice, throttling and hooks work on it unchanged.

UDP has no half-close: `send_eof()` ends the flow (the next `receive()` returns b""), which is
how the client's FIN closes the pod's socket. A datagram the kernel refuses to deliver (ICMP
port unreachable, surfacing as ECONNREFUSED on a later send or receive; one too big for IPv4;
a full send queue) is dropped and counted, never the end of the stream: UDP promises nothing
more.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Final

from podgate.aio.errors import BrokenStreamError, ClosedStreamError, ConflictGuard
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.proto.datagram import (
    MAX_DATAGRAM_BYTES,
    DatagramDecoder,
    TruncatedDatagramError,
    encode_datagram,
)

__all__ = ["DROPPED_ERRNOS", "DatagramStream", "connected_udp_socket"]

log = logging.getLogger(__name__)

# Errors that lose one datagram but leave the flow usable: the peer's port is closed (ICMP),
# the datagram is too big for the path, the send queue is full, or the route is gone.
DROPPED_ERRNOS: Final = frozenset(
    {
        errno.ECONNREFUSED,
        errno.EMSGSIZE,
        errno.ENOBUFS,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)


def connected_udp_socket(host: str, port: int, family: int = socket.AF_INET) -> socket.socket:
    """A non-blocking UDP socket connected to host:port (connect only sets the peer)."""
    sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class DatagramStream(ByteStream):
    """Framed datagrams over a connected, non-blocking UDP socket (which it owns)."""

    def __init__(self, sock: socket.socket, *, label: str = "") -> None:
        if sock.type != socket.SOCK_DGRAM:
            raise ValueError("DatagramStream needs a SOCK_DGRAM socket")
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._decoder = DatagramDecoder()
        self._pending = bytearray()  # framed datagrams received but not yet handed out
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None
        self._eof = False
        self._closed = False
        # One waiter per direction: the loop keeps one reader/writer callback per fd.
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")
        self.label = label or f"udp fd {self._fd}"
        self.datagrams_sent = 0
        self.datagrams_received = 0
        self.dropped = 0

    # -- ByteStream
    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            return await self._receive(max_bytes)

    async def _receive(self, max_bytes: int) -> bytes:
        while True:
            if self._closed:
                raise ClosedStreamError("stream is closed")
            if self._pending:
                return self._take(max_bytes)
            if self._eof:
                return b""
            self._drain_socket(max_bytes)
            if self._pending:
                return self._take(max_bytes)
            await self._wait("reader")

    async def send(self, data: Buffer) -> None:
        if self._closed:
            raise ClosedStreamError("stream is closed")
        if self._eof:
            raise ClosedStreamError("send after the flow ended")
        with self._sending:
            for datagram in self._decoder.feed(data):
                await self._send_one(datagram)

    async def send_eof(self) -> None:
        """End the flow: nothing more goes out, and receive() returns b"" from now on."""
        if self._eof or self._closed:
            return
        self._eof = True
        self._wake("reader")
        try:
            self._decoder.receive_eof()
        except TruncatedDatagramError as exc:
            raise BrokenStreamError(f"{self.label}: {exc}") from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._eof = True
        # Unregister before the fd is closed: a reused fd number must not inherit a callback.
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._wake("reader")
        self._wake("writer")
        self._sock.close()

    # -- internals
    def _take(self, max_bytes: int) -> bytes:
        chunk = bytes(self._pending[:max_bytes])
        del self._pending[:max_bytes]
        return chunk

    def _drain_socket(self, max_bytes: int) -> None:
        """Everything the socket holds (up to about `max_bytes`), framed into _pending."""
        while len(self._pending) < max_bytes:
            try:
                datagram = self._sock.recv(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in DROPPED_ERRNOS:
                    # An earlier send of ours bounced (ICMP); the flow goes on.
                    self._drop(exc)
                    continue
                raise BrokenStreamError(f"{self.label}: recv: {exc}") from exc
            self._pending += encode_datagram(datagram)
            self.datagrams_received += 1

    async def _send_one(self, datagram: bytes) -> None:
        while True:
            if self._closed:
                raise ClosedStreamError("stream is closed")
            try:
                self._sock.send(datagram)
            except (BlockingIOError, InterruptedError):
                await self._wait("writer")
                continue
            except OSError as exc:
                if exc.errno in DROPPED_ERRNOS:
                    self._drop(exc)
                    return
                raise BrokenStreamError(f"{self.label}: send: {exc}") from exc
            self.datagrams_sent += 1
            return

    def _drop(self, exc: OSError) -> None:
        self.dropped += 1
        log.debug("%s: datagram dropped: %s", self.label, exc)

    async def _wait(self, which: str) -> None:
        waiter = self._loop.create_future()
        if which == "reader":
            self._reader = waiter
            self._loop.add_reader(self._fd, self._wake, which)
        else:
            self._writer = waiter
            self._loop.add_writer(self._fd, self._wake, which)
        try:
            await waiter
        finally:
            if which == "reader":
                self._reader = None
                if not self._closed:
                    self._loop.remove_reader(self._fd)
            else:
                self._writer = None
                if not self._closed:
                    self._loop.remove_writer(self._fd)

    def _wake(self, which: str) -> None:
        waiter = self._reader if which == "reader" else self._writer
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
