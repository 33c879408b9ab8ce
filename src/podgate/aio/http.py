"""Reading HTTP/1.1 requests off a SocketStream with the sans-IO handshake core."""

from __future__ import annotations

import asyncio

from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream
from podgate.proto.upgrade import ServerHandshake, UpgradeRequest

# A client has this long to send its next request head (idle keep-alive connections and
# clients that stall half-way through a head alike), so none can hold a handler forever.
REQUEST_HEAD_TIMEOUT_SECONDS = 30.0


async def next_request(conn: SocketStream, handshake: ServerHandshake) -> UpgradeRequest | None:
    """The next request on a keep-alive connection; None when the client is done.

    Raises podgate.proto.errors.RemoteProtocolError (HandshakeError carries the status) for a
    malformed request; answer it with handshake.respond() and close.
    """
    request = handshake.receive_data(b"")  # one may already be queued (pipelining)
    try:
        async with asyncio.timeout(REQUEST_HEAD_TIMEOUT_SECONDS):
            while request is None:
                if handshake.must_close:
                    return None
                data = await conn.receive()
                if not data:
                    handshake.receive_eof()
                    return None
                request = handshake.receive_data(data)
    except TimeoutError:
        return None  # an idle or stalled client: the caller closes the connection
    return request


# After an error answer on a connection we will not read further: how long to discard what
# the client still sends, so closing does not reset the connection before it read our answer.
LINGER_SECONDS = 1.0
LINGER_MAX_BYTES = 1024 * 1024


async def linger_close(conn: SocketStream) -> None:
    """Half-close, drain the client's leftovers briefly, then let the caller close."""
    try:
        await conn.send_eof()
        drained = 0
        async with asyncio.timeout(LINGER_SECONDS):
            while drained < LINGER_MAX_BYTES and (chunk := await conn.receive()):
                drained += len(chunk)
    except (TimeoutError, StreamError):
        pass
