"""The byte budget of a whole session, for protocols without flow control (WebSocket channels,
Kubernetes' SPDY): many streams each under their own budget must not add up to unbounded
memory, and a port whose reader stalls is reset so the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket

import pytest

from podgate.aio import spdy, wschannel
from podgate.aio.errors import StalledStreamError, StreamError
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.tasks import cancel_and_wait
from podgate.aio.wschannel import ChannelSession
from podgate.proto.spdy import Role as SpdyRole
from podgate.proto.wschannel import ChannelConnection, PortForwardChannels, Role

V4 = "v4.channel.k8s.io"
# Streams that each stay just under their own budget: together far over the session's.
STREAMS = 12
PER_STREAM = wschannel.MAX_QUEUED_BYTES_PER_CHANNEL - 256 * 1024
SETTLE_SECONDS = 1.0
PROMPT_SECONDS = 30.0
# A short stall limit for the tests (the daemons use STALLED_STREAM_RESET_SECONDS).
TEST_STALL_SECONDS = 0.5


async def socketpair_streams() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


async def receive_exactly(stream: ByteStream, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        chunk = await stream.receive()
        assert chunk, f"EOF after {got} of {size} bytes"
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


async def send_until_closed(stream: ByteStream, size: int) -> None:
    """Push `size` bytes; the session closing under the sender ends it quietly."""
    with contextlib.suppress(StreamError):
        await stream.send(bytes(size))


async def port_forward_sessions(ports: list[int]) -> tuple[ChannelSession, ChannelSession]:
    """A v4 port-forward client and server (the server as serve_stream makes it)."""
    a, b = await socketpair_streams()
    client_core = ChannelConnection(
        Role.CLIENT, V4, port_channels=PortForwardChannels(ports, Role.CLIENT)
    )
    client = ChannelSession(a, client_core, name="client")
    server = ChannelSession(
        b,
        ChannelConnection(Role.SERVER, V4),
        name="server",
        inbound={2 * i for i in range(len(ports))},
        stall_reset=True,
    )
    return client, server


async def test_websocket_channels_together_stay_within_the_session_budget() -> None:
    ports = list(range(8000, 8000 + STREAMS))
    client, server = await port_forward_sessions(ports)
    data = [bytes([i]) * PER_STREAM for i in range(STREAMS)]
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks += [asyncio.create_task(s.run()) for s in (client, server)]
        sends = [asyncio.create_task(client.stream(2 * i).send(d)) for i, d in enumerate(data)]
        tasks += sends
        await asyncio.sleep(SETTLE_SECONDS)  # nobody reads on the server yet
        held = server.queued_bytes
        assert held <= wschannel.MAX_QUEUED_BYTES_PER_SESSION + wschannel.SEND_MESSAGE_BYTES
        assert not all(t.done() for t in sends), "every byte was taken into memory"
        # Readers arrive: every byte goes through, intact.
        async with asyncio.timeout(PROMPT_SECONDS):
            got = await asyncio.gather(
                *(receive_exactly(server.stream(2 * i), len(d)) for i, d in enumerate(data))
            )
            await asyncio.gather(*sends)
        assert [hashlib.sha256(g).digest() for g in got] == [
            hashlib.sha256(d).digest() for d in data
        ]
        print(f"session held {held >> 20} MiB of {STREAMS * PER_STREAM >> 20} MiB sent")
    finally:
        await cancel_and_wait(*tasks)
        await client.aclose()
        await server.aclose()


async def test_a_stalled_port_is_reset_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wschannel, "STALLED_STREAM_RESET_SECONDS", TEST_STALL_SECONDS)
    client, server = await port_forward_sessions([7000, 7001])
    stalled, other = server.stream(0), server.stream(2)
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks += [asyncio.create_task(s.run()) for s in (client, server)]
        # Port 7000's reader never reads: over its budget, the connection stops reading...
        flood = send_until_closed(client.stream(0), 3 * wschannel.MAX_QUEUED_BYTES_PER_CHANNEL)
        tasks.append(asyncio.create_task(flood))
        await asyncio.sleep(SETTLE_SECONDS / 10)
        # ...until port 7000 is reset: 7001's bytes then arrive.
        async with asyncio.timeout(PROMPT_SECONDS):
            await client.stream(2).send(b"for 7001")
            assert await receive_exactly(other, 8) == b"for 7001"
            await stalled.stalled.wait()
        with pytest.raises(StalledStreamError):
            await stalled.receive()
    finally:
        await cancel_and_wait(*tasks)
        await client.aclose()
        await server.aclose()


async def test_spdy_streams_together_stay_within_the_session_budget() -> None:
    a, b = await socketpair_streams()
    accepted: list[SpdyStream] = []

    def on_stream(stream: SpdyStream) -> None:
        stream.accept()
        accepted.append(stream)

    server = SpdySession(b, SpdyRole.SERVER, on_stream=on_stream, idle_timeout=None)
    client = SpdySession(a, SpdyRole.CLIENT, idle_timeout=None)
    data = [bytes([i]) * PER_STREAM for i in range(STREAMS)]
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks += [asyncio.create_task(s.run()) for s in (client, server)]
        streams = [await client.open_stream({"n": str(i)}) for i in range(STREAMS)]
        sends = [asyncio.create_task(s.send(d)) for s, d in zip(streams, data, strict=True)]
        tasks += sends
        await asyncio.sleep(SETTLE_SECONDS)
        held = server.queued_bytes
        assert held <= spdy.MAX_QUEUED_BYTES_PER_SESSION + spdy.SEND_DATA_FRAME_BYTES
        assert not all(t.done() for t in sends), "every byte was taken into memory"
        async with asyncio.timeout(PROMPT_SECONDS):
            got = await asyncio.gather(
                *(receive_exactly(s, len(d)) for s, d in zip(accepted, data, strict=True))
            )
            await asyncio.gather(*sends)
        assert [hashlib.sha256(g).digest() for g in got] == [
            hashlib.sha256(d).digest() for d in data
        ]
        print(f"session held {held >> 20} MiB of {STREAMS * PER_STREAM >> 20} MiB sent")
    finally:
        await cancel_and_wait(*tasks)
        await client.aclose()
        await server.aclose()


async def test_spdy_sessions_together_stay_within_the_process_budget() -> None:
    """Sessions without flow control share one budget: several sessions, each under its own
    budget, hold no more together than the process's (plus what the sessions under their
    share still take), and a session holding little is not stopped by the others."""
    sessions = 6
    per_session = spdy.MAX_QUEUED_BYTES_PER_SESSION - spdy.MAX_QUEUED_BYTES_PER_STREAM
    streams_each = per_session // PER_STREAM
    pairs: list[tuple[SpdySession, SpdySession, list[SpdyStream]]] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for _ in range(sessions + 1):  # the last one is the light session
            a, b = await socketpair_streams()
            accepted: list[SpdyStream] = []

            def on_stream(stream: SpdyStream, into: list[SpdyStream] = accepted) -> None:
                stream.accept()
                into.append(stream)

            server = SpdySession(b, SpdyRole.SERVER, on_stream=on_stream, idle_timeout=None)
            client = SpdySession(a, SpdyRole.CLIENT, idle_timeout=None)
            tasks += [asyncio.create_task(s.run()) for s in (client, server)]
            pairs.append((client, server, accepted))
        heavy, light = pairs[:-1], pairs[-1]
        sent: list[list[bytes]] = []
        for client, _, _ in heavy:
            data = [bytes([i]) * PER_STREAM for i in range(streams_each)]
            streams = [await client.open_stream({"n": str(i)}) for i in range(streams_each)]
            tasks += [asyncio.create_task(s.send(d)) for s, d in zip(streams, data, strict=True)]
            sent.append(data)
        await asyncio.sleep(SETTLE_SECONDS)
        held = sum(server.queued_bytes for _, server, _ in heavy)
        assert held == spdy.process_queued_bytes()
        # Each session reads on up to its share, and one DATA frame past its check.
        slack = spdy.PROCESS_SHARE_BYTES + spdy.SEND_DATA_FRAME_BYTES
        bound = spdy.MAX_QUEUED_BYTES_PER_PROCESS + sessions * slack
        assert held <= bound, (held >> 20, bound >> 20)
        # Over the process's budget, a session holding less than its share still reads.
        client, _, accepted = light
        light_stream = await client.open_stream({"n": "light"})
        payload = bytes(range(256)) * 256  # 64 KiB
        async with asyncio.timeout(PROMPT_SECONDS):
            await light_stream.send(payload)
            assert await receive_exactly(accepted[0], len(payload)) == payload
        # Everything held back arrives once read.
        async with asyncio.timeout(PROMPT_SECONDS):
            for (_, _, received), data in zip(heavy, sent, strict=True):
                got = await asyncio.gather(
                    *(receive_exactly(s, len(d)) for s, d in zip(received, data, strict=True))
                )
                assert got == data
        print(f"{sessions} sessions held {held >> 20} MiB of {sessions * per_session >> 20} MiB")
    finally:
        await cancel_and_wait(*tasks)
        for client, server, _ in pairs:
            await client.aclose()
            await server.aclose()
    assert spdy.process_queued_bytes() == 0
