"""Accepting connections with a budget for the ones that have not authenticated yet.

Before a client has proven who it is, it costs us a TLS handshake and a request parse and
gives nothing back. So at most `max_pending` connections may be between accept and their
first authenticated request, and each has `timeout` seconds (TLS handshake plus request head)
to get there. A connection over the cap is closed at once with a reset, before any TLS work;
a slow one is closed at its deadline. Slots free as connections authenticate or go, so the
gateway recovers as soon as a flood stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Final

from podgate.aio import tls
from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream

__all__ = [
    "DEFAULT_AUTH_TIMEOUT_SECONDS",
    "DEFAULT_MAX_UNAUTHENTICATED",
    "Listener",
    "PreAuth",
    "Ticket",
    "listen",
]

log = logging.getLogger(__name__)

# Connections at once between accept and their first authenticated request. kubectl opens a
# handful per command; a few hundred covers many users starting commands together.
DEFAULT_MAX_UNAUTHENTICATED: Final = 256
# Seconds from accept to an authenticated request head (TLS handshake included): a client on
# a slow link needs a round trip or three, not more.
DEFAULT_AUTH_TIMEOUT_SECONDS: Final = 10.0
# Pending connections the kernel may queue before we accept them.
LISTEN_BACKLOG: Final = 1024
# SO_LINGER {on, 0 s}: close() sends a reset and frees the socket at once.
_RESET_ON_CLOSE: Final = struct.pack("ii", 1, 0)


class Ticket:
    """One connection's pre-auth slot, given back once it authenticates or ends."""

    __slots__ = ("_owner", "deadline", "released")

    def __init__(self, owner: PreAuth, deadline: float) -> None:
        self._owner = owner
        self.deadline = deadline  # loop.time() by which it must have authenticated
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner.pending -= 1


class PreAuth:
    """The budget of unauthenticated connections; counts what it refused."""

    def __init__(
        self,
        max_pending: int = DEFAULT_MAX_UNAUTHENTICATED,
        timeout: float = DEFAULT_AUTH_TIMEOUT_SECONDS,
    ) -> None:
        if max_pending < 1 or timeout <= 0:
            raise ValueError("the pre-auth cap and timeout must be positive")
        self.max_pending = max_pending
        self.timeout = timeout
        self.pending = 0
        self.refused = 0
        self.timed_out = 0

    def try_acquire(self, now: float) -> Ticket | None:
        if self.pending >= self.max_pending:
            self.refused += 1
            return None
        self.pending += 1
        return Ticket(self, now + self.timeout)


Handler = Callable[[SocketStream, Ticket], Awaitable[None]]
# Told about each connection refused by the cap (peer address), for audit and metrics.
RefusedHook = Callable[[object, str], None]


class Listener:
    """A listening socket, its accept loop and its connections; closed by `close()`."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        ssl_context: ssl.SSLContext | None,
        preauth: PreAuth,
        on_refused: RefusedHook | None,
    ) -> None:
        self.sockets = [sock]
        self._handler = handler
        self._ssl = ssl_context
        self.preauth = preauth
        self._on_refused = on_refused
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(
            self._accept_loop(), name=f"accept {sock.getsockname()}"
        )

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self.sockets[0]
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            ticket = self.preauth.try_acquire(loop.time())
            if ticket is None:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
                conn.close()
                if self._on_refused is not None:
                    self._on_refused(peer, "too many unauthenticated connections")
                continue
            task = loop.create_task(self._serve(conn, ticket), name=f"conn {peer}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                protocol = SocketStream.protocol_factory()
                async with asyncio.timeout_at(ticket.deadline):
                    if self._ssl is None:
                        await loop.connect_accepted_socket(lambda: protocol, conn)
                    else:
                        await tls.accept(protocol, conn, self._ssl)
            except (TimeoutError, OSError, ssl.SSLError, ConnectionError) as exc:
                if isinstance(exc, TimeoutError):
                    self.preauth.timed_out += 1
                log.debug("connection dropped before its first request: %s", exc)
                conn.close()
                return
            stream = SocketStream(protocol)
            stream.set_nodelay()
            try:
                await self._handler(stream, ticket)
            except StreamError:
                pass
            finally:
                await stream.aclose()
        finally:
            ticket.release()

    def close(self) -> None:
        self._accepting.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self) -> None:
        await asyncio.wait({self._accepting})  # its cancellation is its end, not ours

    @property
    def active(self) -> int:
        """Connections whose handler is still running."""
        return len(self._tasks)

    async def close_clients(self, grace: float = 0.0) -> None:
        """Let connections go on for `grace` seconds, then end the rest; wait until every
        handler has finished (and audited)."""
        if self._tasks and grace > 0:
            await asyncio.wait(set(self._tasks), timeout=grace)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def serve_forever(self) -> None:
        await asyncio.shield(self._accepting)

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        await self.wait_closed()


async def listen(
    handler: Handler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    preauth: PreAuth | None = None,
    on_refused: RefusedHook | None = None,
) -> Listener:
    """Listen on host:port (an IP address or a name that resolves locally)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return Listener(sock, handler, ssl_context, preauth or PreAuth(), on_refused)
