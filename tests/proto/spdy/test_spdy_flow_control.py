"""SPDY/3.1 per-stream flow control in the sans-IO core (opt-in, for podgate peers only).

Frames are written as hex from the SPDY/3 frame layout (k8s-streaming.md §1.1-§1.2): a control
header `80 03 <type16> <flags8> <length24>`, WINDOW_UPDATE (type 9) carrying stream-id(4) and
delta-window-size(4), RST_STREAM (type 3) stream-id(4) and status(4); FLOW_CONTROL_ERROR is 7.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spdy_support import FakePeer, deliver, h, merge_data

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy import (
    MAX_WINDOW_BYTES,
    STREAM_WINDOW_BYTES,
    DataReceived,
    Event,
    Role,
    SpdyConnection,
    StreamAborted,
    StreamClosedError,
    StreamOpened,
    StreamReplied,
    StreamState,
    WindowUpdated,
    WindowUpdateReceived,
)
from podgate.proto.spdy.frames import FRAME_HEADER_LENGTH, ControlFrameHeader, decode_frame_header

SETTINGS = settings(max_examples=100, deadline=None)

# WINDOW_UPDATE, stream 1, delta 65536 (0x00010000).
WINDOW_UPDATE_1_64K = h("80 03 00 09 | 00 00 00 08 | 00 00 00 01 | 00 01 00 00")
# RST_STREAM, stream 1 / stream 3, status 7 FLOW_CONTROL_ERROR.
RST_1_FLOW_CONTROL = h("80 03 00 03 | 00 00 00 08 | 00 00 00 01 | 00 00 00 07")
RST_3_FLOW_CONTROL = h("80 03 00 03 | 00 00 00 08 | 00 00 00 03 | 00 00 00 07")
WINDOW_UPDATE_TYPE = 9


def window_update_frame(stream_id: int, delta: int) -> bytes:
    """WINDOW_UPDATE by hand: the header from the layout, then the two big-endian words."""
    return h("80 03 00 09 00 00 00 08") + stream_id.to_bytes(4, "big") + delta.to_bytes(4, "big")


def data_frame(stream_id: int, payload: bytes, fin: bool = False) -> bytes:
    """A DATA frame by hand: stream id, flags, 24-bit length, payload."""
    return (
        stream_id.to_bytes(4, "big")
        + bytes([1 if fin else 0])
        + len(payload).to_bytes(3, "big")
        + payload
    )


def control_types(wire: bytes) -> list[int]:
    """The type of every control frame in a byte string of whole frames."""
    types = []
    pos = 0
    while pos < len(wire):
        header = decode_frame_header(wire, pos)
        if isinstance(header, ControlFrameHeader):
            types.append(header.type)
        pos += FRAME_HEADER_LENGTH + header.length
    assert pos == len(wire)
    return types


def server_with_streams(window: int, count: int = 1) -> tuple[SpdyConnection, FakePeer]:
    """A flow-controlled server that accepted `count` streams (1, 3, ...) from a raw peer."""
    server = SpdyConnection(Role.SERVER, flow_control_window=window)
    peer = FakePeer()
    for i in range(count):
        sid = 2 * i + 1
        events = server.receive_data(peer.syn_stream(sid, {"streamtype": "data"}))
        assert events == [StreamOpened(sid, {"streamtype": "data"})]
        server.reply(sid)
    server.data_to_send()
    return server, peer


def established(window: int | None) -> tuple[SpdyConnection, SpdyConnection, int]:
    client = SpdyConnection(Role.CLIENT, flow_control_window=window)
    server = SpdyConnection(Role.SERVER, flow_control_window=window)
    sid = client.open_stream({"streamtype": "data"})
    deliver(client, server)
    server.reply(sid)
    assert deliver(server, client) == [StreamReplied(sid, {})]
    return client, server, sid


# --- the wire ---------------------------------------------------------------------------------


def test_window_update_frame_bytes() -> None:
    server, _peer = server_with_streams(window=65536)
    server.receive_data(data_frame(1, bytes(65536)))
    assert server.receive_window(1) == 0
    server.window_update(1, 65536)
    assert server.data_to_send() == WINDOW_UPDATE_1_64K
    assert server.receive_window(1) == 65536


def test_both_ends_start_with_the_same_implicit_window() -> None:
    client, server, sid = established(window=1000)
    for conn in (client, server):
        assert conn.flow_control_window == 1000
        assert conn.send_window(sid) == 1000
        assert conn.receive_window(sid) == 1000
    assert SpdyConnection(Role.CLIENT).flow_control_window is None
    assert 1 <= STREAM_WINDOW_BYTES <= MAX_WINDOW_BYTES == 2**31 - 1


# --- sending ----------------------------------------------------------------------------------

# (action, argument, send window afterwards). "send" queues DATA, "update" feeds the peer's
# WINDOW_UPDATE, "refuse" is a send that must fail whole.
SEND_TABLE = [
    ("send", 300, 700),
    ("send", 700, 0),
    ("refuse", 1, 0),
    ("update", 250, 250),
    ("refuse", 251, 250),
    ("send", 250, 0),
    ("update", 1, 1),
    ("update", 4000, 4001),
    ("send", 4001, 0),
]


def test_send_window_accounting_table() -> None:
    client, _server, sid = established(window=1000)
    for action, amount, expected in SEND_TABLE:
        if action == "send":
            client.send_data(sid, bytes(amount))
            wire = client.data_to_send()
            # Payload plus one 8-byte header per DATA frame of at most 32 KiB.
            assert len(wire) == amount + FRAME_HEADER_LENGTH * -(-amount // 32768)
        elif action == "refuse":
            with pytest.raises(LocalProtocolError, match="send window"):
                client.send_data(sid, bytes(amount))
            assert client.data_to_send() == b""
        else:
            events = client.receive_data(window_update_frame(sid, amount))
            assert events == [WindowUpdated(sid, amount)]
        assert client.send_window(sid) == expected, (action, amount)


def test_refused_send_with_fin_leaves_the_stream_open() -> None:
    client, _server, sid = established(window=10)
    with pytest.raises(LocalProtocolError):
        client.send_data(sid, bytes(11), fin=True)
    assert client.stream_state(sid) is StreamState.OPEN
    client.send_data(sid, bytes(10), fin=True)
    assert client.stream_state(sid) is StreamState.HALF_CLOSED_LOCAL


def test_fin_alone_needs_no_window() -> None:
    client, _server, sid = established(window=5)
    client.send_data(sid, bytes(5))
    client.end_stream(sid)
    assert client.data_to_send()[-8:] == h("00 00 00 01 01 00 00 00")


def test_window_update_past_2_to_the_31_resets_that_stream_only() -> None:
    server, _peer = server_with_streams(window=1000, count=2)
    # 1000 + (2^31 - 1001) is exactly the maximum: allowed.
    assert server.receive_data(window_update_frame(3, MAX_WINDOW_BYTES - 1000)) == [
        WindowUpdated(3, MAX_WINDOW_BYTES - 1000)
    ]
    assert server.send_window(3) == MAX_WINDOW_BYTES
    # One more byte on stream 3 overflows it; stream 1 is untouched.
    events = server.receive_data(window_update_frame(3, 1) + window_update_frame(1, 5))
    assert events == [StreamAborted(3, 7), WindowUpdated(1, 5)]
    assert server.data_to_send() == RST_3_FLOW_CONTROL
    assert server.stream_state(3) is StreamState.CLOSED
    assert server.stream_state(1) is StreamState.OPEN
    assert server.send_window(1) == 1005
    with pytest.raises(StreamClosedError):
        server.send_window(3)


def test_window_updates_for_stream_zero_or_dead_streams_change_nothing() -> None:
    server, _peer = server_with_streams(window=100)
    # Stream 0 is SPDY/3.1's connection window, which the extension does not use.
    assert server.receive_data(window_update_frame(0, 5)) == [WindowUpdateReceived(0, 5)]
    # Streams never opened, already closed, and a zero delta.
    server.reset_stream(1)
    server.data_to_send()
    wire = window_update_frame(1, 5) + window_update_frame(9, 5)
    assert server.receive_data(wire) == []
    assert server.data_to_send() == b""


def test_zero_delta_is_ignored() -> None:
    server, _peer = server_with_streams(window=100)
    assert server.receive_data(window_update_frame(1, 0)) == []
    assert server.send_window(1) == 100


# --- receiving --------------------------------------------------------------------------------


def test_data_within_the_window_is_delivered_up_to_the_last_byte() -> None:
    server, _peer = server_with_streams(window=100)
    events = server.receive_data(data_frame(1, b"a" * 60) + data_frame(1, b"b" * 40))
    assert events == [DataReceived(1, b"a" * 60), DataReceived(1, b"b" * 40)]
    assert server.receive_window(1) == 0
    assert server.data_to_send() == b""


def test_data_beyond_the_window_resets_that_stream_only() -> None:
    server, _peer = server_with_streams(window=100, count=2)
    wire = (
        data_frame(1, b"x" * 100)  # exactly the window
        + data_frame(3, b"y" * 60)
        + data_frame(1, b"z")  # one byte too many
        + data_frame(3, b"w" * 40)
        + data_frame(1, b"late")  # after our RST: dropped as for any closed stream
    )
    events = server.receive_data(wire)
    assert events == [
        DataReceived(1, b"x" * 100),
        DataReceived(3, b"y" * 60),
        StreamAborted(1, 7),
        DataReceived(3, b"w" * 40),
    ]
    assert server.data_to_send() == RST_1_FLOW_CONTROL
    assert server.stream_state(1) is StreamState.CLOSED
    assert server.stream_state(3) is StreamState.OPEN
    assert server.receive_window(3) == 0


def test_an_oversized_frame_split_across_reads_is_skipped_whole() -> None:
    server, _peer = server_with_streams(window=10, count=2)
    wire = data_frame(1, b"q" * 25, fin=True) + data_frame(3, b"ok", fin=True)
    events: list[Event] = []
    for i in range(len(wire)):
        events += server.receive_data(wire[i : i + 1])
    assert merge_data(events) == [StreamAborted(1, 7), DataReceived(3, b"ok", fin=True)]
    assert server.data_to_send() == RST_1_FLOW_CONTROL


def test_window_update_returns_window_and_stops_after_the_peers_fin() -> None:
    client, server, sid = established(window=100)
    client.send_data(sid, bytes(100))
    deliver(client, server)
    server.window_update(sid, 30)
    server.window_update(sid, 70)
    wire = server.data_to_send()
    assert wire == window_update_frame(sid, 30) + window_update_frame(sid, 70)
    assert client.receive_data(wire) == [WindowUpdated(sid, 30), WindowUpdated(sid, 70)]
    assert client.send_window(sid) == 100
    client.end_stream(sid)
    deliver(client, server)
    # The peer sends no more: handing window back is pointless, so nothing is queued.
    server.window_update(sid, 50)
    assert server.data_to_send() == b""


def test_window_update_argument_checks() -> None:
    _client, server, sid = established(window=100)
    for bad in (0, -1, MAX_WINDOW_BYTES + 1):
        with pytest.raises(LocalProtocolError):
            server.window_update(sid, bad)
    # The receive window may not grow past 2^31 - 1 either.
    with pytest.raises(LocalProtocolError):
        server.window_update(sid, MAX_WINDOW_BYTES - 99)
    assert server.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        server.send_window(99)  # never opened


# --- flow control off -------------------------------------------------------------------------


def test_off_means_no_window_api_and_no_limit() -> None:
    client, server, sid = established(window=None)
    with pytest.raises(LocalProtocolError):
        client.send_window(sid)
    with pytest.raises(LocalProtocolError):
        server.window_update(sid, 1)
    assert server.receive_data(window_update_frame(sid, 7)) == [WindowUpdateReceived(sid, 7)]
    big = 3 * 1024 * 1024
    client.send_data(sid, bytes(big))
    events = deliver(client, server)
    assert sum(len(e.data) for e in events if isinstance(e, DataReceived)) == big
    assert client.data_to_send() == server.data_to_send() == b""


ops = st.lists(
    st.tuples(st.sampled_from(["open", "send", "fin", "reset", "ping"]), st.integers(0, 5000)),
    max_size=30,
)


def run_ops(window: int | None, script: list[tuple[str, int]]) -> tuple[bytes, bytes]:
    """Drive a client and a server through `script`; return every byte each one wrote."""
    client = SpdyConnection(Role.CLIENT, flow_control_window=window)
    server = SpdyConnection(Role.SERVER, flow_control_window=window)
    out_client = bytearray()
    out_server = bytearray()
    live: list[int] = []
    for kind, n in script:
        if kind == "open":
            live.append(client.open_stream({"n": str(n)}))
        elif live:
            sid = live[n % len(live)]
            if kind == "send":
                client.send_data(sid, bytes([n % 256]) * n)
            elif kind == "fin":
                client.end_stream(sid)
                live.remove(sid)
            elif kind == "reset":
                client.reset_stream(sid)
                live.remove(sid)
            else:
                server.ping()
        wire = client.data_to_send()
        out_client += wire
        for event in server.receive_data(wire):
            if isinstance(event, StreamOpened):
                server.reply(event.stream_id)
            elif isinstance(event, DataReceived) and event.data and window is not None:
                server.window_update(event.stream_id, len(event.data))
        back = server.data_to_send()
        out_server += back
        client.receive_data(back)
    return bytes(out_client), bytes(out_server)


@SETTINGS
@given(ops)
def test_with_flow_control_the_wire_differs_only_by_window_updates(
    script: list[tuple[str, int]],
) -> None:
    """The same calls with flow control off and on (a window no run can exhaust): the client's
    bytes are identical, and the server's differ only by its WINDOW_UPDATE frames."""
    client_off, server_off = run_ops(None, script)
    client_on, server_on = run_ops(1 << 20, script)
    assert client_on == client_off
    assert WINDOW_UPDATE_TYPE not in control_types(server_off)
    stripped = bytearray()
    pos = 0
    while pos < len(server_on):
        header = decode_frame_header(server_on, pos)
        end = pos + FRAME_HEADER_LENGTH + header.length
        if not (isinstance(header, ControlFrameHeader) and header.type == WINDOW_UPDATE_TYPE):
            stripped += server_on[pos:end]
        pos = end
    assert bytes(stripped) == server_off


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    window=st.integers(1, 2000),
    returned=st.integers(1, 2000),
)
def test_a_windowed_transfer_arrives_whole_and_never_overruns(
    sizes: list[int], window: int, returned: int
) -> None:
    """The sender sends what its window allows; the receiver returns window in steps of
    `returned` bytes (the rest at the end). No RST, every byte arrives, windows stay in range."""
    client, server, sid = established(window)
    payload = b"".join(bytes([i % 251]) * n for i, n in enumerate(sizes))
    sent = 0
    got = bytearray()
    unreturned = 0
    for _ in range(10 * len(payload) + 10):
        if sent == len(payload):
            break
        n = min(client.send_window(sid), len(payload) - sent)
        if n:
            client.send_data(sid, payload[sent : sent + n])
            sent += n
        for event in deliver(client, server):
            assert isinstance(event, DataReceived)
            got += event.data
            unreturned += len(event.data)
        assert 0 <= server.receive_window(sid) <= window
        while unreturned >= returned or (unreturned and client.send_window(sid) == 0):
            step = min(returned, unreturned)
            server.window_update(sid, step)
            unreturned -= step
        for event in deliver(server, client):
            assert isinstance(event, WindowUpdated)
        assert 0 <= client.send_window(sid) <= window
    assert bytes(got) == payload


peer_frames = st.lists(
    st.tuples(
        st.sampled_from(["data", "update", "grant"]),
        st.sampled_from([1, 3]),
        st.integers(0, 3000),
    ),
    max_size=40,
)


@SETTINGS
@given(script=peer_frames, cuts=st.integers(1, 64))
def test_a_peer_ignoring_the_window_never_gets_more_delivered_than_granted(
    script: list[tuple[str, int, int]], cuts: int
) -> None:
    """A peer that sends whatever it likes (DATA of any size, WINDOW_UPDATE of any delta),
    split into reads of any size: per stream, delivered bytes never exceed the window plus
    what we granted; an overrun aborts that stream and nothing is delivered on it afterwards."""
    window = 1000
    server, _peer = server_with_streams(window, count=2)
    granted = {1: 0, 3: 0}
    delivered = {1: 0, 3: 0}
    aborted: set[int] = set()
    for kind, sid, n in script:
        if kind == "grant":
            if n and sid not in aborted and server.receive_window(sid) + n <= MAX_WINDOW_BYTES:
                server.window_update(sid, n)
                granted[sid] += n
            continue
        wire = data_frame(sid, bytes(n)) if kind == "data" else window_update_frame(sid, n)
        for start in range(0, len(wire), cuts):
            for event in server.receive_data(wire[start : start + cuts]):
                if isinstance(event, StreamAborted):
                    assert event.status == 7
                    aborted.add(event.stream_id)
                elif isinstance(event, DataReceived):
                    assert event.stream_id not in aborted
                    delivered[event.stream_id] += len(event.data)
        for s in (1, 3):
            assert delivered[s] <= window + granted[s]
        server.data_to_send()
