"""TLS over a plain transport, with what a busy connection holds kept small.

The event loop's own TLS (uvloop's, and asyncio's alike) keeps per connection a 256 KiB read
buffer and two OpenSSL memory BIOs that keep the size they once grew to: after a 4 MiB echo
in 256 KiB writes a connection still held ~700 KiB of malloc'd memory, for as long as it
lived. Under a soak of 64 busy kubectl tunnels that was ~55 MiB of the gateway's growth,
outside every budget.

Here the ciphertext is read into one buffer per event loop, sized to the connection's share
of the process budget (podgate.aio.budget), and enters the incoming BIO FEED_BYTES at a time,
each piece decrypted before the next; writes are encrypted ENCRYPT_BYTES at a time. So each
BIO stays within about one piece (~215 KiB kept per connection after the same echo, OpenSSL's
record buffers included: tests/aio/test_tls.py), and what waits while the application is
paused is a copy of the unfed rest of one read.

`TlsProtocol` sits on the TCP transport; the application's protocol (a BufferedProtocol, as
podgate.aio.streams') sees a `TlsTransport`. No half-close: TLS has none (`can_write_eof`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import weakref
from collections.abc import Iterable
from typing import Any, cast

from podgate.aio.budget import connection_budget

__all__ = [
    "ENCRYPT_BYTES",
    "FEED_BYTES",
    "TlsProtocol",
    "TlsTransport",
    "accept",
    "client_side",
    "server_side",
]

# Ciphertext given to OpenSSL at once: the incoming BIO never grows much past it.
FEED_BYTES = 32 * 1024
# Plaintext encrypted at once: the outgoing BIO never grows much past it.
ENCRYPT_BYTES = 64 * 1024
# Most ciphertext read at once (a lone transfer's read; busy ones read their share).
READ_BYTES = 256 * 1024
_HEADER_BYTES = 5  # a TLS record's header: type, version, 16-bit length
# asyncio's default: a peer that does not finish its handshake in time is cut off.
HANDSHAKE_TIMEOUT_SECONDS = 60.0

_scratches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, memoryview] = (
    weakref.WeakKeyDictionary()
)


def _scratch(loop: asyncio.AbstractEventLoop) -> memoryview:
    """The loop's ciphertext read buffer: fed to OpenSSL before the callback returns."""
    view = _scratches.get(loop)
    if view is None:
        view = _scratches[loop] = memoryview(bytearray(READ_BYTES))
    return view


class TlsTransport(asyncio.Transport):
    """What the application protocol writes to: plaintext in, ciphertext to the socket."""

    def __init__(self, tls: TlsProtocol) -> None:
        super().__init__()
        self._tls = tls

    # -- writing
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._tls.encrypt((data,))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self._tls.encrypt(list_of_data)

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("TLS has no half-close")

    def get_write_buffer_size(self) -> int:
        return self._tls.tcp.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._tls.tcp.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._tls.tcp.set_write_buffer_limits(high, low)

    # -- reading
    def pause_reading(self) -> None:
        self._tls.pause_app_reading()

    def resume_reading(self) -> None:
        self._tls.resume_app_reading()

    def is_reading(self) -> bool:
        return not self._tls.app_paused

    # -- the connection
    def close(self) -> None:
        self._tls.close()

    def abort(self) -> None:
        self._tls.tcp.abort()

    def is_closing(self) -> bool:
        return self._tls.closing or self._tls.tcp.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._tls.extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._tls.app = cast(asyncio.BufferedProtocol, protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._tls.app


class TlsProtocol(asyncio.BufferedProtocol):
    """The TCP transport's protocol: handshake, then decrypt into the application's buffers
    and encrypt what it writes. `handshake` completes once the application is connected."""

    def __init__(
        self,
        app: asyncio.BufferedProtocol,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
    ) -> None:
        self.app = app
        self._handshake_timeout = handshake_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._context = context
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._sslobj = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
        )
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._scratch = _scratch(loop)
        self._budget = connection_budget(loop)
        self.handshake: asyncio.Future[None] = loop.create_future()
        # A server's handshakes are awaited by no one: their failures are only logged there.
        self.handshake.add_done_callback(_retrieve)
        self.tcp: asyncio.Transport = cast(asyncio.Transport, None)
        self._transport = TlsTransport(self)
        self._wrapped = False  # handshake done: the application is connected
        self._unfed = b""  # ciphertext read and not yet given to OpenSSL (reading paused)
        # Where the ciphertext stands in its records (see _cut): bytes of the current
        # record still to come, and the start of a header split across reads.
        self._record_left = 0
        self._header = b""
        # The application's buffer being filled within one read, and how far.
        self._buffer: memoryview | None = None
        self._filled = 0
        self._eof = False  # TCP EOF or close_notify: nothing more to read
        self.app_paused = False
        self.closing = False
        self._lost = False
        self._error: BaseException | None = None  # what ended the connection on our side

    # -- TCP transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tcp = cast(asyncio.Transport, transport)
        self._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)
        self._handshake_step()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._scratch[: min(len(self._scratch), self._budget.share())]

    def buffer_updated(self, nbytes: int) -> None:
        if not self._wrapped:
            # Walked too, so that _cut still knows where records start once application
            # data follows the handshake's last flight in the same read.
            view = self._scratch[:nbytes]
            pos = 0
            while pos < nbytes:
                pos = self._cut(view, pos)
            self._incoming.write(view)
            self._handshake_step()
            return
        self._feed(self._scratch[:nbytes])

    def eof_received(self) -> bool:
        self._eof = True
        if not self._wrapped:
            if not self.handshake.done():
                self.handshake.set_exception(ConnectionResetError("EOF during the TLS handshake"))
            return False  # the transport closes itself
        if not self._unfed and not self.app_paused:
            self._app_eof()
        return True  # we close the transport ourselves, once the application has seen EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._stop_timer()
        if not self.handshake.done():
            self.handshake.set_exception(exc or ConnectionResetError("connection lost"))
        if self._wrapped:
            error = exc or self._error
            self.app.connection_lost(
                error if isinstance(error, Exception) or error is None else None
            )

    def pause_writing(self) -> None:
        if self._wrapped:
            self.app.pause_writing()

    def resume_writing(self) -> None:
        if self._wrapped:
            self.app.resume_writing()

    # -- handshake
    async def wait_handshake(self) -> None:
        """Until the application is connected; on failure or cancellation the connection is
        aborted and the error raised."""
        try:
            await asyncio.shield(self.handshake)
        except BaseException:
            self.tcp.abort()
            raise

    def _handshake_timed_out(self) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(TimeoutError("TLS handshake timed out"))
        self.tcp.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handshake_step(self) -> None:
        try:
            self._sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, OSError) as exc:
            self._flush()  # the alert, if any
            if not self.handshake.done():
                self.handshake.set_exception(exc)
            self.tcp.close()
            return
        self._flush()
        self._stop_timer()
        self._wrapped = True
        self.app.connection_made(self._transport)
        if not self.handshake.done():
            self.handshake.set_result(None)
        # Application data that came with the handshake's last flight.
        self._decrypt()

    # -- reading
    def _feed(self, data: memoryview | bytes) -> None:
        """Give `data` to OpenSSL a run of whole records at a time (FEED_BYTES or a little
        more), decrypting each run before the next into one application buffer, handed on
        when full and at the end; what is left when the application pauses waits in _unfed."""
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if self.app_paused or self.closing:
                break
            end = self._cut(view, pos)
            self._incoming.write(view[pos:end])
            pos = end
            self._decrypt(hand_on=pos == len(view))
        self._hand_on()  # paused or closing in between: what was decrypted goes now
        self._unfed = bytes(view[pos:]) if pos < len(view) else b""

    def _cut(self, view: memoryview, start: int) -> int:
        """The end of the next run from `start`: the first record boundary at least
        FEED_BYTES on, or the end of `view`. Cut between records, OpenSSL stops short of a
        record only at the end of a read: each stop costs an SSLWantReadError, which costs
        more than walking the 5-byte record headers here."""
        pos = start
        end = len(view)
        goal = start + FEED_BYTES
        while pos < end:
            if self._record_left:
                step = min(self._record_left, end - pos)
                self._record_left -= step
                pos += step
                if not self._record_left and pos >= goal:
                    return pos
                continue
            # A record header (type, version, length), possibly split across reads.
            need = _HEADER_BYTES - len(self._header)
            if end - pos < need:
                self._header += view[pos:end]
                return end
            header = self._header + view[pos : pos + need]
            self._header = b""
            pos += need
            self._record_left = int.from_bytes(header[3:5], "big")
        return end

    def _decrypt(self, *, hand_on: bool = True) -> None:
        """Decrypt what OpenSSL has into the application's buffers, filling each before
        handing it on, until OpenSSL needs more ciphertext or the application pauses. A
        buffer not yet full is kept for the next run unless `hand_on`: a read reaches the
        application in as few pieces as uvloop's TLS hands it on."""
        while not self.app_paused and not self.closing and not self._lost:
            if self._buffer is None:
                self._buffer = memoryview(self.app.get_buffer(-1))
                self._filled = 0
            buffer = self._buffer
            ended = False
            try:
                # Only while OpenSSL has bytes: fed whole records, it then seldom runs dry
                # inside one (see _cut).
                while self._filled < len(buffer) and (
                    self._incoming.pending or self._sslobj.pending()
                ):
                    # Into the buffer (typeshed knows only the bytes-returning form).
                    read_into: Any = self._sslobj.read
                    got: int = read_into(len(buffer) - self._filled, buffer[self._filled :])
                    if not got:
                        ended = True  # close_notify
                        break
                    self._filled += got
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                self._buffer = None
                self._fatal(exc)
                return
            full = self._filled == len(buffer)
            if full or ended or hand_on:
                self._hand_on()
            if self._outgoing.pending:  # a key update's answer
                self._flush()
            if ended:
                self._eof = True
                self._app_eof()
                return
            if not full:
                return  # OpenSSL has nothing more: wait for ciphertext

    def _hand_on(self) -> None:
        """Give the application what was decrypted into its buffer."""
        buffer, filled = self._buffer, self._filled
        self._buffer = None
        self._filled = 0
        if buffer is not None and filled:
            self.app.buffer_updated(filled)

    def pause_app_reading(self) -> None:
        if not self.app_paused:
            self.app_paused = True
            with contextlib.suppress(RuntimeError):
                self.tcp.pause_reading()

    def resume_app_reading(self) -> None:
        if not self.app_paused:
            return
        self.app_paused = False
        self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self.app_paused or self._lost:
            return
        self._decrypt()  # what OpenSSL decrypted already
        if self._unfed and not self.app_paused:
            unfed, self._unfed = self._unfed, b""
            self._feed(unfed)
        if self.app_paused:
            return
        if self._eof and not self._unfed:
            self._app_eof()
        else:
            with contextlib.suppress(RuntimeError):
                self.tcp.resume_reading()

    def _app_eof(self) -> None:
        keep_open = self.app.eof_received()
        if not keep_open:
            self.close()

    # -- writing
    def encrypt(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        if self.closing or self.tcp.is_closing():
            return  # as a closing transport: the bytes go nowhere
        out: list[bytes] = []
        try:
            for data in pieces:
                view = memoryview(data).cast("B")
                for pos in range(0, len(view), ENCRYPT_BYTES):
                    self._sslobj.write(view[pos : pos + ENCRYPT_BYTES])
                    out.append(self._outgoing.read())
        except ssl.SSLError as exc:
            self._fatal(exc)
            return
        self.tcp.writelines(out)

    def _flush(self) -> None:
        if self._outgoing.pending and not self.tcp.is_closing():
            self.tcp.write(self._outgoing.read())

    # -- ending
    def close(self) -> None:
        """Send close_notify, then close the TCP transport once its buffer is flushed."""
        if self.closing:
            return
        self.closing = True
        if self._wrapped:
            with contextlib.suppress(ssl.SSLError, OSError):
                self._sslobj.unwrap()  # queues our close_notify; the peer's is not awaited
            self._flush()
        self.tcp.close()

    def _fatal(self, exc: BaseException) -> None:
        self._flush()  # an alert, if OpenSSL made one
        self._error = exc
        self.closing = True
        self.tcp.abort()
        if not self.handshake.done():
            self.handshake.set_exception(exc)

    def extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sslcontext":
            return self._context
        if name == "ssl_object":
            return self._sslobj
        if name == "peercert":
            return self._sslobj.getpeercert()
        if name == "cipher":
            return self._sslobj.cipher()
        return self.tcp.get_extra_info(name, default)


def server_side(
    app: asyncio.BufferedProtocol,
    context: ssl.SSLContext,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
) -> TlsProtocol:
    """The protocol to give a server's (or an accepted socket's) transport."""
    return TlsProtocol(app, context, server_side=True, handshake_timeout=handshake_timeout)


def client_side(
    app: asyncio.BufferedProtocol,
    context: ssl.SSLContext,
    server_hostname: str | None,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
) -> TlsProtocol:
    """The protocol to give a connecting transport."""
    return TlsProtocol(
        app,
        context,
        server_side=False,
        server_hostname=server_hostname,
        handshake_timeout=handshake_timeout,
    )


async def accept(
    app: asyncio.BufferedProtocol, sock: socket.socket, context: ssl.SSLContext
) -> None:
    """Serve TLS on an accepted socket; `app` is connected once the handshake is done.
    On a failed or cancelled handshake the connection is aborted and the error raised."""
    tls = server_side(app, context)
    await asyncio.get_running_loop().connect_accepted_socket(lambda: tls, sock)
    await tls.wait_handshake()


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
