"""Which port-forward sessions get SPDY flow control: exactly those that negotiated podgate's
extension (`udp.portforward.podgate.io`, also inside the WebSocket tunnel), on both ends.

podgate client <-> podgate server (the demo API) over real sockets. With the extension the
server hands window back as it reads an upload (WINDOW_UPDATE frames reach the client) and a
download bigger than the window completes only because the client hands window back too.
Offering only `portforward.k8s.io`, as kubectl does, the server sends no WINDOW_UPDATE at all.
"""

from __future__ import annotations

import asyncio

import pytest
from streaming_support import ECHO_PORT, SINK_PORT, Api, PatternWriter, read_digest

from podgate.aio.streams import ByteStream
from podgate.proto import portforward as pf
from podgate.proto.spdy import (
    STREAM_WINDOW_BYTES,
    Event,
    WindowUpdated,
    WindowUpdateReceived,
)
from podgate.streaming.client import PortForwardSession
from podgate.streaming.portforward import flow_control_window

# Three windows each way: more than the peer may send without WINDOW_UPDATE.
TRANSFER_BYTES = 3 * STREAM_WINDOW_BYTES
TRANSFER_TIMEOUT_SECONDS = 60.0
PROMPT_SECONDS = 10.0


def record_events(session: PortForwardSession) -> list[Event]:
    """Every event the client's SPDY core parses from the server, from now on."""
    core = session.session._core
    seen: list[Event] = []
    parse = core.receive_data

    def recording(data: bytes | bytearray | memoryview) -> list[Event]:
        events = parse(data)
        seen.extend(events)
        return events

    core.receive_data = recording  # type: ignore[method-assign]
    return seen


async def read_all(stream: ByteStream) -> bytes:
    parts = []
    while chunk := await stream.receive():
        parts.append(chunk)
    return b"".join(parts)


def test_only_the_extension_turns_flow_control_on() -> None:
    assert flow_control_window(pf.UDP_PORTFORWARD_PROTOCOL) == STREAM_WINDOW_BYTES
    for protocol in (pf.PORTFORWARD_PROTOCOL, pf.UDP_TUNNEL_PROTOCOL, "", "v4.channel.k8s.io"):
        assert flow_control_window(protocol) is None


@pytest.mark.parametrize("websocket", [False, True], ids=["spdy", "websocket-tunnel"])
@pytest.mark.parametrize("extension", [False, True], ids=["kubectl-offer", "podgate-offer"])
async def test_flow_control_follows_the_negotiated_protocol(
    api: Api, websocket: bool, extension: bool
) -> None:
    session = await asyncio.wait_for(
        PortForwardSession.connect(
            api.endpoint, api.path("portforward"), websocket=websocket, udp=extension
        ),
        PROMPT_SECONDS,
    )
    try:
        expected = pf.UDP_PORTFORWARD_PROTOCOL if extension else pf.PORTFORWARD_PROTOCOL
        assert session.protocol == expected
        window = STREAM_WINDOW_BYTES if extension else None
        assert session.session.flow_control_window == window
        seen = record_events(session)

        # Upload: the sink reads everything, so the server hands window back (extension only).
        forwarded = await session.open(SINK_PORT)
        writer = PatternWriter(seed=1, total=TRANSFER_BYTES)
        await asyncio.wait_for(writer.write_to(forwarded.data), TRANSFER_TIMEOUT_SECONDS)
        reply = await asyncio.wait_for(read_all(forwarded.data), PROMPT_SECONDS)
        assert reply.decode() == writer.digest.hexdigest()
        sid = forwarded.data.stream_id
        granted = sum(e.delta for e in seen if isinstance(e, WindowUpdated) and e.stream_id == sid)
        if extension:
            # All but less than half a window of the upload came back as window.
            assert TRANSFER_BYTES - STREAM_WINDOW_BYTES // 2 < granted <= TRANSFER_BYTES
        else:
            assert not any(isinstance(e, WindowUpdated | WindowUpdateReceived) for e in seen)

        # Download through the echo: the server may send only a window ahead of our reads.
        echoed = await session.open(ECHO_PORT)
        writer = PatternWriter(seed=2, total=TRANSFER_BYTES)
        sending = asyncio.create_task(writer.write_to(echoed.data))
        count, digest = await asyncio.wait_for(read_digest(echoed.data), TRANSFER_TIMEOUT_SECONDS)
        await asyncio.wait_for(sending, PROMPT_SECONDS)
        assert (count, digest) == (TRANSFER_BYTES, writer.digest.hexdigest())
        if not extension:
            assert not any(isinstance(e, WindowUpdated | WindowUpdateReceived) for e in seen)
    finally:
        await session.aclose()
