"""Pass a connected socket to another process over a unix socket (SCM_RIGHTS).

The wire: one message whose first byte is MARKER and which carries the descriptor, then the
bytes already received from that socket and not yet read (they come before anything the socket
itself yields), then EOF. The receiver gets the socket and those bytes; the sender keeps
nothing: once sent, the connection is the receiver's alone.
"""

from __future__ import annotations

import array
import asyncio
import socket
from typing import Final

from podgate.aio.errors import StreamError
from podgate.aio.ksplice import wait_ready

__all__ = ["MARKER", "MAX_PENDING_BYTES", "HandOverError", "receive_socket", "send_socket"]

# The first byte of the message that carries the descriptor: a caller that reads plain bytes
# from the channel never mistakes it for payload of a forwarded connection.
MARKER: Final = b"\xfd"
# Bytes a stream may have buffered before the hand-over (its read buffer, a few hundred KiB at
# most); more is a broken sender.
MAX_PENDING_BYTES: Final = 16 * 1024 * 1024
_FIRST_READ_BYTES: Final = 64 * 1024
_FD_BYTES: Final = array.array("i").itemsize


class HandOverError(StreamError):
    """The channel did not carry one socket as this module sends it."""


async def send_socket(channel: socket.socket, sock: socket.socket, pending: bytes = b"") -> None:
    """Send `sock`'s descriptor and `pending` over the non-blocking unix socket `channel`, then
    shut its sending half. The caller still closes both sockets (its own descriptors)."""
    loop = asyncio.get_running_loop()
    first = MARKER + pending
    while True:
        try:
            sent = socket.send_fds(channel, [first], [sock.fileno()])
            break
        except BlockingIOError:
            await wait_ready(loop.add_writer, loop.remove_writer, channel.fileno())
        except OSError as exc:
            raise HandOverError(f"cannot pass the connection: {exc}") from exc
    try:
        if sent < len(first):
            await loop.sock_sendall(channel, first[sent:])
        channel.shutdown(socket.SHUT_WR)
    except OSError as exc:
        raise HandOverError(f"cannot pass the connection's buffered bytes: {exc}") from exc


async def receive_socket(channel: socket.socket) -> tuple[socket.socket, bytes]:
    """The socket `send_socket` passed over the non-blocking unix socket `channel` (non-blocking,
    close-on-exec) and the bytes to deliver before anything read from it."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            # Not socket.recv_fds: it drops its flags argument (CPython 3.11), and the
            # descriptor must arrive close-on-exec.
            data, ancillary, flags, _ = channel.recvmsg(
                _FIRST_READ_BYTES, socket.CMSG_SPACE(_FD_BYTES), socket.MSG_CMSG_CLOEXEC
            )
            break
        except BlockingIOError:
            await wait_ready(loop.add_reader, loop.remove_reader, channel.fileno())
        except OSError as exc:
            raise HandOverError(f"cannot receive the connection: {exc}") from exc
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_BYTES])
    received = [socket.socket(fileno=fd) for fd in fds]
    try:
        if flags & socket.MSG_CTRUNC or len(received) != 1 or not data.startswith(MARKER):
            raise HandOverError(
                f"no connection passed: {len(received)} descriptors, first bytes {data[:8]!r}"
            )
        pending = bytearray(data[len(MARKER) :])
        while chunk := await loop.sock_recv(channel, _FIRST_READ_BYTES):
            pending += chunk
            if len(pending) > MAX_PENDING_BYTES:
                raise HandOverError(f"more than {MAX_PENDING_BYTES} bytes came with a connection")
    except OSError as exc:
        for sock in received:
            sock.close()
        raise HandOverError(f"cannot receive the connection's buffered bytes: {exc}") from exc
    except BaseException:
        for sock in received:
            sock.close()
        raise
    sock = received[0]
    sock.setblocking(False)
    return sock, bytes(pending)
