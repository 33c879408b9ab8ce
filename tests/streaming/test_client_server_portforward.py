"""port-forward, podgate client <-> podgate server over real sockets: SPDY direct, SPDY inside
the WebSocket tunnel, and v4 WebSocket channels. Every byte is checked with sha256 against
what the client generated; refused ports and slow readers are covered too.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest
from streaming_support import (
    ECHO_PORT,
    MIB,
    REFUSED_PORT,
    SINK_PORT,
    Api,
    Meter,
    PatternWriter,
    read_digest,
    without_stall,
)

from podgate.aio.errors import StreamError
from podgate.streaming.client import ForwardedStream, PortForwardSession, portforward_websocket

CONNECTIONS = 8
BYTES_PER_CONNECTION = 64 * MIB
WS_PORTS = 2
WS_BYTES_PER_PORT = 16 * MIB
# A transfer fails once no byte has arrived for this long (a hang), however long it runs.
STALL_SECONDS = 10.0
PROMPT_SECONDS = 10.0

TRANSPORTS = [False, True]
TRANSPORT_IDS = ["spdy", "websocket-tunnel"]


async def connect(api: Api, websocket: bool) -> PortForwardSession:
    return await asyncio.wait_for(
        PortForwardSession.connect(api.endpoint, api.path("portforward"), websocket=websocket),
        PROMPT_SECONDS,
    )


async def echo_round_trip(
    session: PortForwardSession, seed: int, size: int, meter: Meter | None = None
) -> None:
    """Send `size` bytes through the echo port and check what comes back, byte for byte."""
    forwarded = await session.open(ECHO_PORT)
    writer = PatternWriter(seed, size)
    sending = asyncio.create_task(writer.write_to(forwarded.data))
    count, digest = await read_digest(forwarded.data, meter=meter)
    await sending
    assert count == size
    assert digest == writer.digest.hexdigest()
    assert await forwarded.error() == ""  # an empty error stream: success (§3)


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_concurrent_connections_move_64_mib_each_way_exactly(
    api: Api, websocket: bool
) -> None:
    session = await connect(api, websocket)
    meter = Meter()
    try:
        transfers = [
            echo_round_trip(session, seed, BYTES_PER_CONNECTION, meter)
            for seed in range(CONNECTIONS)
        ]
        await without_stall(asyncio.gather(*transfers), meter, STALL_SECONDS)
        assert meter.bytes == CONNECTIONS * BYTES_PER_CONNECTION
    finally:
        await session.aclose()


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_sink_reads_exactly_what_was_sent(api: Api, websocket: bool) -> None:
    """The target itself checks the bytes: the sink answers the sha256 of what it read."""
    session = await connect(api, websocket)
    try:
        forwarded = await session.open(SINK_PORT)
        writer = PatternWriter(seed=99, total=8 * MIB + 3)
        await asyncio.wait_for(writer.write_to(forwarded.data), STALL_SECONDS)
        answer = await asyncio.wait_for(forwarded.data.receive(), PROMPT_SECONDS)
        assert answer.decode() == writer.digest.hexdigest()
        assert await asyncio.wait_for(forwarded.data.receive(), PROMPT_SECONDS) == b""
    finally:
        await session.aclose()


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_refused_port_reports_on_the_error_stream_and_the_session_survives(
    api: Api, websocket: bool
) -> None:
    session = await connect(api, websocket)
    try:
        # One connection is moving data when the failing one is opened.
        busy = await session.open(ECHO_PORT)
        await busy.data.send(b"before")
        refused = await session.open(REFUSED_PORT)
        message = await asyncio.wait_for(refused.error(), PROMPT_SECONDS)
        # "error forwarding port <port> to pod <pod>, uid <uid>: <err>" (§3)
        assert message.startswith(
            f"error forwarding port {REFUSED_PORT} to pod {api.pod.name}, uid {api.pod.uid}: "
        )
        await assert_data_stream_ended(refused)
        # The busy connection is untouched, and new ones still work.
        await busy.data.send(b" and after")
        await busy.data.send_eof()
        count, _ = await asyncio.wait_for(read_digest(busy.data), PROMPT_SECONDS)
        assert count == len(b"before and after")
        await asyncio.wait_for(echo_round_trip(session, seed=7, size=MIB), PROMPT_SECONDS)
    finally:
        await session.aclose()


async def assert_data_stream_ended(forwarded: ForwardedStream) -> None:
    """The server resets the data stream of a failed pair: reads end (EOF or reset)."""
    try:
        rest = await asyncio.wait_for(forwarded.data.receive(), PROMPT_SECONDS)
    except StreamError:
        return
    assert rest == b""


async def test_websocket_channels_one_connection_per_port(api: Api) -> None:
    ports = [ECHO_PORT] * WS_PORTS  # each listed port gets its own connection to the pod
    channels, _, reader = await asyncio.wait_for(
        portforward_websocket(api.endpoint, api.path("portforward"), ports), PROMPT_SECONDS
    )
    meter = Meter()
    try:

        async def round_trip(index: int) -> None:
            stream = channels.stream(2 * index)  # data channel of the index-th port (§5.6)
            writer = PatternWriter(seed=100 + index, total=WS_BYTES_PER_PORT)
            # v4 channels have no half-close, so read exactly what was sent.
            sending = asyncio.create_task(writer.write_to(stream, eof=False))
            count, digest = await read_digest(stream, limit=WS_BYTES_PER_PORT, meter=meter)
            await sending
            assert count == WS_BYTES_PER_PORT
            assert digest == writer.digest.hexdigest()

        transfers = [round_trip(i) for i in range(WS_PORTS)]
        await without_stall(asyncio.gather(*transfers), meter, STALL_SECONDS)
    finally:
        await channels.aclose()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_websocket_channel_refused_port_reports_on_its_error_channel(api: Api) -> None:
    ports = [REFUSED_PORT, ECHO_PORT]
    channels, streams, reader = await asyncio.wait_for(
        portforward_websocket(api.endpoint, api.path("portforward"), ports), PROMPT_SECONDS
    )
    try:
        error = await asyncio.wait_for(channels.stream(1).receive(), PROMPT_SECONDS)
        assert error.decode().startswith(
            f"error forwarding port {REFUSED_PORT} to pod {api.pod.name}, uid {api.pod.uid}: "
        )
        echo = streams[ECHO_PORT]
        await echo.send(b"still forwarding")
        count, _ = await asyncio.wait_for(read_digest(echo, limit=16), PROMPT_SECONDS)
        assert count == 16
    finally:
        await channels.aclose()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


# --------------------------------------------------------------------------- backpressure


PENDING_BYTES = 64 * MIB
# What the process may hold for one stalled connection, client, server and echo target
# together: two 2 MiB stream queues (server ingress, client egress), five 1 MiB socket
# receive buffers and five transport send buffers (1 MiB each, plus a chunk past the mark)
# along client -> server -> echo -> server -> client, and the writer's 1 MiB chunk: about
# 16 MiB. Without backpressure the unread answer alone would reach 64 MiB.
BUFFER_BOUND_BYTES = 24 * MIB


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_slow_reader_bounds_memory_then_gets_every_byte(api: Api, websocket: bool) -> None:
    session = await connect(api, websocket)
    try:
        forwarded = await session.open(ECHO_PORT)
        writer = PatternWriter(seed=1234, total=PENDING_BYTES)
        gc.collect()
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            sending = asyncio.create_task(writer.write_to(forwarded.data))
            await asyncio.sleep(1.5)  # the echo answers; nobody reads the answers
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # The writer is held back (the kernel's socket buffers hold some of what it sent),
        # and what the process itself buffers stays bounded.
        assert not sending.done()
        assert peak - baseline < BUFFER_BOUND_BYTES, f"{(peak - baseline) / MIB:.1f} MiB buffered"
        meter = Meter()
        count, digest = await without_stall(
            read_digest(forwarded.data, meter=meter), meter, STALL_SECONDS
        )
        await sending
        assert count == PENDING_BYTES
        assert digest == writer.digest.hexdigest()
    finally:
        await session.aclose()


# --------------------------------------------------------------------------- clients that leave


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_client_leaving_mid_transfer_releases_the_pod_connections(
    api: Api, websocket: bool
) -> None:
    session = await connect(api, websocket)
    forwarded = [await session.open(ECHO_PORT) for _ in range(3)]
    for stream in forwarded:
        await stream.data.send(bytes(MIB))  # no EOF: the transfers are still running
    await asyncio.wait_for(forwarded[0].data.receive(), PROMPT_SECONDS)
    assert api.pod_connections == len(forwarded)
    await session.aclose()
    await api.pod_connections_closed()


async def test_websocket_client_leaving_releases_the_pod_connections(api: Api) -> None:
    ports = [ECHO_PORT, ECHO_PORT]
    channels, streams, reader = await asyncio.wait_for(
        portforward_websocket(api.endpoint, api.path("portforward"), ports), PROMPT_SECONDS
    )
    await streams[ECHO_PORT].send(bytes(MIB))
    await asyncio.wait_for(streams[ECHO_PORT].receive(), PROMPT_SECONDS)
    assert api.pod_connections == len(ports)
    await channels.aclose()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await api.pod_connections_closed()


# --------------------------------------------------------------------------- pairing


async def pair_and_forward(session: PortForwardSession, first: str, request_id: str | None) -> None:
    """Open an error+data pair in the given order (requestid optional) and move data."""
    streams = {}
    for kind in (first, "data" if first == "error" else "error"):
        headers = {"streamtype": kind, "port": str(ECHO_PORT)}
        if request_id is not None:
            headers["requestid"] = request_id
        streams[kind] = await asyncio.wait_for(session.session.open_stream(headers), PROMPT_SECONDS)
    await streams["error"].send_eof()
    await streams["data"].send(b"paired")
    await streams["data"].send_eof()
    count, _ = await asyncio.wait_for(read_digest(streams["data"]), PROMPT_SECONDS)
    assert count == len(b"paired")


@pytest.mark.parametrize(
    ("first", "request_id"),
    [("data", "r1"), ("error", None)],
    ids=["data-first", "no-requestid"],
)
async def test_streams_pair_in_either_order_and_without_requestid(
    api: Api, first: str, request_id: str | None
) -> None:
    # Pairing is by requestid whatever the order; without one (old clients) the error
    # stream's id and the data stream's id - 2 pair up (§3).
    session = await connect(api, websocket=False)
    try:
        await pair_and_forward(session, first, request_id)
    finally:
        await session.aclose()


async def test_duplicate_stream_of_a_pending_request_is_reported_on_its_error_stream(
    api: Api,
) -> None:
    session = await connect(api, websocket=False)
    try:
        headers = {"streamtype": "error", "port": str(ECHO_PORT), "requestid": "dup"}
        error = await asyncio.wait_for(session.session.open_stream(headers), PROMPT_SECONDS)
        await error.send_eof()
        with pytest.raises(StreamError):
            second = await asyncio.wait_for(session.session.open_stream(headers), PROMPT_SECONDS)
            await asyncio.wait_for(second.receive(), PROMPT_SECONDS)  # reset, if not refused
        text = await asyncio.wait_for(error.receive(), PROMPT_SECONDS)
        assert text == b"error processing stream for request dup: error stream already assigned"
        await asyncio.wait_for(echo_round_trip(session, seed=5, size=MIB), PROMPT_SECONDS)
    finally:
        await session.aclose()
