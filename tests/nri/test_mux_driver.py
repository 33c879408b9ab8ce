"""The asyncio NRI mux over real socketpairs: ttrpc in both directions at once, the frames a Go
peer needs, unopened and closed connections, and the faults that end a trunk (and only it)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from podgate.aio.errors import BrokenStreamError, ClosedStreamError
from podgate.aio.nrimux import READ_QUEUE_FRAMES, Mux
from podgate.aio.streams import SocketStream
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcServer
from podgate.proto.nrimux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from podgate.proto.ttrpc import envelope_pb2

SERVICE = "test.v1.Digest"


async def digest(payload: bytes, ctx: RequestContext) -> bytes:
    return hashlib.sha256(payload).digest()


async def expand(payload: bytes, ctx: RequestContext) -> bytes:
    """Replies with int(payload) bytes."""
    return bytes([0x61]) * int(payload)


async def stream_pair() -> tuple[SocketStream, SocketStream]:
    left, right = socket.socketpair()
    return await SocketStream.from_socket(left), await SocketStream.from_socket(right)


def frame(conn_id: int, payload: bytes) -> bytes:
    return conn_id.to_bytes(4, "big") + len(payload).to_bytes(4, "big") + payload


def ttrpc_request(stream_id: int, method: str, payload: bytes) -> bytes:
    body = envelope_pb2.Request(service=SERVICE, method=method, payload=payload)
    data = body.SerializeToString()
    return len(data).to_bytes(4, "big") + stream_id.to_bytes(4, "big") + b"\x01\x00" + data


async def read_frames(stream: SocketStream, count: int) -> list[tuple[int, bytes]]:
    buffer = b""
    out: list[tuple[int, bytes]] = []
    async with asyncio.timeout(5):
        while len(out) < count:
            while len(buffer) >= 8 and len(buffer) >= 8 + int.from_bytes(buffer[4:8], "big"):
                length = int.from_bytes(buffer[4:8], "big")
                out.append((int.from_bytes(buffer[:4], "big"), buffer[8 : 8 + length]))
                buffer = buffer[8 + length :]
            if len(out) >= count:
                break
            chunk = await stream.receive()
            assert chunk, "trunk closed early"
            buffer += chunk
    return out


async def read_until_eof(stream: SocketStream) -> bytes:
    data = b""
    async with asyncio.timeout(5):
        while chunk := await stream.receive():
            data += chunk
    return data


@dataclass
class Pair:
    """Two muxes over one socketpair; each side serves one connection and calls the other."""

    plugin: Mux
    runtime: Mux
    servers: list[TtrpcServer]
    tasks: list[asyncio.Task[None]]


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    plugin_stream, runtime_stream = await stream_pair()
    plugin, runtime = Mux(plugin_stream, name="plugin"), Mux(runtime_stream, name="runtime")
    servers = []
    tasks = []
    for mux, served in ((plugin, PLUGIN_SERVICE_CONN), (runtime, RUNTIME_SERVICE_CONN)):
        server = TtrpcServer(name=f"{mux.name} server")
        server.register(SERVICE, {"Digest": digest, "Expand": expand})
        servers.append(server)
        tasks.append(asyncio.create_task(server.serve(mux.conn(served))))
        mux.start()
    try:
        yield Pair(plugin, runtime, servers, tasks)
    finally:
        for mux in (plugin, runtime):
            await mux.aclose()
        for server in servers:
            await server.aclose()
        await asyncio.wait(tasks, timeout=5)


async def test_ttrpc_both_ways_concurrently(pair: Pair) -> None:
    # The runtime calls the plugin on conn 1 while the plugin calls the runtime on conn 2.
    to_plugin = TtrpcClient(pair.runtime.conn(PLUGIN_SERVICE_CONN), name="to plugin")
    to_runtime = TtrpcClient(pair.plugin.conn(RUNTIME_SERVICE_CONN), name="to runtime")
    payloads = [bytes([i]) * size for i, size in enumerate([0, 1, 4086, 4087, 70_000, 1 << 20])]
    try:
        async with asyncio.timeout(10):
            results = await asyncio.gather(
                *(to_plugin.call(SERVICE, "Digest", p) for p in payloads),
                *(to_runtime.call(SERVICE, "Digest", p) for p in payloads),
            )
        expected = [hashlib.sha256(p).digest() for p in payloads]
        assert results == expected + expected
    finally:
        await to_plugin.aclose()
        await to_runtime.aclose()


async def test_large_reply_frames_follow_the_go_rule() -> None:
    # A raw peer sees how our mux frames a 10,000-byte reply: 4096 bytes first, then the rest.
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    server = TtrpcServer()
    server.register(SERVICE, {"Expand": expand})
    serving = asyncio.create_task(server.serve(mux.conn(PLUGIN_SERVICE_CONN)))
    mux.start()
    try:
        raw.write(frame(PLUGIN_SERVICE_CONN, ttrpc_request(1, "Expand", b"10000")))
        frames = await read_frames(raw, 2)
        assert [conn for conn, _ in frames] == [1, 1]
        assert len(frames[0][1]) == 4096
        reply = frames[0][1] + frames[1][1]
        length = int.from_bytes(reply[:4], "big")
        assert reply[4:10] == bytes.fromhex("00000001 02 00")
        assert len(reply) == 10 + length
        response = envelope_pb2.Response.FromString(reply[10:])
        assert response.payload == b"a" * 10_000
    finally:
        await mux.aclose()
        await server.aclose()
        await asyncio.wait([serving], timeout=5)
        await raw.aclose()


async def test_frames_for_unopened_connections_are_dropped() -> None:
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    conn = mux.conn(7)
    mux.start()
    try:
        raw.write(frame(9, b"nobody") + frame(7, b"one") + frame(8, b"x") + frame(7, b"two"))
        received = b""
        async with asyncio.timeout(5):
            while len(received) < 6:
                received += await conn.receive()
        assert received == b"onetwo"
        assert not mux.closed.is_set()
    finally:
        await mux.aclose()
        await raw.aclose()


async def test_a_full_queue_is_fine_one_more_frame_kills_the_trunk() -> None:
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    slow = mux.conn(5)  # opened, never read until the end
    other = mux.conn(6)
    mux.start()
    try:
        raw.write(b"".join(frame(5, b"%03d" % i) for i in range(READ_QUEUE_FRAMES)))
        raw.write(frame(6, b"ping"))
        async with asyncio.timeout(5):
            assert await other.receive() == b"ping"
        assert not mux.closed.is_set()
        raw.write(frame(5, b"over"))
        async with asyncio.timeout(5):
            await mux.closed.wait()
        assert mux.error is not None
        assert "failed to queue payload for reading" in mux.error
        assert await read_until_eof(raw) == b""  # the peer sees the trunk close
        # What was queued is still readable; then the failure shows.
        queued = await slow.receive(max_bytes=1 << 20)
        assert queued == b"".join(b"%03d" % i for i in range(READ_QUEUE_FRAMES))
        with pytest.raises(BrokenStreamError):
            await slow.receive()
        with pytest.raises(BrokenStreamError):
            await other.receive()
        with pytest.raises(BrokenStreamError):
            other.write(b"x")
    finally:
        await mux.aclose()
        await raw.aclose()


@pytest.mark.parametrize(
    "garbage",
    [
        frame(0, b"reserved"),  # ConnID 0
        (1).to_bytes(4, "big") + (4 * 1024 * 1024 + 11).to_bytes(4, "big"),  # oversize
    ],
    ids=["conn-0", "oversize"],
)
async def test_garbage_closes_only_that_trunk(pair: Pair, garbage: bytes) -> None:
    ours, raw = await stream_pair()
    victim = Mux(ours, name="victim")
    victim_conn = victim.conn(PLUGIN_SERVICE_CONN)
    victim.start()
    client = TtrpcClient(pair.runtime.conn(PLUGIN_SERVICE_CONN))
    try:
        raw.write(garbage)
        async with asyncio.timeout(5):
            await victim.closed.wait()
        assert victim.error is not None
        with pytest.raises(BrokenStreamError):
            await victim_conn.receive()
        assert await read_until_eof(raw) == b""
        # The other trunk is untouched.
        async with asyncio.timeout(5):
            assert await client.call(SERVICE, "Digest", b"x") == hashlib.sha256(b"x").digest()
        assert not pair.plugin.closed.is_set()
    finally:
        await client.aclose()
        await victim.aclose()
        await raw.aclose()


async def test_closing_one_connection_leaves_the_others(pair: Pair) -> None:
    conn = pair.runtime.conn(9)
    await conn.aclose()
    with pytest.raises(ClosedStreamError):
        await conn.receive()
    with pytest.raises(ClosedStreamError):
        conn.write(b"x")
    # The trunk still carries ttrpc on conn 1, and conn 9 can be opened afresh.
    client = TtrpcClient(pair.runtime.conn(PLUGIN_SERVICE_CONN))
    try:
        async with asyncio.timeout(5):
            assert await client.call(SERVICE, "Digest", b"") == hashlib.sha256(b"").digest()
    finally:
        await client.aclose()
    assert pair.runtime.conn(9) is not conn
    assert not pair.runtime.closed.is_set()


async def test_peer_eof_ends_every_connection_cleanly() -> None:
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    conn = mux.conn(1)
    mux.start()
    try:
        raw.write(frame(1, b"last words"))
        await raw.send_eof()
        async with asyncio.timeout(5):
            assert await conn.receive() == b"last words"
            assert await conn.receive() == b""
            await mux.closed.wait()
        assert mux.error is None
    finally:
        await mux.aclose()
        await raw.aclose()


async def test_eof_inside_a_frame_is_a_failure() -> None:
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    conn = mux.conn(1)
    mux.start()
    try:
        raw.write(frame(1, b"abcdef")[:-2])
        await raw.send_eof()
        async with asyncio.timeout(5):
            await mux.closed.wait()
            with pytest.raises(BrokenStreamError):
                await conn.receive()
        assert mux.error is not None
    finally:
        await mux.aclose()
        await raw.aclose()


async def test_aclose_ends_readers_and_the_peer_sees_eof() -> None:
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    conn = mux.conn(2)
    mux.start()
    waiting = asyncio.create_task(conn.receive())
    await asyncio.sleep(0)
    await mux.aclose()
    async with asyncio.timeout(5):
        assert await waiting == b""
    assert mux.closed.is_set()
    assert mux.error is None
    with pytest.raises(BrokenStreamError):
        conn.write(b"x")
    assert await read_until_eof(raw) == b""
    await mux.aclose()  # idempotent
    await raw.aclose()


async def test_run_in_own_task_and_write_order() -> None:
    # Interleaved writes on two connections reach the trunk in call order, whole.
    ours, raw = await stream_pair()
    mux = Mux(ours, name="ours")
    one, two = mux.conn(1), mux.conn(2)
    reader = asyncio.create_task(mux.run())
    try:
        message_a = (3).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01\x00abc"
        message_b = (2).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x02\x00xy"
        one.write(message_a[:5])  # buffered: not a whole message yet
        two.write(message_b)
        one.writelines([message_a[5:], message_a])
        await one.drain()
        frames = await read_frames(raw, 3)
        assert frames == [(2, message_b), (1, message_a), (1, message_a)]
    finally:
        await mux.aclose()
        await asyncio.wait([reader], timeout=5)
        await raw.aclose()
    assert reader.done() and reader.exception() is None
