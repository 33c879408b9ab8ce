"""DatagramStream: a connected UDP socket as a ByteStream of framed datagrams, on asyncio's loop
and on uvloop (the daemons' loop)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from podgate.aio.datagram import DatagramStream, connected_udp_socket
from podgate.aio.errors import BrokenStreamError, ClosedStreamError
from podgate.proto.datagram import DatagramDecoder, encode_datagram

STEP_SECONDS = 5.0

Scenario = Callable[[], Coroutine[Any, Any, None]]


def peer_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(STEP_SECONDS)
    return sock


async def frames_then_datagrams() -> None:
    with peer_socket() as peer:
        stream = DatagramStream(connected_udp_socket("127.0.0.1", peer.getsockname()[1]))
        try:
            # Frames split anywhere become whole datagrams, the empty one included.
            wire = encode_datagram(b"one") + encode_datagram(b"") + encode_datagram(b"three")
            await stream.send(wire[:4])
            await stream.send(wire[4:9])
            await stream.send(wire[9:])
            got = [peer.recvfrom(100) for _ in range(3)]
            assert [data for data, _ in got] == [b"one", b"", b"three"]
            back_to = got[0][1]
            # Datagrams from the peer come out framed, coalesced while they fit.
            for data in (b"x", b"", b"yz"):
                peer.sendto(data, back_to)
            decoder = DatagramDecoder()
            received: list[bytes] = []
            async with asyncio.timeout(STEP_SECONDS):
                while len(received) < 3:
                    received += decoder.feed(await stream.receive())
            assert received == [b"x", b"", b"yz"]
            assert (stream.datagrams_sent, stream.datagrams_received) == (3, 3)
        finally:
            await stream.aclose()


async def small_reads_split_frames() -> None:
    with peer_socket() as peer:
        stream = DatagramStream(connected_udp_socket("127.0.0.1", peer.getsockname()[1]))
        try:
            await stream.send(encode_datagram(b"hi"))
            _, back_to = peer.recvfrom(100)
            peer.sendto(b"hello", back_to)
            async with asyncio.timeout(STEP_SECONDS):
                parts = [await stream.receive(3), await stream.receive(3), await stream.receive(3)]
            assert parts == [b"\x00\x05h", b"ell", b"o"]
        finally:
            await stream.aclose()


async def eof_ends_the_flow() -> None:
    with peer_socket() as peer:
        stream = DatagramStream(connected_udp_socket("127.0.0.1", peer.getsockname()[1]))
        try:
            receiving = asyncio.ensure_future(stream.receive())
            await asyncio.sleep(0.01)
            await stream.send_eof()  # UDP has no half-close: receiving ends too
            async with asyncio.timeout(STEP_SECONDS):
                assert await receiving == b""
            with pytest.raises(ClosedStreamError):
                await stream.send(encode_datagram(b"late"))
        finally:
            await stream.aclose()


async def truncated_frame_at_eof_is_an_error() -> None:
    with peer_socket() as peer:
        stream = DatagramStream(connected_udp_socket("127.0.0.1", peer.getsockname()[1]))
        try:
            await stream.send(b"\x00\x09abc")
            with pytest.raises(BrokenStreamError, match="ended 5 bytes into a datagram frame"):
                await stream.send_eof()
        finally:
            await stream.aclose()


async def refused_datagrams_are_dropped_not_fatal() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    stream = DatagramStream(connected_udp_socket("127.0.0.1", port))
    try:
        receiving = asyncio.ensure_future(stream.receive())
        async with asyncio.timeout(STEP_SECONDS):
            while stream.dropped == 0:
                await stream.send(encode_datagram(b"anyone?"))
                await asyncio.sleep(0.02)
        assert not receiving.done()  # ICMP port unreachable did not end the stream
        await stream.aclose()
        with pytest.raises(ClosedStreamError):
            await receiving  # a pending receive is woken by the close
    finally:
        await stream.aclose()


SCENARIOS = [
    frames_then_datagrams,
    small_reads_split_frames,
    eof_ends_the_flow,
    truncated_frame_at_eof_is_an_error,
    refused_datagrams_are_dropped_not_fatal,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_datagram_stream(scenario: Scenario, loop: str) -> None:
    if loop == "uvloop":
        uvloop.run(scenario())
    else:
        asyncio.run(scenario())


def test_a_stream_socket_is_refused() -> None:
    async def scenario() -> None:
        with socket.socket() as tcp, pytest.raises(ValueError, match="SOCK_DGRAM"):
            DatagramStream(tcp)

    asyncio.run(scenario())
