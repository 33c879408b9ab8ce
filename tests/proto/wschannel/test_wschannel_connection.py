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
