"""ChannelConnection: RFC 6455 byte tables, then a client and a server talking in memory.

Frames are built here by hand from RFC 6455 section 5.2, independent of wsproto; the golden
frames are the examples of RFC 6455 section 5.7.
"""

from __future__ import annotations

import struct

import pytest

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.wschannel import (
    MAX_MESSAGE_BYTES,
    MAX_SEND_PAYLOAD_BYTES,
    ChannelClosed,
    ChannelConnection,
    ChannelData,
    CloseCode,
    CloseReceived,
    EndpointState,
    Event,
    PingReceived,
    PongReceived,
    Role,
    WebSocketError,
)

TEXT, BINARY, CLOSE_OP, PING, PONG, CONT = 0x1, 0x2, 0x8, 0x9, 0xA, 0x0
RFC_MASK = bytes.fromhex("37fa213d")


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bytes | None = None) -> bytes:
    head = bytes([(0x80 if fin else 0) | opcode])
    bit = 0x80 if mask is not None else 0
    n = len(payload)
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([bit | 127]) + n.to_bytes(8, "big")
    if mask is not None:
        head += mask
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + payload


def masked(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    return frame(opcode, payload, fin=fin, mask=RFC_MASK)


def parse_frames(data: bytes) -> list[tuple[bool, int, bytes]]:
    """(fin, opcode, unmasked payload) of every frame in `data`."""
    frames = []
    i = 0
    while i < len(data):
        fin, opcode = bool(data[i] & 0x80), data[i] & 0x0F
        has_mask, n = bool(data[i + 1] & 0x80), data[i + 1] & 0x7F
        i += 2
        if n == 126:
            n = int.from_bytes(data[i : i + 2], "big")
            i += 2
        elif n == 127:
            n = int.from_bytes(data[i : i + 8], "big")
            i += 8
        key = data[i : i + 4] if has_mask else b"\0\0\0\0"
        i += 4 if has_mask else 0
        payload = bytes(b ^ key[j % 4] for j, b in enumerate(data[i : i + n]))
        i += n
        frames.append((fin, opcode, payload))
    return frames


def close_payload(code: int) -> bytes:
    return struct.pack("!H", code)


def server(
    protocol: str = "v5.channel.k8s.io", max_message_bytes: int = MAX_MESSAGE_BYTES
) -> ChannelConnection:
    return ChannelConnection(Role.SERVER, protocol, max_message_bytes=max_message_bytes)


def client(protocol: str = "v5.channel.k8s.io") -> ChannelConnection:
    return ChannelConnection(Role.CLIENT, protocol)


# --- byte tables ------------------------------------------------------------------------------


def test_rfc_examples_decode() -> None:
    # RFC 6455 5.7: a masked "Hello" text frame from a client. Under a binary protocol the
    # first character is the channel ('H' = 72), the rest the payload.
    srv = server("v4.channel.k8s.io")
    assert srv.receive_data(bytes.fromhex("818537fa213d7f9f4d5158")) == [
        ChannelData(channel=72, data=b"ello")
    ]
    # RFC 6455 5.7: an unmasked fragmented text message, to a v4 client.
    cli = client("v4.channel.k8s.io")
    assert cli.receive_data(bytes.fromhex("010348656c")) == []
    assert cli.receive_data(bytes.fromhex("80026c6f")) == [ChannelData(channel=72, data=b"ello")]


def test_server_output_bytes() -> None:
    srv = server("v5.channel.k8s.io")
    srv.send_ready(1)
    assert srv.data_to_send() == b"\x82\x01\x01"
    srv.send(1, b"hi\n")
    srv.send(3, b'{"metadata":{},"status":"Success"}')
    status = b'\x03{"metadata":{},"status":"Success"}'
    assert srv.data_to_send() == b"\x82\x04\x01hi\n" + b"\x82" + bytes([len(status)]) + status
    srv.close()
    assert srv.data_to_send() == b"\x88\x02\x03\xe8"


def test_base64_server_output_bytes() -> None:
    srv = server("v4.base64.channel.k8s.io")
    srv.send_ready(1)
    srv.send(1, b"\n")
    assert srv.data_to_send() == b"\x81\x011" + b"\x81\x051Cg=="
    assert srv.receive_data(masked(TEXT, b"0Zm9vCg==")) == [ChannelData(0, b"foo\n")]


def test_kubectl_stdin_then_eof() -> None:
    srv = server()
    events = srv.receive_data(masked(BINARY, b"\x00input-data\n") + masked(BINARY, b"\xff\x00"))
    assert events == [ChannelData(0, b"input-data\n"), ChannelClosed(0)]


def test_python_client_text_frames_are_accepted() -> None:
    srv = server("v4.channel.k8s.io")
    assert srv.receive_data(masked(TEXT, b"\x00echo hi\n")) == [ChannelData(0, b"echo hi\n")]


@pytest.mark.parametrize("payload", [b"\xff", b"\xff\x00\x00", b"\xff\x05", b"\xff\xff"])
def test_bad_v5_close_kills_the_connection(payload: bytes) -> None:
    srv = server()
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(masked(BINARY, payload))
    assert info.value.close_code == CloseCode.PROTOCOL_ERROR
    assert srv.state is EndpointState.FAILED
    assert parse_frames(srv.data_to_send())[0][:2] == (True, CLOSE_OP)
    with pytest.raises(LocalProtocolError):
        srv.receive_data(b"")


def test_channel_255_is_plain_data_before_v5() -> None:
    srv = server("v4.channel.k8s.io")
    assert srv.receive_data(masked(BINARY, b"\xff\x00")) == [ChannelData(255, b"\x00")]


def test_empty_messages_are_ignored() -> None:
    srv = server()
    assert srv.receive_data(masked(BINARY, b"") + masked(TEXT, b"")) == []


def test_v5_client_rejects_text() -> None:
    cli = client("v5.channel.k8s.io")
    with pytest.raises(WebSocketError) as info:
        cli.receive_data(frame(TEXT, b"\x01hi"))
    assert info.value.close_code == CloseCode.UNSUPPORTED_DATA
    assert parse_frames(cli.data_to_send()) == [
        (True, CLOSE_OP, close_payload(1003) + b"text message on a v5 channel connection")
    ]


def test_ping_is_answered() -> None:
    cli = client()
    # RFC 6455 5.7: unmasked ping "Hello".
    assert cli.receive_data(bytes.fromhex("890548656c6c6f")) == [PingReceived(b"Hello")]
    assert parse_frames(cli.data_to_send()) == [(True, PONG, b"Hello")]
    srv = server()
    # RFC 6455 5.7: masked pong "Hello".
    assert srv.receive_data(bytes.fromhex("8a8537fa213d7f9f4d5158")) == [PongReceived(b"Hello")]
    assert srv.data_to_send() == b""


def test_fragmented_binary_with_interleaved_ping() -> None:
    srv = server()
    data = (
        masked(BINARY, b"\x01ab", fin=False)
        + masked(PING, b"p")
        + masked(CONT, b"cd", fin=False)
        + masked(CONT, b"ef")
    )
    assert srv.receive_data(data) == [PingReceived(b"p"), ChannelData(1, b"abcdef")]


def test_oversize_message_closes_with_1009() -> None:
    srv = server(max_message_bytes=10)
    assert srv.receive_data(masked(BINARY, b"\x00" + b"x" * 9)) == [ChannelData(0, b"x" * 9)]
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(masked(BINARY, b"\x00" + b"x" * 10))
    assert isinstance(info.value, RemoteProtocolError)
    assert info.value.close_code == 1009
    frames = parse_frames(srv.data_to_send())
    assert frames[0][1] == CLOSE_OP
    assert frames[0][2][:2] == b"\x03\xf1"


def test_oversize_across_fragments() -> None:
    srv = server(max_message_bytes=10)
    assert srv.receive_data(masked(BINARY, b"\x00" + b"x" * 5, fin=False)) == []
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(masked(CONT, b"y" * 5))
    assert info.value.close_code == CloseCode.MESSAGE_TOO_BIG


def test_default_limit_is_32_mib() -> None:
    assert MAX_MESSAGE_BYTES == 32 * 1024 * 1024
    assert server().max_message_bytes == MAX_MESSAGE_BYTES


def test_unmasked_client_frame_is_a_protocol_error() -> None:
    srv = server()
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(frame(BINARY, b"\x00x"))
    assert info.value.close_code == CloseCode.PROTOCOL_ERROR


def test_reserved_opcode_is_a_protocol_error() -> None:
    cli = client()
    with pytest.raises(RemoteProtocolError):
        cli.receive_data(frame(0x3, b"x"))


def test_invalid_utf8_text_is_1007() -> None:
    srv = server("v4.channel.k8s.io")
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(masked(TEXT, b"\x00\xff"))
    assert info.value.close_code == CloseCode.INVALID_PAYLOAD


def test_send_rules() -> None:
    srv = server()
    srv.send(1, b"")
    assert srv.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        srv.send(255, b"\x00")
    with pytest.raises(LocalProtocolError):
        srv.close_channel(0)
    with pytest.raises(LocalProtocolError):
        client("v4.channel.k8s.io").close_channel(0)
    with pytest.raises(LocalProtocolError):
        client().close_channel(5)


def test_receive_eof_is_abnormal_closure() -> None:
    srv = server()
    assert srv.receive_eof() == [CloseReceived(1006, "")]
    assert srv.state is EndpointState.CLOSED
    assert srv.receive_eof() == []
    # None is end of stream too, as in wsproto.
    assert client().receive_data(None) == [CloseReceived(1006, "")]


def test_can_close_channels() -> None:
    assert client("v5.channel.k8s.io").can_close_channels
    assert not client("v4.channel.k8s.io").can_close_channels
    assert not server("v5.channel.k8s.io").can_close_channels


# --- client <-> server in memory --------------------------------------------------------------


def pump(src: ChannelConnection, dst: ChannelConnection) -> list[Event]:
    return dst.receive_data(src.data_to_send())


def test_exec_exchange_both_ways() -> None:
    cli, srv = client(), server()
    srv.send_ready(1)
    srv.send(1, b"out")
    srv.send(2, b"err")
    assert pump(srv, cli) == [ChannelData(1, b""), ChannelData(1, b"out"), ChannelData(2, b"err")]
    cli.send(0, b"in")
    cli.send(4, b'{"Width":80,"Height":24}\n')
    cli.close_channel(0)
    assert pump(cli, srv) == [
        ChannelData(0, b"in"),
        ChannelData(4, b'{"Width":80,"Height":24}\n'),
        ChannelClosed(0),
    ]
    cli.ping(b"k")
    assert pump(cli, srv) == [PingReceived(b"k")]
    assert pump(srv, cli) == [PongReceived(b"k")]
    srv.send(3, b'{"metadata":{},"status":"Success"}')
    srv.close(1000)
    states = [srv.state]
    assert pump(srv, cli) == [
        ChannelData(3, b'{"metadata":{},"status":"Success"}'),
        CloseReceived(1000, ""),
    ]
    assert cli.state is EndpointState.CLOSED
    assert pump(cli, srv) == [CloseReceived(1000, "")]
    states.append(srv.state)
    assert states == [EndpointState.CLOSING, EndpointState.CLOSED]
    with pytest.raises(LocalProtocolError):
        srv.send(1, b"late")
    srv.close()  # a no-op once closed
    srv.ping()  # likewise
    assert srv.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        srv.ping(b"x" * 126)


def test_client_initiated_close_is_echoed() -> None:
    cli, srv = client(), server()
    cli.close(1001, "bye")
    assert pump(cli, srv) == [CloseReceived(1001, "bye")]
    assert pump(srv, cli) == [CloseReceived(1001, "bye")]


def test_large_send_is_split_and_reassembles_as_stream() -> None:
    cli, srv = client(), server()
    data = bytes(range(256)) * ((MAX_SEND_PAYLOAD_BYTES * 2 + 300) // 256)
    srv.send(1, data)
    events = pump(srv, cli)
    assert len(events) == 3
    assert all(isinstance(e, ChannelData) and e.channel == 1 for e in events)
    assert b"".join(e.data for e in events if isinstance(e, ChannelData)) == data


def test_base64_pair() -> None:
    cli, srv = client("base64.channel.k8s.io"), server("base64.channel.k8s.io")
    cli.send(0, b"\x00\xff binary")
    assert pump(cli, srv) == [ChannelData(0, b"\x00\xff binary")]
    srv.send(2, b"oops")
    assert pump(srv, cli) == [ChannelData(2, b"oops")]


def test_data_after_close_handshake_is_remote_error() -> None:
    cli, srv = client(), server()
    srv.close()
    pump(srv, cli)
    pump(cli, srv)
    with pytest.raises(RemoteProtocolError):
        srv.receive_data(masked(BINARY, b"\x00late"))


# --- framing rules (RFC 6455 5.2, 5.4, 5.5, 7.4) ----------------------------------------------


def test_rfc_256_byte_and_64_kib_frames() -> None:
    # RFC 6455 5.7: 256 bytes and 64 KiB of binary data, each in one unmasked frame; under a
    # binary channel protocol the first byte is the channel.
    for size, head in ((256, "827e0100"), (65536, "827f0000000000010000")):
        body = bytes([2]) + bytes(range(256)) * (size // 256 - 1) + bytes(255)
        wire = bytes.fromhex(head) + body
        assert len(body) == size
        expected = [ChannelData(2, body[1:])]
        assert client("v4.channel.k8s.io").receive_data(wire) == expected
        # The same bytes fed one header byte at a time, then in uneven pieces.
        cli = client("v4.channel.k8s.io")
        events: list[Event] = []
        for i in range(len(head) // 2):
            events += cli.receive_data(wire[i : i + 1])
        rest = wire[len(head) // 2 :]
        for start in range(0, len(rest), 1000):
            events += cli.receive_data(rest[start : start + 1000])
        assert events == expected


@pytest.mark.parametrize(
    "wire",
    [
        bytes.fromhex("827e007d") + bytes(125),  # 16-bit length for a 7-bit size
        bytes.fromhex("827f000000000000ffff") + bytes(65535),  # 64-bit for a 16-bit size
        bytes.fromhex("827f8000000000000000"),  # 64-bit length with the top bit set
        bytes.fromhex("c201") + b"\x01",  # RSV1 without an extension
        bytes.fromhex("a201") + b"\x01",  # RSV2
        bytes.fromhex("9201") + b"\x01",  # RSV3
        bytes.fromhex("8301") + b"\x01",  # reserved data opcode
        bytes.fromhex("8b00"),  # reserved control opcode
        bytes.fromhex("0900"),  # fragmented ping
        bytes.fromhex("897e007e") + bytes(126),  # ping over 125 bytes
        bytes.fromhex("8001") + b"\x01",  # continuation with no message to continue
        bytes.fromhex("0201") + b"\x01" + bytes.fromhex("8201") + b"\x01",  # new message early
        bytes.fromhex("828137fa213d") + b"\x01",  # masked frame from a server
        bytes.fromhex("8801") + b"\x03",  # close payload of 1 byte
    ],
)
def test_framing_errors_close_with_1002(wire: bytes) -> None:
    cli = client("v4.channel.k8s.io")
    with pytest.raises(WebSocketError) as info:
        cli.receive_data(wire)
    assert info.value.close_code == CloseCode.PROTOCOL_ERROR
    assert cli.state is EndpointState.FAILED
    frames = parse_frames(cli.data_to_send())
    assert [(fin, op, body[:2]) for fin, op, body in frames] == [
        (True, CLOSE_OP, close_payload(1002))
    ]


@pytest.mark.parametrize("code", [0, 999, 1004, 1005, 1006, 1014, 1015, 1016, 2999, 5000, 65535])
def test_close_codes_a_peer_may_not_send(code: int) -> None:
    with pytest.raises(WebSocketError) as info:
        server().receive_data(masked(CLOSE_OP, close_payload(code)))
    assert info.value.close_code == CloseCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    "code", [1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1013, 3000, 4999]
)
def test_close_codes_a_peer_may_send_are_echoed(code: int) -> None:
    srv = server()
    assert srv.receive_data(masked(CLOSE_OP, close_payload(code) + b"why")) == [
        CloseReceived(code, "why")
    ]
    assert parse_frames(srv.data_to_send()) == [(True, CLOSE_OP, close_payload(code) + b"why")]
    assert srv.state is EndpointState.CLOSED


def test_close_without_code_is_1005_and_answered_empty() -> None:
    srv = server()
    assert srv.receive_data(masked(CLOSE_OP, b"")) == [CloseReceived(1005, "")]
    assert srv.data_to_send() == b"\x88\x00"


def test_close_reason_must_be_utf8() -> None:
    with pytest.raises(WebSocketError) as info:
        server().receive_data(masked(CLOSE_OP, close_payload(1000) + b"\xff"))
    assert info.value.close_code == CloseCode.INVALID_PAYLOAD


def test_local_only_close_code_goes_out_as_1000() -> None:
    srv = server()
    srv.close(CloseCode.ABNORMAL, "x" * 300)
    [(fin, opcode, body)] = parse_frames(srv.data_to_send())
    assert (fin, opcode, body[:2]) == (True, CLOSE_OP, close_payload(1000))
    assert body[2:] == b"x" * 123  # 125-byte control payload limit


def test_bytes_after_the_close_frame_are_ignored() -> None:
    srv = server()
    events = srv.receive_data(masked(CLOSE_OP, close_payload(1000)) + masked(BINARY, b"\x01x"))
    assert events == [CloseReceived(1000, "")]


def test_ping_while_closing_is_reported_not_answered() -> None:
    srv = server()
    srv.close()
    srv.data_to_send()
    assert srv.receive_data(masked(PING, b"p") + masked(BINARY, b"\x00late")) == [
        PingReceived(b"p"),
        ChannelData(0, b"late"),
    ]
    assert srv.data_to_send() == b""


def test_channel_byte_may_arrive_after_an_empty_fragment() -> None:
    srv = server()
    wire = masked(BINARY, b"", fin=False) + masked(CONT, b"\x01a", fin=False)
    wire += masked(CONT, b"bc")
    assert srv.receive_data(wire) == [ChannelData(1, b"abc")]
    # Byte by byte, through every partial header and payload state.
    srv = server()
    events: list[Event] = []
    for i in range(len(wire)):
        events += srv.receive_data(wire[i : i + 1])
    assert events == [ChannelData(1, b"abc")]


def test_invalid_utf8_split_across_fragments_is_1007() -> None:
    srv = server("v4.channel.k8s.io")
    # "\xe2\x82" starts a 3-byte sequence; "(" cannot continue it.
    assert srv.receive_data(masked(TEXT, b"\x00\xe2", fin=False)) == []
    with pytest.raises(WebSocketError) as info:
        srv.receive_data(masked(CONT, b"\x82("))
    assert info.value.close_code == CloseCode.INVALID_PAYLOAD


def test_valid_utf8_split_across_fragments_is_one_text_message() -> None:
    srv = server("v4.channel.k8s.io")
    euro = "€".encode()
    wire = masked(TEXT, b"\x00" + euro[:1], fin=False) + masked(CONT, euro[1:])
    assert srv.receive_data(wire) == [ChannelData(0, euro)]


# --- output: masking and copies ---------------------------------------------------------------


def test_client_frames_are_masked_with_fresh_keys() -> None:
    cli = client()
    cli.send(1, b"abc")
    cli.send(1, b"abc")
    cli.ping(b"k")
    wire = cli.data_to_send()
    assert parse_frames(wire) == [
        (True, BINARY, b"\x01abc"),
        (True, BINARY, b"\x01abc"),
        (True, PING, b"k"),
    ]
    # Mask bit set, 4-byte key, then the masked channel byte and payload.
    assert wire[1] == 0x80 | 4
    assert wire[0:2] == wire[10:12]
    assert wire[2:6] != wire[12:16]  # 2^-32 chance of a false failure


def test_server_queues_immutable_payloads_without_copying() -> None:
    srv = server()
    data = bytes(range(256)) * 64
    srv.send(1, data)
    head, body = srv.buffers_to_send()
    assert head == b"\x82\x7e\x40\x01\x01"  # 16-bit length 16385 = channel byte + 16 KiB
    assert body is data or (isinstance(body, memoryview) and body.obj is data)
    assert bytes(body) == data


def test_mutable_payloads_are_copied_before_queueing() -> None:
    srv = server()
    data = bytearray(b"x" * 1000)
    srv.send(1, data)
    srv.send(1, memoryview(data)[:600])
    data[:] = b"y" * 1000
    frames = parse_frames(srv.data_to_send())
    assert frames == [(True, BINARY, b"\x01" + b"x" * 1000), (True, BINARY, b"\x01" + b"x" * 600)]


def test_send_rejects_channels_out_of_range() -> None:
    with pytest.raises(LocalProtocolError):
        server("v4.channel.k8s.io").send(256, b"x")
    with pytest.raises(LocalProtocolError):
        server("base64.channel.k8s.io").send(80, b"x")
