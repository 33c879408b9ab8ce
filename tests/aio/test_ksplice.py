"""Kernel splice between two SocketStreams over real TCP and unix sockets, and unix to TCP (the
agent's case, copied through a buffer in that direction): every byte both ways (sha256), bytes
received before the hand-over first, EOF forwarded per direction, a reset ends both, and
streams that cannot be handed over still relay through the copy."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from collections.abc import AsyncIterator

import pytest

from podgate.aio.ksplice import splice_sockets
from podgate.aio.streams import ByteStream, SocketStream

# Several pipe fills each way.
TRANSFER_BYTES = 6 * 1024 * 1024 + 123
CHUNK_BYTES = 256 * 1024
# A hung relay must fail, not hang.
TIMEOUT_SECONDS = 60.0


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        outer = socket.create_connection(listener.getsockname())
        inner, _ = listener.accept()
    outer.setblocking(False)
    return outer, inner


def _unix_pair() -> tuple[socket.socket, socket.socket]:
    outer, inner = socket.socketpair()
    outer.setblocking(False)
    return outer, inner


async def _send_all(sock: socket.socket, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        await loop.sock_sendall(sock, view[offset : offset + CHUNK_BYTES])
    sock.shutdown(socket.SHUT_WR)


async def _receive_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    parts = []
    while chunk := await loop.sock_recv(sock, CHUNK_BYTES):
        parts.append(chunk)
    return b"".join(parts)


Relay = tuple[socket.socket, SocketStream, SocketStream, socket.socket]


@contextlib.asynccontextmanager
async def _relay(kind: str) -> AsyncIterator[Relay]:
    """client -- a == relay == b -- server: the outer ends raw, the relayed ends streams.
    `kind` is both sides' kind, or CLIENT_SIDE-SERVER_SIDE ("unix-tcp": a unix client, a TCP
    server, as the agent relays; unix into TCP copies, TCP into unix splices)."""
    pairs = {"tcp": _tcp_pair, "unix": _unix_pair}
    client_kind, _, server_kind = kind.partition("-")
    client, a_sock = pairs[client_kind]()
    server, b_sock = pairs[server_kind or client_kind]()
    a = await SocketStream.from_socket(a_sock)
    b = await SocketStream.from_socket(b_sock)
    try:
        yield client, a, b, server
    finally:
        await a.aclose()
        await b.aclose()
        client.close()
        server.close()


@pytest.fixture(params=["tcp", "unix", "unix-tcp", "tcp-unix"])
async def relay(request: pytest.FixtureRequest) -> AsyncIterator[Relay]:
    async with _relay(request.param) as value:
        yield value


async def test_every_byte_both_ways_with_eof_and_early_bytes_first(
    relay: Relay,
) -> None:
    client, a, b, server = relay
    loop = asyncio.get_running_loop()
    up, down = os.urandom(TRANSFER_BYTES), os.urandom(TRANSFER_BYTES)
    # Received before the hand-over: one byte read, the rest buffered in the stream.
    await loop.sock_sendall(client, up[:1000])
    assert await a.receive(1) == up[:1]
    async with asyncio.timeout(TIMEOUT_SECONDS):
        async with asyncio.TaskGroup() as tg:
            relayed = tg.create_task(splice_sockets(a, b))
            tg.create_task(_send_all(client, up[1000:]))
            tg.create_task(_send_all(server, down))
            at_server = tg.create_task(_receive_all(server))
            at_client = tg.create_task(_receive_all(client))
    assert hashlib.sha256(at_server.result()).digest() == hashlib.sha256(up[1:]).digest()
    assert hashlib.sha256(at_client.result()).digest() == hashlib.sha256(down).digest()
    result = relayed.result()
    assert (result.a_to_b, result.b_to_a, result.error) == (len(up) - 1, len(down), None)


async def test_half_close_keeps_the_other_direction_open(
    relay: Relay,
) -> None:
    client, a, b, server = relay
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(TIMEOUT_SECONDS):
        relayed = asyncio.create_task(splice_sockets(a, b))
        await _send_all(client, b"request")  # request, then FIN
        assert await _receive_all(server) == b"request"  # EOF arrived at the server
        await loop.sock_sendall(server, b"answer after the FIN")
        server.shutdown(socket.SHUT_WR)
        assert await _receive_all(client) == b"answer after the FIN"
        assert (await relayed).error is None


async def test_a_tcp_reset_ends_both_directions() -> None:
    async with _relay("tcp") as (client, a, b, server), asyncio.timeout(TIMEOUT_SECONDS):
        relayed = asyncio.create_task(splice_sockets(a, b, abort_on_error=True))
        await asyncio.get_running_loop().sock_sendall(client, b"x")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()  # RST
        result = await relayed
        assert result.error is not None
        # The server's side ends too (EOF, or a reset where bytes were still unread).
        with contextlib.suppress(ConnectionResetError):
            assert (await _receive_all(server)) in (b"", b"x")


class _Wrapped(ByteStream):
    """Not a SocketStream: the relay cannot hand it to the kernel."""

    def __init__(self, inner: SocketStream) -> None:
        self.inner = inner

    async def receive(self, max_bytes: int = CHUNK_BYTES) -> bytes:
        return await self.inner.receive(max_bytes)

    async def send(self, data: object) -> None:
        await self.inner.send(data)  # type: ignore[arg-type]

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_streams_that_cannot_be_handed_over_are_copied(
    relay: Relay,
) -> None:
    client, a, b, server = relay
    data = os.urandom(TRANSFER_BYTES)
    async with asyncio.timeout(TIMEOUT_SECONDS):
        async with asyncio.TaskGroup() as tg:
            relayed = tg.create_task(splice_sockets(_Wrapped(a), b))
            tg.create_task(_send_all(client, data))
            tg.create_task(_send_all(server, b""))
            at_server = tg.create_task(_receive_all(server))
            at_client = tg.create_task(_receive_all(client))
    assert at_server.result() == data and at_client.result() == b""
    assert relayed.result().a_to_b == len(data)
