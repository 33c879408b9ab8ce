"""The SPDY-in-WebSocket tunnel (k8s-streaming.md 6.2, kubectl-api-surface.md 6.5)."""

from __future__ import annotations

import pytest

from podgate.proto.errors import RemoteProtocolError
from podgate.proto.wschannel import (
    CloseReceived,
    PingReceived,
    PongReceived,
    Role,
    TunnelConnection,
    TunnelData,
    WebSocketError,
    tunnel_protocol,
)

RFC_MASK = bytes.fromhex("37fa213d")
# A SPDY/3 SYN_STREAM (k8s-streaming.md 1.1): version 3 control frame, type 1, flags 0,
# length 51 = stream id, associated id, priority, slot (10 bytes) + a 41-byte header block.
SYN_STREAM = bytes.fromhex("800300010000003300000001000000000000") + bytes(41)


def masked(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    n = len(payload)
    assert n < 126
    body = bytes(b ^ RFC_MASK[i % 4] for i, b in enumerate(payload))
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | n]) + RFC_MASK + body


def test_protocol_name() -> None:
    assert tunnel_protocol("portforward.k8s.io") == "SPDY/3.1+portforward.k8s.io"


def test_kubectl_style_tiny_messages_form_one_stream() -> None:
    # kubectl writes one message per framer field: 2, 2, 4, 4, 4, 1, 1 bytes, then the header
    # block, and zero-length messages for empty DATA payloads.
    cuts = [2, 2, 4, 4, 4, 1, 1, len(SYN_STREAM) - 18]
    wire = b""
    pos = 0
    for size in cuts:
        wire += masked(0x2, SYN_STREAM[pos : pos + size]) + masked(0x2, b"")
        pos += size
    srv = TunnelConnection(Role.SERVER)
    events = srv.receive_data(wire)
    assert all(isinstance(e, TunnelData) for e in events)
    assert len(events) == len(cuts)
    assert b"".join(e.data for e in events if isinstance(e, TunnelData)) == SYN_STREAM


def test_partial_frames_stream_without_waiting_for_the_message() -> None:
    cli = TunnelConnection(Role.CLIENT)
    wire = bytes([0x82, 0x7E]) + (300).to_bytes(2, "big") + bytes(range(100)) * 3
    first = cli.receive_data(wire[:150])
    assert first == [TunnelData(wire[4:150])]
    rest = cli.receive_data(wire[150:])
    assert rest == [TunnelData(wire[150:])]


def test_text_message_is_an_error() -> None:
    srv = TunnelConnection(Role.SERVER)
    with pytest.raises(RemoteProtocolError) as info:
        srv.receive_data(masked(0x1, b"hello"))
    assert isinstance(info.value, WebSocketError)
    assert info.value.message == "invalid message type received"


def test_send_is_one_binary_message_per_chunk() -> None:
    srv = TunnelConnection(Role.SERVER)
    srv.send(SYN_STREAM[:10])
    srv.send(b"")
    srv.send(SYN_STREAM[10:20])
    assert srv.data_to_send() == b"\x82\x0a" + SYN_STREAM[:10] + b"\x82\x0a" + SYN_STREAM[10:20]


def test_pair_with_ping_and_close() -> None:
    cli, srv = TunnelConnection(Role.CLIENT), TunnelConnection(Role.SERVER)
    cli.send(b"abc")
    cli.ping(b"1")
    assert srv.receive_data(cli.data_to_send()) == [TunnelData(b"abc"), PingReceived(b"1")]
    srv.send(b"xyz")
    srv.close()
    assert cli.receive_data(srv.data_to_send()) == [
        PongReceived(b"1"),
        TunnelData(b"xyz"),
        CloseReceived(1000, ""),
    ]
    assert srv.receive_data(cli.data_to_send()) == [CloseReceived(1000, "")]


def test_send_buffers_is_one_message_of_their_concatenation() -> None:
    srv = TunnelConnection(Role.SERVER)
    body = bytes(range(256)) * 4
    srv.send_buffers([SYN_STREAM[:8], b"", memoryview(body), bytearray(b"tail")])
    srv.send_buffers([b"", b""])  # nothing at all
    buffers = srv.buffers_to_send()
    assert buffers[0] == b"\x82\x7e" + (8 + 1024 + 4).to_bytes(2, "big")
    assert b"".join(buffers[1:]) == SYN_STREAM[:8] + body + b"tail"
    cli = TunnelConnection(Role.CLIENT)
    cli.send_buffers([b"ab", b"c", memoryview(b"defgh")])
    cli.send(bytearray(b"ij"))
    events = TunnelConnection(Role.SERVER).receive_data(cli.data_to_send())
    assert events == [TunnelData(b"abcdefgh"), TunnelData(b"ij")]


def test_large_masked_message_in_uneven_pieces() -> None:
    cli = TunnelConnection(Role.CLIENT)
    data = bytes(range(251)) * 400  # 100400 bytes: a 64-bit length
    cli.send(data)
    wire = cli.data_to_send()
    assert wire[1] == 0x80 | 127
    srv = TunnelConnection(Role.SERVER)
    got = b""
    for start in range(0, len(wire), 777):
        for event in srv.receive_data(wire[start : start + 777]):
            assert isinstance(event, TunnelData)
            got += event.data
    assert got == data
