"""One conformance suite for every ByteStream implementation, plus splice over real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from podgate.aio.errors import BrokenStreamError, ClosedStreamError, ConnectError
from podgate.aio.memory import memory_stream_pair
from podgate.aio.splice import SpliceResult, splice
from podgate.aio.streams import ByteStream, SocketStream, start_server

Pair = tuple[ByteStream, ByteStream]


async def socket_pair() -> AsyncIterator[Pair]:
    accepted: asyncio.Queue[SocketStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: SocketStream) -> None:
        await accepted.put(stream)
        await done.wait()

    server = await start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await SocketStream.connect("127.0.0.1", port)
    peer = await accepted.get()
    try:
        yield client, peer
    finally:
        done.set()
        await client.aclose()
        server.close()
        await server.wait_closed()


async def mem_pair() -> AsyncIterator[Pair]:
    a, b = memory_stream_pair()
    yield a, b
    await a.aclose()


PAIRS: list[Callable[[], AsyncIterator[Pair]]] = [socket_pair, mem_pair]


async def receive_all(stream: ByteStream) -> bytes:
    parts = []
    while chunk := await stream.receive():
        parts.append(chunk)
    return b"".join(parts)


@pytest.fixture(params=PAIRS, ids=lambda f: f.__name__)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    async for p in request.param():
        yield p


async def test_bytes_flow_both_ways_and_eof_is_half_close(pair: Pair) -> None:
    a, b = pair
    payload = os.urandom(3 * 1024 * 1024 + 7)

    async def sender() -> None:
        await a.send(payload)
        await a.send_eof()

    task = asyncio.create_task(sender())
    got = await receive_all(b)
    await task
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    # a's sending half is done, its receiving half still works
    await b.send(b"reply")
    await b.send_eof()
    assert await receive_all(a) == b"reply"


async def test_receive_respects_max_bytes(pair: Pair) -> None:
    a, b = pair
    await a.send(b"x" * 1000)
    await a.send_eof()
    sizes = []
    while chunk := await b.receive(100):
        sizes.append(len(chunk))
    assert max(sizes) <= 100 and sum(sizes) == 1000


async def test_send_after_eof_fails(pair: Pair) -> None:
    a, _ = pair
    await a.send_eof()
    with pytest.raises(ClosedStreamError):
        await a.send(b"late")


async def test_aclose_is_idempotent_and_use_after_close_fails(pair: Pair) -> None:
    a, _ = pair
    await a.aclose()
    await a.aclose()
    with pytest.raises(ClosedStreamError):
        await a.receive()


async def test_peer_close_is_seen(pair: Pair) -> None:
    a, b = pair
    await a.aclose()
    try:
        assert await asyncio.wait_for(b.receive(), 5) == b""
    except BrokenStreamError:
        pass  # an abrupt end is also a correct report


async def test_connect_refused_maps_to_connect_error() -> None:
    server = await start_server(lambda s: asyncio.sleep(0), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectError) as info:
        await SocketStream.connect("127.0.0.1", port)
    assert info.value.errno is not None


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(stream: SocketStream) -> None:
        while chunk := await stream.receive():
            await stream.send(chunk)
        await stream.send_eof()

    server = await start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_splice_relays_sha256_exact_through_real_sockets() -> None:
    """client <-> relay(splice) <-> echo server, 16 MiB each way."""
    server, echo_port = await echo_server()
    finished: asyncio.Future[SpliceResult] = asyncio.get_running_loop().create_future()

    async def relay(stream: SocketStream) -> None:
        upstream = await SocketStream.connect("127.0.0.1", echo_port)
        finished.set_result(await splice(stream, upstream))

    relay_server = await start_server(relay, "127.0.0.1", 0)
    port = relay_server.sockets[0].getsockname()[1]
    client = await SocketStream.connect("127.0.0.1", port)
    payload = os.urandom(16 * 1024 * 1024)

    async def send() -> None:
        await client.send(payload)
        await client.send_eof()

    task = asyncio.create_task(send())
    got = await asyncio.wait_for(receive_all(client), 60)
    await task
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
    result = await asyncio.wait_for(finished, 10)
    assert result.a_to_b == result.b_to_a == len(payload)
    assert result.error is None
    await client.aclose()
    relay_server.close()
    server.close()
    await relay_server.wait_closed()
    await server.wait_closed()


async def test_splice_grace_bounds_a_half_closed_peer() -> None:
    a, a_peer = memory_stream_pair()
    b, b_peer = memory_stream_pair()
    await a_peer.send_eof()  # one direction ends at once; b_peer never ends its own
    result = await asyncio.wait_for(splice(a, b, grace=0.2), 5)
    assert result.error is None
    assert await b_peer.receive() == b""


async def test_a_consumer_takes_bytes_when_none_wait_and_leaves_the_rest_in_order() -> None:
    a, b = socket.socketpair()
    sender, receiver = await SocketStream.from_socket(a), await SocketStream.from_socket(b)
    taken: list[bytes] = []
    accept = True
    arrived = asyncio.Event()

    def consumer(data: bytes) -> bool:
        arrived.set()
        if accept:
            taken.append(data)
        return accept

    receiver.set_consumer(consumer)
    try:
        await sender.send(b"one")
        await asyncio.wait_for(arrived.wait(), 10)
        assert taken == [b"one"]
        # Declined: the bytes wait for receive(), and later ones queue behind them even though
        # the consumer would take them now.
        accept, arrived = False, asyncio.Event()
        await sender.send(b"two")
        await asyncio.wait_for(arrived.wait(), 10)
        accept = True
        await sender.send(b"three")
        await sender.send_eof()
        # Both buffered before anything is received (the kernel delivers them).
        async with asyncio.timeout(10):
            while receiver._protocol._buffered < len(b"twothree"):  # noqa: ASYNC110 - no event
                await asyncio.sleep(0.01)
        assert await receive_all(receiver) == b"twothree"
        assert taken == [b"one"]
    finally:
        await sender.aclose()
        await receiver.aclose()
