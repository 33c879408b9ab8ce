"""Reading HTTP/1.1 requests off a SocketStream with the sans-IO handshake core."""

from __future__ import annotations

from podgate.aio.streams import SocketStream
from podgate.proto.upgrade import ServerHandshake, UpgradeRequest

# A client that opened a connection has this long to finish its request head.
REQUEST_HEAD_TIMEOUT_SECONDS = 30.0


async def next_request(conn: SocketStream, handshake: ServerHandshake) -> UpgradeRequest | None:
    """The next request on a keep-alive connection; None when the client is done.

    Raises podgate.proto.errors.RemoteProtocolError (HandshakeError carries the status) for a
    malformed request; answer it with handshake.respond() and close.
    """
    request = handshake.receive_data(b"")  # one may already be queued (pipelining)
    while request is None:
        if handshake.must_close:
            return None
        data = await conn.receive()
        if not data:
            handshake.receive_eof()
            return None
        request = handshake.receive_data(data)
    return request
