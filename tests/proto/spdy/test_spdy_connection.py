"""SpdyConnection behaviour: a client core and a server core talking in memory, plus the
stream and connection rules of the reference (§1.3, §1.6, §1.7, §1.10)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from spdy_support import FakePeer, deliver, h, pair

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy import (
    FLAG_FIN,
    FLAG_UNIDIRECTIONAL,
    MAX_CONTROL_FRAME_LENGTH,
    ConnectionClosed,
    DataReceived,
    GoAwayReceived,
    GoAwayStatus,
    PingAcknowledged,
    PingReceived,
    Role,
    RstStatus,
    SettingsReceived,
    SpdyConnection,
    SpdyConnectionError,
    StreamClosedError,
    StreamOpened,
    StreamReplied,
    StreamReset,
    StreamState,
    WindowUpdateReceived,
)
from podgate.proto.spdy.connection import LOCAL_INPUTS, TRANSITIONS, StreamInput
from podgate.proto.spdy.frames import (
    SettingsEntry,
    encode_data,
    encode_goaway,
    encode_headers,
    encode_ping,
    encode_settings,
    encode_syn_reply,
    encode_window_update,
)


def rst(sid: int, status: int) -> bytes:
    """RST_STREAM written out from the §1.2 layout."""
    return h("80 03 00 03 00 00 00 08") + sid.to_bytes(4, "big") + status.to_bytes(4, "big")


def goaway(last_good: int, status: int) -> bytes:
    return h("80 03 00 07 00 00 00 08") + last_good.to_bytes(4, "big") + status.to_bytes(4, "big")


def established(**kwargs: int) -> tuple[SpdyConnection, SpdyConnection, int]:
    client, server = pair(**kwargs)
    sid = client.open_stream({"streamtype": "data"})
    deliver(client, server)
    server.reply(sid)
    deliver(server, client)
    return client, server, sid


# --- a whole exchange ------------------------------------------------------------------------


def test_exec_like_session_end_to_end() -> None:
    client, server = pair()
    ids = []
    for kind in ("error", "stdin", "stdout"):
        sid = client.open_stream({"streamtype": kind})
        assert deliver(client, server) == [StreamOpened(sid, {"streamtype": kind})]
        server.reply(sid)
        assert deliver(server, client) == [StreamReplied(sid, {})]
        ids.append(sid)
    assert ids == [1, 3, 5]
    error, stdin, stdout = ids

    client.send_data(stdin, b"echo hi\n")
    client.end_stream(stdin)
    client.end_stream(error)
    assert deliver(client, server) == [
        DataReceived(stdin, b"echo hi\n"),
        DataReceived(stdin, b"", fin=True),
        DataReceived(error, b"", fin=True),
    ]
    server.send_data(stdout, b"hi\n", fin=True)
    server.end_stream(stdin)
    server.end_stream(error)
    assert deliver(server, client) == [
        DataReceived(stdout, b"hi\n", fin=True),
        DataReceived(stdin, b"", fin=True),
        DataReceived(error, b"", fin=True),
    ]
    assert client.stream_state(stdin) is StreamState.CLOSED
    assert server.stream_state(error) is StreamState.CLOSED
    assert client.stream_state(stdout) is StreamState.HALF_CLOSED_REMOTE

    client.reset_stream(stdout)
    assert deliver(client, server) == [StreamReset(stdout, RstStatus.CANCEL)]
    assert client.stream_state(stdout) is server.stream_state(stdout) is StreamState.CLOSED

    ping_id = client.ping()
    assert deliver(client, server) == [PingReceived(ping_id)]
    assert deliver(server, client) == [PingAcknowledged(ping_id)]

    client.goaway()
    assert deliver(client, server) == [GoAwayReceived(0, GoAwayStatus.OK)]
    server.goaway()
    assert deliver(server, client) == [GoAwayReceived(5, GoAwayStatus.OK)]
    assert client.receive_eof() == [ConnectionClosed()]
    assert client.receive_eof() == []
    assert client.closed and server.closed


def test_server_to_client_ping_uses_even_ids() -> None:
    client, server = pair()
    assert [server.ping(), server.ping()] == [2, 4]
    assert deliver(server, client) == [PingReceived(2), PingReceived(4)]
    assert deliver(client, server) == [PingAcknowledged(2), PingAcknowledged(4)]


def test_ping_ids_wrap_like_spdystream() -> None:
    client, server = pair()
    client._next_ping_id = 0x7FFFFFFD  # reaching the wrap by pinging would take 2**30 calls
    assert [client.ping() for _ in range(3)] == [0x7FFFFFFD, 0x7FFFFFFF, 1]
    server._next_ping_id = 0x7FFFFFFC
    assert [server.ping() for _ in range(3)] == [0x7FFFFFFC, 0x7FFFFFFE, 0x80000000]
    assert server.ping() == 2


def test_server_opened_streams_use_even_ids() -> None:
    client, server = pair()
    assert server.open_stream({"a": "1"}) == 2
    assert deliver(server, client) == [StreamOpened(2, {"a": "1"})]
    client.reply(2)
    assert deliver(client, server) == [StreamReplied(2, {})]
    assert server.open_stream({"a": "2"}) == 4


def test_reply_and_open_can_carry_headers_and_fin() -> None:
    client, server = pair()
    sid = client.open_stream({"streamtype": "error"}, fin=True)
    assert deliver(client, server) == [StreamOpened(sid, {"streamtype": "error"}, fin=True)]
    assert server.stream_state(sid) is StreamState.REPLY_PENDING_HALF_CLOSED_REMOTE
    server.reply(sid, {"x-a": "1\x002"}, fin=True)
    assert deliver(server, client) == [StreamReplied(sid, {"x-a": "1\x002"}, fin=True)]
    assert client.stream_state(sid) is StreamState.CLOSED
    assert server.stream_state(sid) is StreamState.CLOSED


# --- sending DATA ----------------------------------------------------------------------------


def test_send_data_splits_frames_without_joining_payload() -> None:
    client, server, sid = established(max_data_frame=4)
    client.send_data(sid, b"0123456789", fin=True)
    buffers = client.buffers_to_send()
    assert [bytes(b) for b in buffers] == [
        h("00 00 00 01 00 00 00 04"),
        b"0123",
        h("00 00 00 01 00 00 00 04"),
        b"4567",
        h("00 00 00 01 01 00 00 02"),
        b"89",
    ]
    assert all(isinstance(b, memoryview) for b in buffers[1::2])
    assert client.data_to_send() == b""  # buffers_to_send cleared the queue
    events = server.receive_data(b"".join(buffers))
    assert events == [
        DataReceived(sid, b"0123"),
        DataReceived(sid, b"4567"),
        DataReceived(sid, b"89", fin=True),
    ]


def test_send_data_copies_mutable_buffers() -> None:
    client, _, sid = established()
    payload = bytearray(b"abc")
    client.send_data(sid, payload)
    payload[:] = b"xyz"
    assert client.data_to_send() == h("00 00 00 01 00 00 00 03") + b"abc"


def test_empty_send_without_fin_sends_nothing() -> None:
    client, _, sid = established()
    client.send_data(sid, b"")
    assert client.data_to_send() == b""


def test_server_must_reply_before_sending_data() -> None:
    client, server = pair()
    sid = client.open_stream({"streamtype": "stdout"})
    deliver(client, server)
    with pytest.raises(LocalProtocolError):
        server.send_data(sid, b"early")
    with pytest.raises(LocalProtocolError):
        server.end_stream(sid)
    assert server.data_to_send() == b""
    server.reply(sid)
    server.send_data(sid, b"ok")
    assert deliver(server, client) == [StreamReplied(sid, {}), DataReceived(sid, b"ok")]


def test_sending_after_fin_or_reset_raises() -> None:
    client, server, sid = established()
    client.end_stream(sid)
    with pytest.raises(LocalProtocolError):
        client.send_data(sid, b"late")
    with pytest.raises(LocalProtocolError):
        client.end_stream(sid)
    server.reset_stream(sid)
    deliver(server, client)
    with pytest.raises(StreamClosedError):
        server.send_data(sid, b"late")
    with pytest.raises(StreamClosedError):
        client.send_data(sid, b"late")


def test_reset_of_closed_or_unknown_stream_is_a_no_op() -> None:
    client, _server, sid = established()
    client.reset_stream(sid)
    client.data_to_send()
    client.reset_stream(sid)
    client.reset_stream(99)
    assert client.data_to_send() == b""


def test_reset_after_our_fin_still_sends_rst() -> None:
    client, _server, sid = established()
    client.end_stream(sid)
    client.data_to_send()
    client.reset_stream(sid, RstStatus.INTERNAL_ERROR)
    assert client.data_to_send() == rst(sid, RstStatus.INTERNAL_ERROR)


def test_rejecting_a_stream_is_rst_cancel_without_reply() -> None:
    client, server = pair()
    sid = client.open_stream({"streamtype": "bogus"})
    deliver(client, server)
    server.reset_stream(sid)
    assert server.data_to_send() == rst(sid, RstStatus.CANCEL)
    assert client.receive_data(rst(sid, RstStatus.CANCEL)) == [StreamReset(sid, 5)]


def test_local_argument_checks() -> None:
    client, _, sid = established()
    with pytest.raises(LocalProtocolError):
        client.reset_stream(sid, 0)
    with pytest.raises(LocalProtocolError):
        client.goaway(7)
    with pytest.raises(LocalProtocolError):
        client.open_stream({"Upper": "x"})
    with pytest.raises(LocalProtocolError):
        client.open_stream({"host": "x"})
    assert client.open_stream({"ok": "1"}) == 3  # the refused calls used no id
    with pytest.raises(ValueError):
        SpdyConnection(Role.CLIENT, max_data_frame=0)


def test_no_new_streams_after_goaway() -> None:
    client, server = pair()
    client.goaway()
    with pytest.raises(LocalProtocolError):
        client.open_stream({})
    deliver(client, server)
    with pytest.raises(LocalProtocolError):
        server.open_stream({})


def test_goaway_names_the_last_accepted_peer_stream_and_is_sent_once() -> None:
    client, server = pair()
    for _ in range(2):
        client.open_stream({})
    deliver(client, server)
    assert server.last_peer_stream_id == 3
    server.goaway(GoAwayStatus.INTERNAL_ERROR)
    server.goaway()
    assert server.data_to_send() == goaway(3, GoAwayStatus.INTERNAL_ERROR)


def test_syn_stream_after_our_goaway_is_dropped_silently() -> None:
    client, server = pair()
    server.goaway()
    server.data_to_send()
    client.open_stream({})
    assert deliver(client, server) == []
    assert server.data_to_send() == b""


# --- receiving DATA --------------------------------------------------------------------------


def test_data_is_emitted_as_it_arrives() -> None:
    _client, server, sid = established()
    frame = encode_data(sid, b"abcdefgh", flags=FLAG_FIN)
    assert server.receive_data(frame[:5]) == []
    assert server.receive_data(frame[5:11]) == [DataReceived(sid, b"abc")]
    assert server.receive_data(frame[11:12]) == [DataReceived(sid, b"d")]
    assert server.receive_data(frame[12:]) == [DataReceived(sid, b"efgh", fin=True)]


def test_large_data_frame_is_not_buffered() -> None:
    _client, server, sid = established()
    header = h("00 00 00 01 00 ff ff ff")  # a 16 MiB - 1 frame
    assert server.receive_data(header + bytes(1000)) == [DataReceived(sid, bytes(1000))]
    assert server.receive_data(bytes(2**24 - 1001)) == [DataReceived(sid, bytes(2**24 - 1001))]
    assert server.receive_data(encode_data(sid, b"next")) == [DataReceived(sid, b"next")]


def test_empty_data_without_fin_emits_nothing() -> None:
    _client, server, sid = established()
    assert server.receive_data(encode_data(sid, b"")) == []


def test_data_for_unknown_or_closed_streams_is_dropped() -> None:
    _client, server, sid = established()
    assert server.receive_data(encode_data(7, b"x") + encode_data(9, b"", flags=FLAG_FIN)) == []
    server.reset_stream(sid)
    server.data_to_send()
    assert server.receive_data(encode_data(sid, b"late", flags=FLAG_FIN)) == []
    assert server.data_to_send() == b""


def test_local_reset_mid_frame_drops_the_rest_of_the_frame() -> None:
    _client, server, sid = established()
    frame = encode_data(sid, b"abcdef", flags=FLAG_FIN)
    assert server.receive_data(frame[:10]) == [DataReceived(sid, b"ab")]
    server.reset_stream(sid)
    assert server.receive_data(frame[10:] + encode_ping(1)) == [PingReceived(1)]


def test_data_after_the_peers_fin_is_answered_with_stream_already_closed() -> None:
    _client, server, sid = established()
    server.receive_data(encode_data(sid, b"", flags=FLAG_FIN))
    assert server.receive_data(encode_data(sid, b"more")) == []
    assert server.data_to_send() == rst(sid, RstStatus.STREAM_ALREADY_CLOSED)
    assert server.stream_state(sid) is StreamState.CLOSED


def test_data_before_syn_reply_is_dropped_like_spdystream() -> None:
    client, _server = pair()
    sid = client.open_stream({})
    assert client.receive_data(encode_data(sid, b"early")) == []
    assert client.receive_data(encode_syn_reply(sid, FakePeer().compressor.compress({}))) == [
        StreamReplied(sid, {})
    ]


def test_client_may_send_before_the_reply_and_the_server_delivers_it() -> None:
    client, server = pair()
    sid = client.open_stream({})
    client.send_data(sid, b"eager")
    assert deliver(client, server) == [StreamOpened(sid, {}), DataReceived(sid, b"eager")]


def test_data_stream_id_zero_is_fatal() -> None:
    _, server = pair()
    with pytest.raises(SpdyConnectionError):
        server.receive_data(h("00 00 00 00 00 00 00 01 aa"))


# --- receiving control frames ----------------------------------------------------------------


def test_bad_syn_stream_id_is_a_stream_error_only() -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER)
    assert server.receive_data(peer.syn_stream(3, {"streamtype": "data"})) == [
        StreamOpened(3, {"streamtype": "data"})
    ]
    server.reply(3)
    server.data_to_send()
    # Not increasing: RST PROTOCOL_ERROR, no event; stream 3 keeps working.
    assert server.receive_data(peer.syn_stream(1, {"streamtype": "error"})) == []
    assert server.receive_data(peer.syn_stream(3, {"streamtype": "again"})) == []
    # Our own parity: refused the same way.
    assert server.receive_data(peer.syn_stream(6, {})) == []
    assert server.data_to_send() == (
        rst(1, RstStatus.PROTOCOL_ERROR)
        + rst(3, RstStatus.PROTOCOL_ERROR)
        + rst(6, RstStatus.PROTOCOL_ERROR)
    )
    assert server.receive_data(encode_data(3, b"still fine")) == [DataReceived(3, b"still fine")]
    server.send_data(3, b"back")
    assert server.data_to_send() == encode_data(3, b"back")
    # Gaps are fine: ids only have to increase.
    assert server.receive_data(peer.syn_stream(11, {})) == [StreamOpened(11, {})]
    assert server.stream_state(5) is StreamState.CLOSED


def test_concurrent_stream_limit_refuses_streams() -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER, max_concurrent_streams=2)
    server.receive_data(peer.syn_stream(1, {}) + peer.syn_stream(3, {}))
    assert server.receive_data(peer.syn_stream(5, {})) == []
    assert server.data_to_send() == rst(5, RstStatus.REFUSED_STREAM)
    assert server.stream_state(5) is StreamState.CLOSED
    server.reset_stream(1)
    assert server.receive_data(peer.syn_stream(7, {})) == [StreamOpened(7, {})]


def test_unidirectional_syn_stream_is_half_closed_local() -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER)
    events = server.receive_data(peer.syn_stream(1, {"a": "b"}, flags=FLAG_UNIDIRECTIONAL))
    assert events == [StreamOpened(1, {"a": "b"}, unidirectional=True)]
    assert server.stream_state(1) is StreamState.HALF_CLOSED_LOCAL
    with pytest.raises(LocalProtocolError):
        server.send_data(1, b"x")
    assert server.receive_data(encode_data(1, b"in", flags=FLAG_FIN)) == [
        DataReceived(1, b"in", fin=True)
    ]
    assert server.stream_state(1) is StreamState.CLOSED
    events = server.receive_data(peer.syn_stream(3, {}, flags=FLAG_UNIDIRECTIONAL | FLAG_FIN))
    assert events == [StreamOpened(3, {}, fin=True, unidirectional=True)]
    assert server.stream_state(3) is StreamState.CLOSED


def test_syn_stream_id_zero_is_fatal() -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER)
    frame = peer.syn_stream(1, {})
    with pytest.raises(SpdyConnectionError):
        server.receive_data(frame[:8] + bytes(4) + frame[12:])


def test_syn_reply_for_unknown_stream_or_duplicate_is_ignored() -> None:
    client = SpdyConnection(Role.CLIENT)
    sid = client.open_stream({})
    replier = FakePeer()
    assert client.receive_data(encode_syn_reply(9, replier.compressor.compress({}))) == []
    assert client.receive_data(encode_syn_reply(sid, replier.compressor.compress({}))) == [
        StreamReplied(sid, {})
    ]
    assert client.receive_data(encode_syn_reply(sid, replier.compressor.compress({"a": "b"}))) == []
    assert client.stream_state(sid) is StreamState.OPEN


def test_rst_stream_for_unknown_stream_is_ignored() -> None:
    client, _server = pair()
    assert client.receive_data(rst(7, RstStatus.CANCEL)) == []


def test_settings_and_window_update_are_reported_and_otherwise_ignored() -> None:
    _client, server, sid = established()
    settings = encode_settings([SettingsEntry(7, 65536), SettingsEntry(4, 100, 1)])
    assert server.receive_data(settings) == [SettingsReceived({7: 65536, 4: 100})]
    assert server.receive_data(encode_window_update(sid, 1)) == [WindowUpdateReceived(sid, 1)]
    # No send window: far more than 64 KiB goes out without any WINDOW_UPDATE.
    server.send_data(sid, bytes(1 << 20))
    assert len(server.data_to_send()) == (1 << 20) + 32 * 8


def test_headers_frames_are_decompressed_then_ignored() -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER)
    server.receive_data(peer.syn_stream(1, {"a": "1"}))
    headers = encode_headers(1, peer.compressor.compress({"x": "y"}))
    assert server.receive_data(headers) == []
    # The context stayed in step: the next block from the same compressor decodes.
    assert server.receive_data(peer.syn_stream(3, {"b": "2"})) == [StreamOpened(3, {"b": "2"})]
    assert server.data_to_send() == b""


def test_goaway_stops_input() -> None:
    client, _server, sid = established()
    data = encode_goaway(1, 0) + encode_data(sid, b"ignored") + b"\xff garbage"
    assert client.receive_data(data) == [GoAwayReceived(1, 0)]
    assert client.closed
    assert client.receive_data(encode_ping(2)) == []
    assert client.data_to_send() == b""
    client.send_data(sid, b"still allowed")  # in-flight streams may finish


def test_receive_after_eof_is_misuse() -> None:
    client, _ = pair()
    assert client.receive_eof() == [ConnectionClosed()]
    with pytest.raises(LocalProtocolError):
        client.receive_data(b"x")


# --- connection errors -----------------------------------------------------------------------

FATAL_INPUTS = {
    "noop frame": h("80 03 00 05 00 00 00 00"),
    "credential frame": h("80 03 00 0a 00 00 00 00"),
    "ping flags": h("80 03 00 06 01 00 00 04 00 00 00 01"),
    "ping id 0": h("80 03 00 06 00 00 00 04 00 00 00 00"),
    "rst status 0": h("80 03 00 03 00 00 00 08 00 00 00 01 00 00 00 00"),
    "rst stream 0": h("80 03 00 03 00 00 00 08 00 00 00 00 00 00 00 05"),
    "goaway length": h("80 03 00 07 00 00 00 04 00 00 00 00"),
    "window_update flags": h("80 03 00 09 01 00 00 08 00 00 00 01 00 00 00 01"),
    "bad header block": h("80 03 00 01 00 00 00 0e 00 00 00 03 00 00 00 00 00 00 de ad be ef"),
}


@pytest.mark.parametrize("wire", FATAL_INPUTS.values(), ids=FATAL_INPUTS.keys())
def test_connection_errors_queue_goaway_and_kill_the_connection(wire: bytes) -> None:
    peer = FakePeer()
    server = SpdyConnection(Role.SERVER)
    server.receive_data(peer.syn_stream(1, {}))
    with pytest.raises(SpdyConnectionError) as info:
        server.receive_data(wire)
    assert info.value.goaway_status == GoAwayStatus.PROTOCOL_ERROR
    assert server.data_to_send() == goaway(1, GoAwayStatus.PROTOCOL_ERROR)
    assert server.closed
    with pytest.raises(SpdyConnectionError):
        server.receive_data(encode_ping(1))
    with pytest.raises(LocalProtocolError):
        server.reply(1)
    with pytest.raises(LocalProtocolError):
        server.ping()
    server.reset_stream(1)  # cleanup stays possible and sends nothing
    server.goaway()
    assert server.data_to_send() == b""


def test_unknown_control_type_fails_before_its_body_arrives() -> None:
    _, server = pair()
    with pytest.raises(SpdyConnectionError):
        server.receive_data(h("80 03 00 0b 00 10 00 00"))


def test_oversized_control_frame_fails_on_its_header() -> None:
    _, server = pair()
    length = (MAX_CONTROL_FRAME_LENGTH + 1).to_bytes(3, "big")
    with pytest.raises(SpdyConnectionError):
        server.receive_data(h("80 03 00 01 00") + length)


def test_events_before_the_fault_travel_with_the_error() -> None:
    _client, server, sid = established()
    with pytest.raises(SpdyConnectionError) as info:
        server.receive_data(encode_data(sid, b"ok") + h("80 03 00 05 00 00 00 00"))
    assert info.value.events == [DataReceived(sid, b"ok")]


def test_goaway_already_sent_is_not_repeated_on_error() -> None:
    _, server = pair()
    server.goaway()
    server.data_to_send()
    with pytest.raises(SpdyConnectionError):
        server.receive_data(h("80 03 00 05 00 00 00 00"))
    assert server.data_to_send() == b""


# --- the state table -------------------------------------------------------------------------

REMOTE_INPUTS = [i for i in StreamInput if i not in LOCAL_INPUTS]
SYN_INPUTS = {StreamInput.RECV_SYN_STREAM, StreamInput.RECV_SYN_STREAM_UNIDIRECTIONAL}


@pytest.mark.parametrize("state", list(StreamState))
@pytest.mark.parametrize("kind", [i for i in REMOTE_INPUTS if i not in SYN_INPUTS])
def test_table_covers_every_remote_input(state: StreamState, kind: StreamInput) -> None:
    assert (state, kind) in TRANSITIONS


def test_table_has_no_local_transitions_out_of_closed() -> None:
    assert not [
        key for key in TRANSITIONS if key[0] is StreamState.CLOSED and key[1] in LOCAL_INPUTS
    ]


def _in_state(state: StreamState) -> tuple[SpdyConnection, int]:
    """A connection holding stream `sid` in `state`, reached only through the public API."""
    client, server = pair()
    peer = FakePeer()
    if state is StreamState.IDLE:
        return server, 1
    if state is StreamState.AWAITING_REPLY:
        return client, client.open_stream({})
    if state is StreamState.AWAITING_REPLY_HALF_CLOSED_LOCAL:
        return client, client.open_stream({}, fin=True)
    if state is StreamState.HALF_CLOSED_LOCAL:
        server.receive_data(peer.syn_stream(1, {}, flags=FLAG_UNIDIRECTIONAL))
        return server, 1
    flags = FLAG_FIN if state.name.endswith("REMOTE") else 0
    server.receive_data(peer.syn_stream(1, {}, flags=flags))
    if state in (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE):
        server.reply(1)
    if state is StreamState.CLOSED:
        server.reset_stream(1)
    return server, 1


ACTIONS: dict[StreamInput, Callable[[SpdyConnection, int], object]] = {
    StreamInput.SEND_SYN_REPLY: lambda c, sid: c.reply(sid),
    StreamInput.SEND_DATA: lambda c, sid: c.send_data(sid, b"x"),
    StreamInput.SEND_FIN: lambda c, sid: c.end_stream(sid),
    StreamInput.SEND_RST: lambda c, sid: c.reset_stream(sid),
}


@pytest.mark.parametrize("state", list(StreamState))
@pytest.mark.parametrize("kind", list(ACTIONS))
def test_every_local_pair_follows_the_table(state: StreamState, kind: StreamInput) -> None:
    conn, sid = _in_state(state)
    assert conn.stream_state(sid) is state
    conn.data_to_send()
    expected = TRANSITIONS.get((state, kind))
    if kind is StreamInput.SEND_RST and state in (StreamState.IDLE, StreamState.CLOSED):
        ACTIONS[kind](conn, sid)  # documented no-op
        assert conn.data_to_send() == b""
        assert conn.stream_state(sid) is state
    elif expected is None:
        error = StreamClosedError if state is StreamState.CLOSED else LocalProtocolError
        with pytest.raises(error):
            ACTIONS[kind](conn, sid)
        assert conn.data_to_send() == b""
        assert conn.stream_state(sid) is state
    else:
        ACTIONS[kind](conn, sid)
        assert conn.data_to_send() != b""
        assert conn.stream_state(sid) is expected[0]


def test_input_buffers_may_be_reused_by_the_caller() -> None:
    _client, server, sid = established()
    wire = bytearray(encode_data(sid, b"hello") + encode_ping(1))
    first = server.receive_data(memoryview(wire)[:15])  # leaves a partial PING behind
    wire[13:] = bytes(len(wire) - 13)  # the caller scribbles over its buffer
    rest = server.receive_data(bytearray(encode_ping(1)[2:]))
    assert first == [DataReceived(sid, b"hello")]
    assert rest == [PingReceived(1)]


def test_stream_ids_run_out_at_2_to_the_31() -> None:
    client = SpdyConnection(Role.CLIENT)
    client._next_stream_id = 0x7FFFFFFF  # opening 2**30 streams first would take too long
    assert client.open_stream({}) == 0x7FFFFFFF
    with pytest.raises(LocalProtocolError):
        client.open_stream({})
