"""The relay data plane on its own, over socket pairs (no runtime): bytes pass unchanged, the
calls it looks into are found by their :path however the client's HPACK encoder indexes it,
and an answer held for an interception is not overtaken by what the runtime sends after it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import hpack
import pytest

from podgate.aio.streams import SocketStream
from podgate.proto import h2frames as h2
from podgate.proxy.h2relay import Relay, Rewrite

WATCHED = "/runtime.v1.RuntimeService/PortForward"
OTHER = "/runtime.v1.RuntimeService/Version"
# What the test lets a relay take for one exchange at most (it is over in milliseconds).
EXCHANGE_SECONDS = 10.0

Intercept = Callable[[str, bytes], Awaitable[Rewrite | None] | None]


@dataclass
class Ends:
    client: SocketStream  # the test's side of the client connection
    upstream: SocketStream  # the test's side of the runtime connection
    relay: Relay
    running: asyncio.Task[None]  # the relay's run()


async def stream_pair() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


@pytest.fixture
def intercept() -> list[Intercept]:
    return []


@pytest.fixture
async def ends(intercept: list[Intercept]) -> AsyncIterator[Ends]:
    client, relay_client = await stream_pair()
    relay_upstream, upstream = await stream_pair()

    def chosen(method: str, message: bytes) -> Awaitable[Rewrite | None] | None:
        return intercept[0](method, message)

    # As serve_relay makes it: the client's preface read already.
    relay = Relay(relay_client, relay_upstream, frozenset({WATCHED}), chosen, h2.PREFACE)
    running = asyncio.create_task(relay.run())
    try:
        yield Ends(client, upstream, relay, running)
    finally:
        for stream in (client, upstream):
            await stream.aclose()
        async with asyncio.timeout(EXCHANGE_SECONDS):
            await running
        for stream in (relay_client, relay_upstream):
            await stream.aclose()


async def receive_exactly(stream: SocketStream, size: int) -> bytes:
    got = b""
    async with asyncio.timeout(EXCHANGE_SECONDS):
        while len(got) < size:
            chunk = await stream.receive()
            assert chunk, f"EOF after {len(got)} of {size} bytes"
            got += chunk
    return got


def request(encoder: hpack.Encoder, stream_id: int, path: str, body: bytes) -> tuple[bytes, bytes]:
    """(the header block, the call's frames). Static-table headers besides :path, so a block
    differs from another only by how :path is sent."""
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path)])
    frames = h2.encode_frame(h2.HEADERS, h2.END_HEADERS, stream_id, block) + h2.encode_frame(
        h2.DATA, h2.END_STREAM, stream_id, h2.encode_grpc_message(body)
    )
    return block, frames


def answer(stream_id: int, body: bytes) -> bytes:
    return (
        h2.encode_frame(h2.HEADERS, h2.END_HEADERS, stream_id, b"\x88")  # :status 200
        + h2.encode_frame(h2.DATA, 0, stream_id, h2.encode_grpc_message(body))
        + h2.encode_frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream_id, b"\x40")
    )


async def test_calls_are_found_by_path_however_the_client_indexes_it(
    ends: Ends, intercept: list[Intercept]
) -> None:
    seen: list[tuple[str, bytes]] = []

    def record(method: str, message: bytes) -> None:
        seen.append((method, message))

    intercept.append(record)
    encoder = hpack.Encoder()
    sent = h2.encode_frame(h2.SETTINGS, 0, 0, b"")
    blocks = {}
    # The watched path enters the dynamic table and is then sent as an index; the other path
    # then takes that index, so the very same block means another method.
    for stream_id, path in ((1, WATCHED), (3, WATCHED), (5, OTHER), (7, OTHER), (9, WATCHED)):
        blocks[stream_id], frames = request(encoder, stream_id, path, b"call %d" % stream_id)
        sent += frames
    assert blocks[3] == blocks[7] and h2.only_indexed(blocks[3])
    await ends.client.send(sent)
    assert await receive_exactly(ends.upstream, len(h2.PREFACE + sent)) == h2.PREFACE + sent
    assert seen == [(WATCHED, b"call 1"), (WATCHED, b"call 3"), (WATCHED, b"call 9")]


async def test_a_held_answer_is_not_overtaken_by_what_follows_it(
    ends: Ends, intercept: list[Intercept]
) -> None:
    decision: asyncio.Future[Rewrite | None] = asyncio.get_running_loop().create_future()

    def hold(method: str, message: bytes) -> Awaitable[Rewrite | None]:
        return decision

    intercept.append(hold)
    encoder = hpack.Encoder()
    _, watched = request(encoder, 1, WATCHED, b"forward")
    _, other = request(encoder, 3, OTHER, b"version")
    sent = watched + other
    await ends.client.send(sent)
    await receive_exactly(ends.upstream, len(h2.PREFACE + sent))
    # The runtime answers the watched call, then the other, in separate reads, while the
    # interception has not decided yet.
    await ends.upstream.send(answer(1, b"url-a"))
    await asyncio.sleep(0.05)
    later = answer(3, b"v1") + h2.encode_frame(0x6, 0, 0, bytes(8))  # and a PING
    await ends.upstream.send(later)
    await asyncio.sleep(0.05)
    decision.set_result(lambda message: message.replace(b"url-a", b"URL-B"))
    expected = len(answer(1, b"url-a")) + len(later)
    _, frames = h2.FrameSplitter().split(await receive_exactly(ends.client, expected))
    assert [(f.type, f.stream_id) for f in frames] == [
        (h2.HEADERS, 1),
        (h2.DATA, 1),
        (h2.HEADERS, 1),
        (h2.HEADERS, 3),
        (h2.DATA, 3),
        (h2.HEADERS, 3),
        (0x6, 0),
    ]
    assert h2.grpc_message(h2.data_of(frames[1]).tobytes()) == (False, b"URL-B")


async def test_a_header_block_the_relay_cannot_decode_ends_the_connection(
    ends: Ends, intercept: list[Intercept]
) -> None:
    intercept.append(lambda method, message: None)
    encoder = hpack.Encoder()
    _, good = request(encoder, 1, OTHER, b"version")
    bad = h2.encode_frame(h2.HEADERS, h2.END_HEADERS, 3, b"\x80")  # index 0 does not exist
    await ends.client.send(good)
    await receive_exactly(ends.upstream, len(h2.PREFACE + good))
    await ends.client.send(bad)
    # Passed on before it was read (the runtime refuses it too), and the relay is over.
    assert await receive_exactly(ends.upstream, len(bad)) == bad
    async with asyncio.timeout(EXCHANGE_SECONDS):
        await ends.running


async def test_a_block_continued_in_continuation_frames_is_read_whole(
    ends: Ends, intercept: list[Intercept]
) -> None:
    seen: list[tuple[str, bytes]] = []
    intercept.append(lambda method, message: seen.append((method, message)))
    encoder = hpack.Encoder()
    block, _ = request(encoder, 1, WATCHED, b"")
    sent = (
        h2.encode_frame(h2.HEADERS, 0, 1, block[:2])
        + h2.encode_frame(h2.CONTINUATION, 0, 1, block[2:5])
        + h2.encode_frame(h2.CONTINUATION, h2.END_HEADERS, 1, block[5:])
        + h2.encode_frame(h2.DATA, h2.END_STREAM, 1, h2.encode_grpc_message(b"continued"))
    )
    await ends.client.send(sent)
    assert await receive_exactly(ends.upstream, len(h2.PREFACE + sent)) == h2.PREFACE + sent
    assert seen == [(WATCHED, b"continued")]


async def test_a_call_the_client_resets_is_forgotten(
    ends: Ends, intercept: list[Intercept]
) -> None:
    never: asyncio.Future[Rewrite | None] = asyncio.get_running_loop().create_future()
    intercept.append(lambda method, message: never)
    _, watched = request(hpack.Encoder(), 1, WATCHED, b"forward")
    await ends.client.send(watched)
    await receive_exactly(ends.upstream, len(h2.PREFACE + watched))
    assert list(ends.relay.calls) == [1]  # its answer would be held
    reset = h2.encode_window_update(0, 100) + h2.encode_frame(h2.RST_STREAM, 0, 1, bytes(4))
    await ends.client.send(reset)
    assert await receive_exactly(ends.upstream, len(reset)) == reset
    # Nothing is held any more: the runtime's bytes pass as they come.
    assert ends.relay.calls == {}
    never.cancel()


async def test_the_runtimes_header_table_size_is_followed(
    ends: Ends, intercept: list[Intercept]
) -> None:
    intercept.append(lambda method, message: None)
    settings = h2.encode_frame(h2.SETTINGS, 0, 0, b"\x00\x01\x00\x00\x00\x00")  # table size 0
    sent = (
        h2.encode_frame(0x6, 0, 0, bytes(8))  # a PING
        + settings
        + h2.encode_window_update(0, 1000)
    )
    await ends.upstream.send(sent)
    assert await receive_exactly(ends.client, len(sent)) == sent
    # A client block that grows the table beyond the runtime's size is refused (RFC 7541
    # §6.3): passed on as it came, and the relay is over.
    grow = h2.encode_frame(h2.HEADERS, h2.END_HEADERS, 1, b"\x3f\xe1\x1f\x82\x86")
    await ends.client.send(grow)
    assert await receive_exactly(ends.upstream, len(h2.PREFACE + grow)) == h2.PREFACE + grow
    async with asyncio.timeout(EXCHANGE_SECONDS):
        await ends.running


async def test_a_frame_passed_on_in_part_is_not_repeated_once_answers_are_held(
    ends: Ends, intercept: list[Intercept]
) -> None:
    decided: asyncio.Future[Rewrite | None] = asyncio.get_running_loop().create_future()
    decided.set_result(lambda message: message.replace(b"url-a", b"URL-B"))
    intercept.append(lambda method, message: decided)
    encoder = hpack.Encoder()
    _, other = request(encoder, 3, OTHER, b"version")
    await ends.client.send(other)
    await receive_exactly(ends.upstream, len(h2.PREFACE + other))
    # The other call's answer arrives cut inside its DATA frame: the start goes on at once.
    reply = answer(3, b"version reply")
    await ends.upstream.send(reply[:15])
    assert await receive_exactly(ends.client, 15) == reply[:15]
    # A watched call starts before the rest comes: from now on answers are looked into.
    _, watched = request(encoder, 5, WATCHED, b"forward")
    await ends.client.send(watched)
    await receive_exactly(ends.upstream, len(watched))
    await ends.upstream.send(reply[15:] + answer(5, b"url-a"))
    expected = reply[15:] + answer(5, b"URL-B")
    assert await receive_exactly(ends.client, len(expected)) == expected


async def test_a_window_update_passed_on_in_part_is_not_changed_for_what_is_owed(
    ends: Ends, intercept: list[Intercept]
) -> None:
    decided: asyncio.Future[Rewrite | None] = asyncio.get_running_loop().create_future()
    longer = b"a URL longer than the runtime's"
    decided.set_result(lambda message: longer)
    intercept.append(lambda method, message: decided)
    _, watched = request(hpack.Encoder(), 1, WATCHED, b"forward")
    first = h2.encode_window_update(0, 1000)
    await ends.client.send(watched + first[:5])
    assert await receive_exactly(ends.upstream, len(h2.PREFACE + watched) + 5) == (
        h2.PREFACE + watched + first[:5]
    )
    # The answer grows past what the runtime's flow control counted: the client is owed.
    await ends.upstream.send(answer(1, b"u"))
    grown = len(longer) - len(b"u")
    await receive_exactly(ends.client, len(answer(1, b"u")) + grown)
    assert ends.relay._owed == grown
    # The update whose start went on is finished as it began; the next one repays.
    await ends.client.send(first[5:] + h2.encode_window_update(0, 1000))
    expected = first[5:] + h2.encode_window_update(0, 1000 - grown)
    assert await receive_exactly(ends.upstream, len(expected)) == expected
    assert ends.relay._owed == 0
