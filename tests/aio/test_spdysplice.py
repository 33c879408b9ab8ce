"""SPDY DATA payloads spliced in the kernel (podgate.aio.spdysplice), over real sockets, on
asyncio's loop and on uvloop: a client SpdySession (or hand-made frames on a raw socket) →
a server SpdySession with `kernel_splice` → splice_forward → a pod server on TCP or a unix
socket. Every transfer is checked by sha256, and the session's spliced-byte counters show the
payload went around Python. Also: flow control (the podgate peer), several streams and PINGs
interleaved, frames split across reads, a pod that closes or resets mid-frame, a client that
dies mid-frame, RST_STREAM mid-transfer, and the copy fallback for a pod stream that is not a
plain socket."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import socket
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvloop

from podgate.aio.errors import (
    BrokenStreamError,
    ForwardError,
    StalledStreamError,
    StreamError,
    StreamResetError,
)
from podgate.aio.spdy import STALLED_STREAM_RESET_SECONDS, SpdySession, SpdyStream
from podgate.aio.spdysplice import KernelSpliceable, PodSocket, splice_forward
from podgate.aio.splice import SpliceResult
from podgate.aio.streams import Buffer, ByteStream, SocketStream, start_server, start_unix_server
from podgate.proto.spdy import (
    DataReceived,
    Event,
    GoAwayReceived,
    GoAwayStatus,
    PingAcknowledged,
    Role,
    SpdyConnection,
)
from podgate.streaming.hooks import ThrottledStream

MIB = 1024 * 1024
TRANSFER_BYTES = 24 * MIB + 4321
CHUNK_BYTES = 256 * 1024
# A hung transfer fails the test instead of hanging it.
TIMEOUT_SECONDS = 60.0
WINDOW_BYTES = 1 * MIB  # flow control on: several WINDOW_UPDATEs per transfer
# Far above the control-frame burst (podgate.aio.spdy.CONTROL_FRAME_BURST).
FLOOD_PINGS = 20_000


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_name(request: pytest.FixtureRequest) -> str:
    """Each test runs on asyncio's loop and on uvloop (which refuses add_reader on a
    descriptor its transport owns, so the splices must work on duplicates)."""
    return str(request.param)


def run_on(loop_name: str, main: Awaitable[None]) -> None:
    async def wrapped() -> None:
        await main

    if loop_name == "uvloop":
        uvloop.run(wrapped())
    else:
        asyncio.run(wrapped())


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def open_raw(state: Rig) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if isinstance(state.address, str):
        return await asyncio.open_unix_connection(state.address)
    return await asyncio.open_connection(*state.address)


async def until(condition: Callable[[], bool]) -> None:
    """Poll (every 10 ms, within TIMEOUT_SECONDS) until `condition` holds."""
    for _ in range(int(TIMEOUT_SECONDS * 100)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PodHandler = Callable[[SocketStream], Awaitable[None]]


async def echo(conn: SocketStream) -> None:
    with contextlib.suppress(StreamError):  # a forward that fails resets the pod's end
        while chunk := await conn.receive():
            await conn.send(chunk)
        await conn.send_eof()


@dataclass
class Rig:
    """A pod server, a SPDY server forwarding each stream to it, and what they saw."""

    address: tuple[str, int] | str  # the SPDY server: TCP, or a unix socket's path
    sessions: list[SpdySession] = field(default_factory=list)
    results: list[SpliceResult] = field(default_factory=list)
    pod_received: list[bytes] = field(default_factory=list)
    forwards: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def session(self) -> SpdySession:
        (session,) = self.sessions
        return session

    async def forwards_done(self) -> None:
        async with asyncio.timeout(TIMEOUT_SECONDS):
            while self.forwards:
                await asyncio.gather(*self.forwards, return_exceptions=True)


@contextlib.asynccontextmanager
async def rig(
    pod: PodHandler = echo,
    *,
    window: int | None = None,
    unix_pod: bool = False,
    unix_session: bool = False,
    kernel_splice: bool = True,
    stalled_reset_seconds: float = STALLED_STREAM_RESET_SECONDS,
    wrap: Callable[[ByteStream], ByteStream] = lambda s: s,
) -> AsyncIterator[Rig]:
    with tempfile.TemporaryDirectory() as tmp:
        pod_path = str(Path(tmp) / "pod.sock")
        if unix_pod:
            pod_server = await start_unix_server(pod, pod_path)
        else:
            pod_server = await start_server(pod, "127.0.0.1", 0)
        pod_port = pod_server.sockets[0].getsockname()[1] if not unix_pod else 0

        async def dial() -> SocketStream:
            if unix_pod:
                return await SocketStream.connect_unix(pod_path)
            return await SocketStream.connect("127.0.0.1", pod_port)

        state: Rig

        async def forward(stream: SpdyStream) -> None:
            upstream = await dial()
            state.results.append(await splice_forward(stream, stream, wrap(upstream)))

        async def serve(conn: SocketStream) -> None:
            def on_stream(stream: SpdyStream) -> None:
                stream.accept()
                task = asyncio.create_task(forward(stream))
                state.forwards.add(task)
                task.add_done_callback(state.forwards.discard)

            session = SpdySession(
                conn,
                Role.SERVER,
                on_stream=on_stream,
                flow_control_window=window,
                kernel_splice=kernel_splice,
                stalled_reset_seconds=stalled_reset_seconds,
            )
            state.sessions.append(session)
            try:
                await session.run()
            finally:
                await session.aclose()

        if unix_session:
            session_path = str(Path(tmp) / "spdy.sock")
            server = await start_unix_server(serve, session_path)
            state = Rig(session_path)
        else:
            server = await start_server(serve, "127.0.0.1", 0)
            state = Rig(server.sockets[0].getsockname()[:2])
        try:
            yield state
        finally:
            for task in list(state.forwards):
                task.cancel()
            await asyncio.gather(*state.forwards, return_exceptions=True)
            server.close()
            pod_server.close()


@contextlib.asynccontextmanager
async def client(state: Rig, window: int | None = None) -> AsyncIterator[SpdySession]:
    if isinstance(state.address, str):
        conn = await SocketStream.connect_unix(state.address)
    else:
        conn = await SocketStream.connect(*state.address)
    session = SpdySession(conn, Role.CLIENT, flow_control_window=window)
    reader = asyncio.create_task(session.run())
    try:
        yield session
    finally:
        await session.aclose()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def send_all(stream: ByteStream, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        await stream.send(view[offset : offset + CHUNK_BYTES])
    await stream.send_eof()


async def receive_all(stream: ByteStream) -> bytes:
    parts = []
    while chunk := await stream.receive():
        parts.append(chunk)
    return b"".join(parts)


async def echo_through(session: SpdySession, seed: int, size: int = TRANSFER_BYTES) -> None:
    data = pattern(seed, size)
    stream = await session.open_stream({"port": "1"})
    sending = asyncio.create_task(send_all(stream, data))
    received = await receive_all(stream)
    await sending
    assert len(received) == size
    assert sha(received) == sha(data)
    await stream.aclose()


@pytest.mark.parametrize(
    ("unix_session", "unix_pod"),
    [(False, False), (False, True), (True, False)],
    ids=["tcp-tcp", "tcp-unix", "unix-tcp"],
)
@pytest.mark.parametrize("window", [None, WINDOW_BYTES], ids=["no-flow-control", "flow-control"])
def test_payload_goes_around_python_both_ways(
    loop_name: str, unix_session: bool, unix_pod: bool, window: int | None
) -> None:
    run_on(loop_name, _payload_goes_around_python_both_ways(unix_session, unix_pod, window))


async def _payload_goes_around_python_both_ways(
    unix_session: bool, unix_pod: bool, window: int | None
) -> None:
    async with (
        rig(window=window, unix_pod=unix_pod, unix_session=unix_session) as state,
        client(state, window) as session,
    ):
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await echo_through(session, 1)
        await state.forwards_done()
        server = state.session
        (result,) = state.results
        assert result.error is None
        assert (result.a_to_b, result.b_to_a) == (TRANSFER_BYTES, TRANSFER_BYTES)
        # Much of the payload never entered Python on the server, either way: only the part of
        # a frame that came with its header, and what a busy socket did not take at once
        # (most with a unix pod's small buffer), did. How much depends on the machine's load.
        assert server.spliced_bytes_received > TRANSFER_BYTES // 8
        assert server.spliced_bytes_sent > TRANSFER_BYTES // 8


def test_several_streams_and_pings_interleave(loop_name: str) -> None:
    run_on(loop_name, _several_streams_and_pings_interleave())


async def _several_streams_and_pings_interleave() -> None:
    async with rig() as state, client(state) as session:
        pinging = True

        async def pings() -> int:
            count = 0
            while pinging:
                await session.ping()
                count += 1
                await asyncio.sleep(0.005)
            return count

        pinger = asyncio.create_task(pings())
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await asyncio.gather(
                *(echo_through(session, seed, 6 * MIB + seed) for seed in range(4))
            )
        pinging = False
        assert await pinger > 0
        await state.forwards_done()
        assert all(r.error is None for r in state.results)
        assert state.session.spliced_bytes_received > 4 * 6 * MIB // 8
        assert state.session.spliced_bytes_sent > 4 * 6 * MIB // 8


def test_frames_split_across_reads_with_control_frames_between(loop_name: str) -> None:
    run_on(loop_name, _frames_split_across_reads_with_control_frames_between())


async def _frames_split_across_reads_with_control_frames_between() -> None:
    """Hand-made frames on a raw socket, written in odd pieces with pauses: a header cut in
    two, PINGs between DATA frames, FIN on an empty last frame. The pod gets every byte."""
    done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def sink(conn: SocketStream) -> None:
        data = await receive_all(conn)
        done.set_result(data)
        await conn.send(b"ok")
        await conn.send_eof()

    async with rig(sink) as state:
        core = SpdyConnection(Role.CLIENT)
        sid = core.open_stream({"port": "1"})
        data = pattern(7, 3 * MIB + 17)
        rng = random.Random(3)
        offset = 0
        while offset < len(data):
            size = rng.choice([1, 9, 4095, 70_000, 300_000, 1_200_000])
            core.send_data(sid, data[offset : offset + size])
            offset += size
            core.ping()
        core.end_stream(sid)
        wire = core.data_to_send()
        reader, writer = await open_raw(state)
        async with asyncio.timeout(TIMEOUT_SECONDS):
            pos = 0
            while pos < len(wire):
                step = rng.choice([3, 5, 8, 13, 1000, 65_536, 500_000])
                writer.write(wire[pos : pos + step])
                await writer.drain()
                pos += step
                if rng.random() < 0.1:
                    await asyncio.sleep(0.002)  # let the server read a partial frame
            received = await done
            # The reply: SYN_REPLY, PING echoes, DATA "ok" and FIN.
            events: list[Event] = []
            while not any(isinstance(e, DataReceived) and e.fin for e in events):
                chunk = await reader.read(65_536)
                assert chunk, "connection closed before the reply ended"
                events += core.receive_data(chunk)
        assert sha(received) == sha(data)
        assert b"".join(e.data for e in events if isinstance(e, DataReceived)) == b"ok"
        assert state.session.spliced_bytes_received > len(data) // 8
        writer.close()
        await state.forwards_done()
        assert state.results[0].error is None
        assert state.results[0].a_to_b == len(data)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_pod_that_ends_mid_frame_resets_the_stream_and_the_session_lives(
    loop_name: str, how: str
) -> None:
    run_on(loop_name, _pod_that_ends_mid_frame_resets_the_stream_and_the_session_lives(how))


async def _pod_that_ends_mid_frame_resets_the_stream_and_the_session_lives(how: str) -> None:
    connections = 0

    async def quits_first(conn: SocketStream) -> None:
        nonlocal connections
        connections += 1
        if connections > 1:
            await echo(conn)
            return
        got = 0
        while got < 3 * MIB:
            chunk = await conn.receive()
            if not chunk:
                return
            got += len(chunk)
        if how == "reset":
            sock = conn.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.abort()
        else:
            await conn.aclose()

    async with rig(quits_first) as state, client(state) as session:
        stream = await session.open_stream({"port": "1"})
        data = pattern(5, 8 * MIB)  # one send: 32 frames, the pod ends inside one of them

        async def send_forever() -> None:
            with contextlib.suppress(StreamError):
                while True:
                    await stream.send(data)

        # The forward ends with the pod's error (the client was sent FIN already, when the
        # pod's end closed: no RST_STREAM after FIN, as spdystream).
        sending = asyncio.create_task(send_forever())
        try:
            await state.forwards_done()
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        await stream.aclose()
        assert state.results[0].error is not None
        assert state.session.spliced_bytes_received > 0
        # The session lives on: the next stream is forwarded (and spliced) as before.
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await echo_through(session, 3, 4 * MIB)
        assert state.session.broken is None


def test_client_dying_mid_frame_ends_the_forward(loop_name: str) -> None:
    run_on(loop_name, _client_dying_mid_frame_ends_the_forward())


async def _client_dying_mid_frame_ends_the_forward() -> None:
    closed: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def counts(conn: SocketStream) -> None:
        got = 0
        with contextlib.suppress(StreamError):
            while chunk := await conn.receive():
                got += len(chunk)
        closed.set_result(got)

    async with rig(counts) as state:
        core = SpdyConnection(Role.CLIENT)
        sid = core.open_stream({"port": "1"})
        _, writer = await open_raw(state)
        writer.write(core.data_to_send())
        # A DATA header for 4 MiB, then only half of the payload, then the client is gone.
        writer.write(struct.pack(">II", sid, 4 * MIB))
        writer.write(pattern(9, 2 * MIB))
        await writer.drain()
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await until(lambda: state.session.spliced_bytes_received > 0)
            writer.close()
            got = await closed
            await state.forwards_done()
        assert got == 2 * MIB
        assert state.results[0].error is not None
        assert state.session.broken is not None


def test_reset_mid_transfer_closes_the_pod_connection(loop_name: str) -> None:
    run_on(loop_name, _reset_mid_transfer_closes_the_pod_connection())


async def _reset_mid_transfer_closes_the_pod_connection() -> None:
    closed: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def counts(conn: SocketStream) -> None:
        got = 0
        with contextlib.suppress(StreamError):
            while chunk := await conn.receive():
                got += len(chunk)
        closed.set_result(got)

    async with rig(counts) as state, client(state) as session:
        stream = await session.open_stream({"port": "1"})
        await stream.send(pattern(2, 4 * MIB))
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await until(lambda: state.session.spliced_bytes_received >= MIB)
            stream.reset()
            await closed
            await state.forwards_done()
        assert isinstance(state.results[0].error, StreamResetError)
        assert state.session.broken is None


def test_a_wrapped_pod_stream_is_copied_not_spliced(loop_name: str) -> None:
    run_on(loop_name, _a_wrapped_pod_stream_is_copied_not_spliced())


async def _a_wrapped_pod_stream_is_copied_not_spliced() -> None:
    """A hook that wraps the pod's stream (a rate limit) sees every byte: no splice."""
    async with (
        rig(wrap=lambda s: ThrottledStream(s, 1e12)) as state,
        client(state) as session,
    ):
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await echo_through(session, 4, 2 * MIB)
        await state.forwards_done()
        assert (state.results[0].a_to_b, state.results[0].b_to_a) == (2 * MIB, 2 * MIB)
        assert state.session.spliced_bytes_received == 0
        assert state.session.spliced_bytes_sent == 0


def test_slow_pod_falls_back_to_the_queue_and_back(loop_name: str) -> None:
    run_on(loop_name, _slow_pod_falls_back_to_the_queue_and_back())


async def _slow_pod_falls_back_to_the_queue_and_back() -> None:
    """A pod that reads slowly at first: payload queues the usual way, then splices again."""

    async def slow_then_fast(conn: SocketStream) -> None:
        parts = []
        for _ in range(20):
            parts.append(await conn.receive(64 * 1024))
            await asyncio.sleep(0.01)
        while chunk := await conn.receive():
            parts.append(chunk)
        await conn.send(hashlib.sha256(b"".join(parts)).hexdigest().encode())
        await conn.send_eof()

    async with rig(slow_then_fast) as state, client(state) as session:
        data = pattern(11, TRANSFER_BYTES)
        stream = await session.open_stream({"port": "1"})
        async with asyncio.timeout(TIMEOUT_SECONDS):
            await send_all(stream, data)
            answer = await receive_all(stream)
        assert answer.decode() == sha(data)
        assert state.session.spliced_bytes_received > 0


class AgentLike(ByteStream, KernelSpliceable):
    """A pod stream over a socket with bytes of its own first and an EOF that means an error
    (as the agent backend's dial-back, whose EOF is checked against the agent's life)."""

    def __init__(self, inner: SocketStream) -> None:
        self.inner = inner

    def pod_socket(self) -> PodSocket:
        return PodSocket(self.inner, b"first:", self._check_eof, self._lost)

    async def _check_eof(self) -> None:
        raise ForwardError("the agent went away")

    def _lost(self, exc: BrokenStreamError) -> ForwardError:
        return ForwardError(f"lost: {exc}")

    async def receive(self, max_bytes: int = 65536) -> bytes:
        raise AssertionError("a spliced wrapper is never read")

    async def send(self, data: Buffer) -> None:
        await self.inner.send(data)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_wrapper_keeps_its_bytes_eof_and_errors(loop_name: str) -> None:
    run_on(loop_name, _a_wrapper_keeps_its_bytes_eof_and_errors())


async def _a_wrapper_keeps_its_bytes_eof_and_errors() -> None:
    async def answers(conn: SocketStream) -> None:
        await conn.send(b"pod bytes")
        await conn.send_eof()
        await receive_all(conn)

    async with rig(answers, wrap=AgentLike) as state, client(state) as session:
        stream = await session.open_stream({"port": "1"})
        received = bytearray()
        async with asyncio.timeout(TIMEOUT_SECONDS):
            # The wrapper's EOF is an error: the stream is reset after the bytes, not ended.
            with pytest.raises(StreamResetError):
                while chunk := await stream.receive():
                    received += chunk
            await state.forwards_done()
        assert received == b"first:pod bytes"
        assert isinstance(state.results[0].error, ForwardError)
        assert str(state.results[0].error) == "the agent went away"
        assert state.session.spliced_bytes_sent == len(b"pod bytes")


def test_control_frame_flood_while_splicing_gets_goaway(loop_name: str) -> None:
    run_on(loop_name, _control_frame_flood_while_splicing_gets_goaway())


async def _control_frame_flood_while_splicing_gets_goaway() -> None:
    """The session reads its socket itself once a stream splices: control frames are still
    parsed and charged, and a flood still ends the session with GOAWAY(PROTOCOL_ERROR)."""
    # A unix socket: over TCP, the server's close with the flood unread is a reset, which may
    # discard the GOAWAY before the client reads it.
    async with rig(unix_session=True) as state:
        loop = asyncio.get_running_loop()
        core = SpdyConnection(Role.CLIENT)
        sid = core.open_stream({"port": "1"})
        core.send_data(sid, pattern(1, 2 * MIB))
        assert isinstance(state.address, str)
        sock = socket.socket(socket.AF_UNIX)
        sock.setblocking(False)
        await loop.sock_connect(sock, state.address)
        events: list[Event] = []

        async def read_until_closed() -> None:
            with contextlib.suppress(OSError):
                while chunk := await loop.sock_recv(sock, 1 << 16):
                    events.extend(core.receive_data(chunk))

        with sock:
            reading = asyncio.create_task(read_until_closed())
            async with asyncio.timeout(TIMEOUT_SECONDS):
                await loop.sock_sendall(sock, core.data_to_send())
                await until(lambda: state.session.spliced_bytes_received > 0)
                with contextlib.suppress(OSError):  # the server may close on us mid-flood
                    for _ in range(FLOOD_PINGS // 1000):
                        for _ in range(1000):
                            core.ping()
                        await loop.sock_sendall(sock, core.data_to_send())
                await reading
                await state.forwards_done()
        goaways = [e for e in events if isinstance(e, GoAwayReceived)]
        assert [g.status for g in goaways] == [GoAwayStatus.PROTOCOL_ERROR]
        # Far fewer echoes than PINGs: the flood was refused, not served.
        assert sum(isinstance(e, PingAcknowledged) for e in events) < FLOOD_PINGS // 2


def test_a_pod_that_never_reads_is_reset_as_a_stalled_stream(loop_name: str) -> None:
    run_on(loop_name, _a_pod_that_never_reads_is_reset_as_a_stalled_stream())


async def _a_pod_that_never_reads_is_reset_as_a_stalled_stream() -> None:
    """Without flow control the pipe and the socket buffers fill, payload queues the usual way,
    and a queue unread for the stall time resets the stream (the session reads on)."""
    hold = asyncio.Event()

    async def never_reads(conn: SocketStream) -> None:
        await hold.wait()

    async with rig(never_reads, stalled_reset_seconds=1.0) as state, client(state) as session:
        stream = await session.open_stream({"port": "1"})
        data = pattern(8, MIB)

        async def send_forever() -> None:
            with contextlib.suppress(StreamError):
                for _ in range(256):  # far beyond pipe, socket buffers and stream budget
                    await stream.send(data)

        sending = asyncio.create_task(send_forever())
        try:
            async with asyncio.timeout(TIMEOUT_SECONDS):
                await state.forwards_done()
        finally:
            hold.set()
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        assert isinstance(state.results[0].error, StalledStreamError)
        assert state.session.spliced_bytes_received > 0
        assert state.session.broken is None
