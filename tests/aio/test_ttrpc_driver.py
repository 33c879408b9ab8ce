"""The asyncio ttrpc client and server over real unix sockets: concurrency, deadlines, the Go
server's error statuses, and isolation of a misbehaving connection."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from podgate.aio.streams import SocketStream
from podgate.aio.ttrpc import (
    RequestContext,
    TtrpcClient,
    TtrpcClosedError,
    TtrpcServer,
)
from podgate.proto.ttrpc import MAX_MESSAGE_LENGTH, Code, TtrpcError, envelope_pb2
from podgate.proto.ttrpc.frames import decode_header, decode_response

SERVICE = "test.v1.Echo"
OVERSIZE_MESSAGE = "message length {} exceed maximum message size of 4194304"


@dataclass
class Backend:
    """Handlers for SERVICE, with hooks the tests use to hold and observe calls."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    peak: int = 0
    cancelled: list[str] = field(default_factory=list)
    contexts: list[RequestContext] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # running/cancelled moved

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not condition():
                self.changed.clear()
                await self.changed.wait()

    async def echo(self, payload: bytes, ctx: RequestContext) -> bytes:
        self.contexts.append(ctx)
        return payload

    async def held(self, payload: bytes, ctx: RequestContext) -> bytes:
        """Waits for `gate`; counts how many run at once."""
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.changed.set()
        try:
            await self.gate.wait()
            return b"released:" + payload
        except asyncio.CancelledError:
            self.cancelled.append(payload.decode())
            raise
        finally:
            self.running -= 1
            self.changed.set()

    async def delay(self, payload: bytes, ctx: RequestContext) -> bytes:
        """Sleeps payload-many milliseconds."""
        await asyncio.sleep(int(payload) / 1000)
        return payload

    async def not_found(self, payload: bytes, ctx: RequestContext) -> bytes:
        raise TtrpcError(Code.NOT_FOUND, "no such pod")

    async def boom(self, payload: bytes, ctx: RequestContext) -> bytes:
        raise RuntimeError("boom")

    async def missing_file(self, payload: bytes, ctx: RequestContext) -> bytes:
        raise FileNotFoundError("no such file")

    async def huge(self, payload: bytes, ctx: RequestContext) -> bytes:
        return bytes(MAX_MESSAGE_LENGTH)


@dataclass
class Env:
    path: str
    server: TtrpcServer
    backend: Backend


@pytest.fixture
def socket_dir() -> Iterator[str]:
    # Short on purpose: unix socket paths are limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="ttrpc") as directory:
        yield directory


@pytest.fixture
async def env(socket_dir: str) -> AsyncIterator[Env]:
    backend = Backend()
    server = TtrpcServer(max_concurrent_requests=4)
    server.register(
        SERVICE,
        {
            "Echo": backend.echo,
            "Held": backend.held,
            "Delay": backend.delay,
            "NotFound": backend.not_found,
            "Boom": backend.boom,
            "MissingFile": backend.missing_file,
            "Huge": backend.huge,
        },
    )
    path = str(Path(socket_dir) / "t.sock")
    listener = await server.listen_unix(path)
    try:
        yield Env(path, server, backend)
    finally:
        backend.gate.set()
        listener.close()
        await server.aclose()
        await listener.wait_closed()


@pytest.fixture
async def client(env: Env) -> AsyncIterator[TtrpcClient]:
    client = await TtrpcClient.connect_unix(env.path)
    try:
        yield client
    finally:
        await client.aclose()


# --- raw peers, for what a well-behaved client cannot send
def frame(stream_id: int, kind: int, body: bytes, flags: int = 0) -> bytes:
    return len(body).to_bytes(4, "big") + stream_id.to_bytes(4, "big") + bytes([kind, flags]) + body


def request(stream_id: int, method: str, payload: bytes = b"", timeout_nano: int = 0) -> bytes:
    body = envelope_pb2.Request(
        service=SERVICE, method=method, payload=payload, timeout_nano=timeout_nano
    ).SerializeToString()
    return frame(stream_id, 1, body)


async def read_responses(stream: SocketStream, count: int) -> list[tuple[int, int, str, bytes]]:
    """(stream id, code, message, payload) of the next `count` Response frames."""
    buffer = b""
    out: list[tuple[int, int, str, bytes]] = []
    async with asyncio.timeout(10):
        while len(out) < count:
            while len(buffer) >= 10 and len(buffer) >= 10 + decode_header(buffer).length:
                head = decode_header(buffer)
                assert head.type == 2
                body = buffer[10 : 10 + head.length]
                buffer = buffer[10 + head.length :]
                reply = decode_response(body)
                out.append((head.stream_id, reply.code, reply.message, reply.payload))
            if len(out) >= count:
                break
            chunk = await stream.receive()
            assert chunk, "connection closed early"
            buffer += chunk
    return out


# --- calls
async def test_echo_round_trip(client: TtrpcClient, env: Env) -> None:
    assert await client.call(SERVICE, "Echo", b"hello") == b"hello"
    assert await client.call(SERVICE, "Echo", b"") == b""
    assert [ctx.stream_id for ctx in env.backend.contexts] == [1, 3]


async def test_metadata_and_timeout_reach_the_handler(client: TtrpcClient, env: Env) -> None:
    await client.call(SERVICE, "Echo", b"x", timeout=2.5, metadata=[("X-Req", "7")])
    [ctx] = env.backend.contexts
    assert (ctx.service, ctx.method) == (SERVICE, "Echo")
    assert ctx.metadata == (("x-req", "7"),)
    assert ctx.timeout == pytest.approx(2.5)


async def test_concurrent_calls_are_multiplexed(client: TtrpcClient) -> None:
    # Later calls finish first; every caller still gets its own reply.
    delays = [b"%d" % (60 - 10 * i) for i in range(6)]
    results = await asyncio.gather(*(client.call(SERVICE, "Delay", d) for d in delays))
    assert results == delays


async def test_slow_call_does_not_block_others(client: TtrpcClient, env: Env) -> None:
    slow = asyncio.create_task(client.call(SERVICE, "Held", b"slow"))
    await asyncio.sleep(0.05)
    assert await client.call(SERVICE, "Echo", b"fast") == b"fast"
    assert not slow.done()
    env.backend.gate.set()
    assert await slow == b"released:slow"


async def test_client_timeout_is_deadline_exceeded(client: TtrpcClient, env: Env) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TtrpcError) as info:
        await client.call(SERVICE, "Held", b"t", timeout=0.2)
    assert loop.time() - started < 2
    assert (info.value.code, info.value.message) == (4, "context deadline exceeded")
    # The server got the same deadline and gave up on the handler too.
    await env.backend.until(lambda: env.backend.cancelled == ["t"])
    assert await client.call(SERVICE, "Echo", b"still fine") == b"still fine"


async def test_server_enforces_timeout_nano(env: Env) -> None:
    # A raw client that does not time out by itself: the answer must come from the server.
    stream = await SocketStream.connect_unix(env.path)
    try:
        await stream.send(request(1, "Held", b"x", timeout_nano=100_000_000))
        [(sid, code, message, payload)] = await read_responses(stream, 1)
        assert (sid, code, message, payload) == (1, 4, "context deadline exceeded", b"")
        assert env.backend.cancelled == ["x"]
    finally:
        await stream.aclose()


async def test_handler_errors_become_statuses(client: TtrpcClient) -> None:
    cases = {
        "NotFound": (Code.NOT_FOUND, "no such pod"),
        "Boom": (Code.UNKNOWN, "boom"),
        "MissingFile": (Code.NOT_FOUND, "no such file"),
    }
    for method, (code, message) in cases.items():
        with pytest.raises(TtrpcError) as info:
            await client.call(SERVICE, method)
        assert (info.value.code, info.value.message) == (code, message)


async def test_unknown_service_and_method(client: TtrpcClient) -> None:
    with pytest.raises(TtrpcError) as info:
        await client.call("nope.v1.Missing", "Echo")
    assert (info.value.code, info.value.message) == (12, "service nope.v1.Missing")
    with pytest.raises(TtrpcError) as info:
        await client.call(SERVICE, "Nope")
    assert (info.value.code, info.value.message) == (12, "method Nope")


async def test_oversized_reply_becomes_resource_exhausted(client: TtrpcClient) -> None:
    with pytest.raises(TtrpcError) as info:
        await client.call(SERVICE, "Huge")
    # payload tag (1 byte) + length varint (4 bytes) + 4 MiB
    assert (info.value.code, info.value.message) == (
        8,
        OVERSIZE_MESSAGE.format(MAX_MESSAGE_LENGTH + 5),
    )
    assert await client.call(SERVICE, "Echo", b"ok") == b"ok"


async def test_client_refuses_oversized_request(client: TtrpcClient) -> None:
    with pytest.raises(TtrpcError) as info:
        await client.call(SERVICE, "Echo", bytes(MAX_MESSAGE_LENGTH))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert info.value.message.startswith("message length ")
    assert await client.call(SERVICE, "Echo", b"ok") == b"ok"


# --- stream-level faults from a raw peer
async def test_oversized_request_fails_only_its_stream(env: Env) -> None:
    stream = await SocketStream.connect_unix(env.path)
    try:
        await stream.send(request(1, "Held", b"first"))  # in flight the whole time
        size = 5 * 1024 * 1024
        await stream.send(size.to_bytes(4, "big") + (3).to_bytes(4, "big") + b"\x01\x00")
        chunk = bytes(256 * 1024)
        for _ in range(size // len(chunk)):
            await stream.send(chunk)
        await stream.send(request(5, "Echo", b"normal"))
        replies = await read_responses(stream, 2)
        assert sorted(replies) == [
            (3, 8, OVERSIZE_MESSAGE.format(size), b""),
            (5, 0, "", b"normal"),
        ]
        env.backend.gate.set()
        assert await read_responses(stream, 1) == [(1, 0, "", b"released:first")]
    finally:
        await stream.aclose()


async def test_even_stream_id_is_rejected(env: Env) -> None:
    stream = await SocketStream.connect_unix(env.path)
    try:
        await stream.send(request(2, "Echo", b"x"))
        assert await read_responses(stream, 1) == [
            (2, 3, "StreamID must be odd for client initiated streams", b"")
        ]
        await stream.send(request(1, "Echo", b"y"))
        assert await read_responses(stream, 1) == [(1, 0, "", b"y")]
    finally:
        await stream.aclose()


async def test_reused_stream_id_is_rejected(env: Env) -> None:
    stream = await SocketStream.connect_unix(env.path)
    try:
        await stream.send(request(3, "Echo", b"a"))
        assert await read_responses(stream, 1) == [(3, 0, "", b"a")]
        await stream.send(request(1, "Echo", b"b"))
        assert await read_responses(stream, 1) == [
            (1, 3, "StreamID cannot be re-used and must increment", b"")
        ]
    finally:
        await stream.aclose()


# --- connection-level faults stay on their connection
async def test_garbage_closes_only_that_connection(env: Env, client: TtrpcClient) -> None:
    in_flight = asyncio.create_task(client.call(SERVICE, "Held", b"good"))
    bad = await SocketStream.connect_unix(env.path)
    try:
        await bad.send(request(1, "Held", b"bad"))
        await asyncio.sleep(0.05)
        await bad.send(b"\xff" * 10)  # a length with the reserved byte set
        async with asyncio.timeout(5):
            while await bad.receive():
                pass  # the server closes the connection: EOF
        # The bad connection's handler was cancelled; the good one is untouched.
        await env.backend.until(lambda: env.backend.cancelled == ["bad"])
        assert not in_flight.done()
        assert await client.call(SERVICE, "Echo", b"next") == b"next"
        other = await TtrpcClient.connect_unix(env.path)
        async with other:
            assert await other.call(SERVICE, "Echo", b"new") == b"new"
        env.backend.gate.set()
        assert await in_flight == b"released:good"
    finally:
        await bad.aclose()


async def test_peer_closing_fails_pending_calls(env: Env, socket_dir: str) -> None:
    # A server that reads one request and hangs up.
    path = str(Path(socket_dir) / "hangup.sock")
    got_request = asyncio.Event()

    async def hang_up(stream: SocketStream) -> None:
        await stream.receive()
        got_request.set()

    from podgate.aio.streams import start_unix_server

    listener = await start_unix_server(hang_up, path)
    try:
        client = await TtrpcClient.connect_unix(path)
        with pytest.raises(TtrpcClosedError) as info:
            await client.call(SERVICE, "Echo", b"x", timeout=5)
        assert info.value.code == Code.UNAVAILABLE
        assert got_request.is_set()
        assert client.closed
        with pytest.raises(TtrpcClosedError):
            await client.call(SERVICE, "Echo")
        await client.aclose()
    finally:
        listener.close()
        await listener.wait_closed()


async def test_aclose_fails_pending_calls(env: Env) -> None:
    client = await TtrpcClient.connect_unix(env.path)
    pending = asyncio.create_task(client.call(SERVICE, "Held", b"p"))
    await asyncio.sleep(0.05)
    await client.aclose()
    with pytest.raises(TtrpcClosedError):
        await pending
    with pytest.raises(TtrpcClosedError):
        await client.call(SERVICE, "Echo")


async def test_concurrency_limit_pauses_reading(env: Env, client: TtrpcClient) -> None:
    # The server allows 4 running requests per connection; the rest wait, unread.
    calls = [asyncio.create_task(client.call(SERVICE, "Held", b"%d" % i)) for i in range(7)]
    await env.backend.until(lambda: env.backend.running == 4)
    await asyncio.sleep(0.1)
    assert env.backend.running == 4
    env.backend.gate.set()
    results = await asyncio.gather(*calls)
    assert results == [b"released:%d" % i for i in range(7)]
    assert env.backend.peak == 4


async def test_server_aclose_closes_connections(env: Env, client: TtrpcClient) -> None:
    pending = asyncio.create_task(client.call(SERVICE, "Held", b"s"))
    await asyncio.sleep(0.05)
    await env.server.aclose()
    with pytest.raises(TtrpcClosedError):
        await pending
    assert env.backend.cancelled == ["s"]


def test_duplicate_service_registration() -> None:
    server = TtrpcServer()
    server.register("a.B", {})
    with pytest.raises(ValueError, match=r"^duplicate service a\.B registered$"):
        server.register("a.B", {})
