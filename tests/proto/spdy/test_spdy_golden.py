"""The kubectl 1.33 exec trace from the reference (§1.5), byte for byte, both directions."""

from __future__ import annotations

from spdy_support import h

from podgate.proto.spdy import (
    DataReceived,
    GoAwayReceived,
    HeaderCompressor,
    PingAcknowledged,
    PingReceived,
    Role,
    RstStatus,
    SpdyConnection,
    StreamOpened,
    StreamReplied,
    StreamReset,
    StreamState,
)

SYN_STREAM_ERROR = h(
    "80 03 00 01 | 00 00 00 29 | 00 00 00 01 | 00 00 00 00 | 00 | 00 | 78 f9 e3 c6 a7 c2 62 60 60"
    " 60 04 a7 b3 92 a2 d4 c4 5c 68 51 c2 9a 0a 0a 68 00 00 00 00 ff ff"
)
SYN_REPLY_1 = h(
    "80 03 00 02 | 00 00 00 14 | 00 00 00 01 | 78 f9 e3 c6 a7 c2 02 a6 23 06 00 00 00 00 ff ff"
)
SYN_STREAM_STDOUT = h(
    "80 03 00 01 00 00 00 19 00 00 00 03 00 00 00 00 00 00 c2 2a c5 56 5c 92 92 5f 5a 02 00 00"
    " 00 ff ff"
)
SYN_REPLY_3 = h("80 03 00 02 00 00 00 0c 00 00 00 03 02 01 00 00 00 00 ff ff")
RST_5_CANCEL = h("80 03 00 03 00 00 00 08 00 00 00 05 00 00 00 05")
GOAWAY_OK_0 = h("80 03 00 07 00 00 00 08 00 00 00 00 00 00 00 00")
PING_1 = h("80 03 00 06 00 00 00 04 00 00 00 01")
DATA_FIN_1 = h("00 00 00 01 01 00 00 00")


def test_frame_lengths_in_the_trace_are_consistent() -> None:
    for frame in (SYN_STREAM_ERROR, SYN_REPLY_1, SYN_STREAM_STDOUT, SYN_REPLY_3, RST_5_CANCEL):
        assert int.from_bytes(frame[5:8], "big") == len(frame) - 8


def test_our_first_header_block_starts_with_the_kubectl_zlib_header() -> None:
    assert HeaderCompressor().compress({"streamtype": "error"})[:6] == h("78 f9 e3 c6 a7 c2")


def test_server_parses_kubectl_syn_streams_through_one_context() -> None:
    server = SpdyConnection(Role.SERVER)
    assert server.receive_data(SYN_STREAM_ERROR) == [StreamOpened(1, {"streamtype": "error"})]
    assert server.receive_data(SYN_STREAM_STDOUT) == [StreamOpened(3, {"streamtype": "stdout"})]
    assert server.data_to_send() == b""
    assert server.stream_state(1) is StreamState.REPLY_PENDING
    assert server.last_peer_stream_id == 3


def test_server_parses_kubectl_syn_streams_byte_by_byte() -> None:
    server = SpdyConnection(Role.SERVER)
    events = []
    for byte in SYN_STREAM_ERROR + SYN_STREAM_STDOUT:
        events += server.receive_data(bytes([byte]))
    assert events == [
        StreamOpened(1, {"streamtype": "error"}),
        StreamOpened(3, {"streamtype": "stdout"}),
    ]


def test_server_replies_produce_the_trace_bytes() -> None:
    # The trace's SYN_REPLY frames were produced by Python's zlib with the settings in §1.4.
    server = SpdyConnection(Role.SERVER)
    server.receive_data(SYN_STREAM_ERROR)
    server.reply(1)
    assert server.data_to_send() == SYN_REPLY_1
    server.receive_data(SYN_STREAM_STDOUT)
    server.reply(3)
    assert server.data_to_send() == SYN_REPLY_3
    assert server.stream_state(3) is StreamState.OPEN


def test_client_parses_the_trace_syn_replies_as_empty_blocks() -> None:
    client = SpdyConnection(Role.CLIENT)
    assert client.open_stream({"streamtype": "error"}) == 1
    assert client.receive_data(SYN_REPLY_1) == [StreamReplied(1, {})]
    assert client.open_stream({"streamtype": "stdout"}) == 3
    assert client.receive_data(SYN_REPLY_3) == [StreamReplied(3, {})]
    assert client.stream_state(1) is StreamState.OPEN


def test_client_teardown_bytes() -> None:
    client = SpdyConnection(Role.CLIENT)
    for _ in range(3):
        client.open_stream({"streamtype": "x"})
    client.data_to_send()
    client.reset_stream(5, RstStatus.CANCEL)
    assert client.data_to_send() == RST_5_CANCEL
    assert client.stream_state(5) is StreamState.CLOSED
    client.goaway()
    assert client.data_to_send() == GOAWAY_OK_0


def test_client_ping_and_half_close_bytes() -> None:
    client = SpdyConnection(Role.CLIENT)
    assert client.ping() == 1
    assert client.data_to_send() == PING_1
    client.open_stream({"streamtype": "error"})
    client.data_to_send()
    client.receive_data(SYN_REPLY_1)
    client.end_stream(1)
    assert client.data_to_send() == DATA_FIN_1


def test_server_decodes_the_client_control_frames() -> None:
    server = SpdyConnection(Role.SERVER)
    server.receive_data(SYN_STREAM_ERROR)
    server.reply(1)
    server.data_to_send()
    assert server.receive_data(PING_1) == [PingReceived(1)]
    assert server.data_to_send() == PING_1  # echoed unchanged
    assert server.receive_data(DATA_FIN_1) == [DataReceived(1, b"", fin=True)]
    assert server.stream_state(1) is StreamState.HALF_CLOSED_REMOTE
    assert server.receive_data(h("80 03 00 03 00 00 00 08 00 00 00 01 00 00 00 05")) == [
        StreamReset(1, RstStatus.CANCEL)
    ]
    assert server.receive_data(GOAWAY_OK_0) == [GoAwayReceived(0, 0)]
    assert server.closed


def test_client_sees_its_ping_echoed() -> None:
    client = SpdyConnection(Role.CLIENT)
    client.ping()
    assert client.receive_data(PING_1) == [PingAcknowledged(1)]
    assert client.data_to_send() == PING_1  # only our own ping, no echo of the echo
