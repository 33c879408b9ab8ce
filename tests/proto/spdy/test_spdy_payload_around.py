"""DATA payload that the driver moves itself (a kernel splice) instead of feeding it to the
core: `data_in_progress` says where the input stands inside a DATA frame, `skip_data` counts
payload bytes that went around, `data_header` accounts a frame whose payload the driver writes.
Stream state, FIN, flow-control windows and the frames after the skipped payload must come out
exactly as when every byte is fed (checked against a core that is fed everything)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spdy_support import deliver, merge_data, pair

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy import (
    DataInProgress,
    DataReceived,
    Event,
    PingReceived,
    Role,
    SpdyConnection,
    StreamClosedError,
    StreamReset,
    StreamState,
)
from podgate.proto.spdy.frames import FLAG_FIN, decode_frame_header, encode_data_header

SETTINGS = settings(max_examples=100, deadline=None)
WINDOW = 64 * 1024


def opened(**kwargs: int) -> tuple[SpdyConnection, SpdyConnection, int]:
    """A client and a server with stream 1 opened and replied."""
    client, server = pair(**kwargs)
    sid = client.open_stream({"port": "80"})
    deliver(client, server)
    server.reply(sid)
    deliver(server, client)
    return client, server, sid


def test_at_a_boundary_there_is_no_data_in_progress() -> None:
    _, server, _ = opened()
    assert server.data_in_progress() is None


def test_skipping_a_payload_ends_the_frame_with_its_fin() -> None:
    client, server, sid = opened()
    client.send_data(sid, b"x" * 1000, fin=True)
    wire = client.data_to_send()
    # The header and 10 payload bytes are fed; 990 go around the core.
    events = server.receive_data(wire[:18])
    assert events == [DataReceived(sid, b"x" * 10)]
    assert server.data_in_progress() == DataInProgress(sid, 990, True)
    assert server.skip_data(500) == []
    assert server.data_in_progress() == DataInProgress(sid, 490, True)
    assert server.skip_data(490) == [DataReceived(sid, b"", fin=True)]
    assert server.data_in_progress() is None
    assert server.stream_state(sid) is StreamState.HALF_CLOSED_REMOTE


def test_frames_after_a_skipped_payload_parse_as_usual() -> None:
    client, server, sid = opened()
    client.send_data(sid, b"a" * 100)
    client.ping()
    client.send_data(sid, b"bc")
    wire = client.data_to_send()
    assert server.receive_data(wire[:8]) == []
    server.skip_data(100)
    events = server.receive_data(wire[108:])
    assert [type(e) for e in events] == [PingReceived, DataReceived]
    assert events[1] == DataReceived(sid, b"bc")


def test_a_frame_of_a_reset_stream_is_not_deliverable_and_cannot_be_skipped() -> None:
    client, server, sid = opened()
    client.send_data(sid, b"z" * 50)
    wire = client.data_to_send()
    server.receive_data(wire[:8])
    server.reset_stream(sid)
    assert server.data_in_progress() == DataInProgress(sid, 50, False)
    with pytest.raises(LocalProtocolError):
        server.skip_data(10)
    assert server.receive_data(wire[8:]) == []  # dropped, as always


def test_skipping_more_than_is_left_or_at_a_boundary_is_misuse() -> None:
    client, server, sid = opened()
    with pytest.raises(LocalProtocolError):
        server.skip_data(1)
    client.send_data(sid, b"q" * 10)
    server.receive_data(client.data_to_send()[:8])
    with pytest.raises(LocalProtocolError):
        server.skip_data(11)
    with pytest.raises(LocalProtocolError):
        server.skip_data(0)


def test_flow_control_windows_stay_exact_around_skipped_payload() -> None:
    client, server, sid = opened(flow_control_window=WINDOW)
    client.send_data(sid, b"w" * WINDOW)
    assert client.send_window(sid) == 0
    wire = client.data_to_send()
    events = server.receive_data(wire[:8])  # header only: the window is charged whole
    assert events == []
    assert server.receive_window(sid) == WINDOW - min(WINDOW, 32 * 1024)
    while (progress := server.data_in_progress()) is not None:
        server.skip_data(progress.remaining)
        # the next frame's header, if any
        rest = wire[8 + 32 * 1024 :]
        wire = rest
        server.receive_data(rest[:8])
    assert server.receive_window(sid) == 0
    server.window_update(sid, WINDOW)
    deliver(server, client)
    assert client.send_window(sid) == WINDOW


def test_data_header_accounts_state_and_window() -> None:
    client, server, sid = opened(flow_control_window=WINDOW)
    header = client.data_header(sid, 1000)
    assert header == encode_data_header(sid, 1000)
    assert client.send_window(sid) == WINDOW - 1000
    with pytest.raises(LocalProtocolError):
        client.data_header(sid, WINDOW)  # beyond the window: refused whole
    assert client.send_window(sid) == WINDOW - 1000
    # The peer parses the header and payload written by hand like any frame.
    assert server.receive_data(header + b"p" * 1000) == [DataReceived(sid, b"p" * 1000)]
    assert server.receive_window(sid) == WINDOW - 1000


def test_data_header_refuses_to_overtake_queued_frames_and_closed_streams() -> None:
    client, _, sid = opened()
    client.ping()
    with pytest.raises(LocalProtocolError):
        client.data_header(sid, 10)
    client.data_to_send()
    client.end_stream(sid)
    client.data_to_send()
    with pytest.raises(LocalProtocolError):
        client.data_header(sid, 10)  # after our FIN
    client.reset_stream(sid)
    client.data_to_send()
    with pytest.raises(StreamClosedError):
        client.data_header(sid, 10)
    with pytest.raises(LocalProtocolError):
        client.data_header(sid + 2, 10)  # never opened


def test_data_header_rejects_sizes_outside_a_frame() -> None:
    client, _, sid = opened()
    for size in (0, 1 << 24):
        with pytest.raises(LocalProtocolError):
            client.data_header(sid, size)
    header = decode_frame_header(client.data_header(sid, (1 << 24) - 1), 0)
    assert header.length == (1 << 24) - 1
    assert not header.flags & FLAG_FIN


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8),
    fin=st.booleans(),
    cut=st.integers(0, 8),
    window=st.sampled_from([None, 64 * 1024]),
    data=st.data(),
)
def test_skipping_any_part_matches_feeding_everything(
    sizes: list[int], fin: bool, cut: int, window: int | None, data: st.DataObject
) -> None:
    """Two servers get the same frames; one is fed every byte, the other only the headers
    (and a random part of each payload, as a driver's small read would bring). Their streams,
    windows and FIN end up the same, and the delivered + skipped bytes are the payload."""
    kwargs = {} if window is None else {"flow_control_window": window}
    client = SpdyConnection(Role.CLIENT, **kwargs)  # type: ignore[arg-type]
    fed = SpdyConnection(Role.SERVER, **kwargs)  # type: ignore[arg-type]
    skipping = SpdyConnection(Role.SERVER, **kwargs)  # type: ignore[arg-type]
    sid = client.open_stream({"port": "1"})
    opening = client.data_to_send()
    fed.receive_data(opening)
    skipping.receive_data(opening)
    fed.reply(sid)
    skipping.reply(sid)
    payload = b"".join(bytes([i % 251]) * size for i, size in enumerate(sizes))
    client.send_data(sid, payload[: len(payload) - cut] if cut < len(payload) else payload)
    client.send_data(sid, payload[len(payload) - cut :] if cut < len(payload) else b"", fin=fin)
    wire = client.data_to_send()
    fed_events = merge_data(fed.receive_data(wire))
    got = bytearray()
    skipped = 0
    events: list[Event] = []
    pos = 0
    while pos < len(wire):
        progress = skipping.data_in_progress()
        if progress is not None and progress.deliver:
            n = data.draw(st.integers(1, progress.remaining))
            events += skipping.skip_data(n)
            skipped += n
            pos += n
            continue
        step = data.draw(st.integers(1, 64))
        for event in skipping.receive_data(wire[pos : pos + step]):
            events.append(event)
            if isinstance(event, DataReceived):
                got += event.data
        pos += step
    expected = b"".join(e.data for e in fed_events if isinstance(e, DataReceived))
    assert skipped + len(got) == len(expected)
    assert any(isinstance(e, DataReceived) and e.fin for e in events) == fin
    assert skipping.stream_state(sid) is fed.stream_state(sid)
    if window is not None and skipping.stream_state(sid) is not StreamState.CLOSED:
        assert skipping.receive_window(sid) == fed.receive_window(sid)
    assert not any(isinstance(e, StreamReset) for e in events)


def test_bytes_wanted_completes_headers_control_frames_and_payloads() -> None:
    client, server, sid = opened()
    assert server.bytes_wanted() == 8  # a boundary: a frame header
    client.ping()
    ping = client.data_to_send()  # 8-byte header + 4-byte id
    server.receive_data(ping[:3])
    assert server.bytes_wanted() == 5
    server.receive_data(ping[3:8])
    assert server.bytes_wanted() == 4  # the PING's body
    assert [type(e) for e in server.receive_data(ping[8:])] == [PingReceived]
    assert server.bytes_wanted() == 8
    client.send_data(sid, b"d" * 300)
    data = client.data_to_send()
    server.receive_data(data[:8])
    assert server.bytes_wanted() == 300  # the DATA payload
    server.receive_data(data[8:108])
    assert server.bytes_wanted() == 200
    server.skip_data(200)
    assert server.bytes_wanted() == 8
