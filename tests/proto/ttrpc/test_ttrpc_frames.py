"""ttrpc frame and envelope bytes, checked against the layout in the reference (§5.1, §5.2)."""

from __future__ import annotations

import pytest

from podgate.proto.errors import LocalProtocolError
from podgate.proto.ttrpc import (
    FLAG_NO_DATA,
    FLAG_REMOTE_CLOSED,
    FLAG_REMOTE_OPEN,
    MAX_MESSAGE_LENGTH,
    Code,
    FrameHeader,
    MalformedEnvelopeError,
    MessageType,
    OversizedMessageError,
    RequestMode,
    RequestReceived,
    Role,
    TtrpcConnection,
    envelope_pb2,
    status_pb2,
)
from podgate.proto.ttrpc.frames import (
    decode_header,
    decode_request,
    decode_response,
    encode_frame,
    encode_header,
    encode_request,
    encode_response,
)

# --- the worked example (§5.2): Runtime.RegisterPlugin{plugin_name="logger", plugin_idx="10"}
# with a 5 s deadline. Everything below is written out by hand from the protobuf wire format.
SERVICE = "nri.pkg.api.v1alpha1.Runtime"
METHOD = "RegisterPlugin"
PAYLOAD = bytes.fromhex("0a 06 6c 6f 67 67 65 72 12 02 31 30")
FIVE_SECONDS_NS = 5_000_000_000
EXAMPLE_ENVELOPE = (
    b"\x0a\x1c"  # field 1 (service), length 28
    + SERVICE.encode()
    + b"\x12\x0e"  # field 2 (method), length 14
    + METHOD.encode()
    + b"\x1a\x0c"  # field 3 (payload), length 12
    + PAYLOAD
    + bytes.fromhex("20 80 e4 97 d0 12")  # field 4 (timeout_nano) varint 5 000 000 000
)
EXAMPLE_HEADER = bytes.fromhex("00 00 00 42 00 00 00 01 01 00")
EMPTY_RESPONSE_FRAME = bytes.fromhex("00 00 00 00 00 00 00 01 02 00")


def test_worked_example_payload_is_the_register_plugin_request() -> None:
    # plugin_name (field 1) = "logger", plugin_idx (field 2) = "10"
    assert PAYLOAD == b"\x0a\x06logger\x12\x0210"
    assert len(PAYLOAD) == 12


def test_worked_example_envelope_from_generated_request() -> None:
    request = envelope_pb2.Request(
        service=SERVICE, method=METHOD, payload=PAYLOAD, timeout_nano=FIVE_SECONDS_NS
    )
    data = request.SerializeToString()
    assert data == EXAMPLE_ENVELOPE
    assert len(data) == 66


def test_worked_example_envelope_from_encoder() -> None:
    assert (
        encode_request(SERVICE, METHOD, PAYLOAD, timeout_nano=FIVE_SECONDS_NS) == EXAMPLE_ENVELOPE
    )


def test_worked_example_whole_frame_from_client_core() -> None:
    client = TtrpcConnection(Role.CLIENT)
    stream_id = client.send_request(SERVICE, METHOD, PAYLOAD, timeout_nano=FIVE_SECONDS_NS)
    assert stream_id == 1
    assert client.data_to_send() == EXAMPLE_HEADER + EXAMPLE_ENVELOPE


def test_worked_example_parsed_by_server_core() -> None:
    server = TtrpcConnection(Role.SERVER)
    events = server.receive_data(EXAMPLE_HEADER + EXAMPLE_ENVELOPE)
    assert events == [
        RequestReceived(1, SERVICE, METHOD, PAYLOAD, FIVE_SECONDS_NS, (), RequestMode.UNARY)
    ]
    assert server.data_to_send() == b""


def test_empty_reply_is_a_zero_length_response_frame() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(EXAMPLE_HEADER + EXAMPLE_ENVELOPE)
    server.send_response(1, b"")
    assert server.data_to_send() == EMPTY_RESPONSE_FRAME


# --- header table: length(4, BE) | stream id(4, BE) | type(1) | flags(1)
HEADER_TABLE = [
    (0x42, 1, MessageType.REQUEST, 0x00, "00000042 00000001 01 00"),
    (0x10, 3, MessageType.REQUEST, FLAG_REMOTE_CLOSED, "00000010 00000003 01 01"),
    (0x10, 5, MessageType.REQUEST, FLAG_REMOTE_OPEN, "00000010 00000005 01 02"),
    (0x00, 1, MessageType.RESPONSE, 0x00, "00000000 00000001 02 00"),
    (0x1234, 0x01020305, MessageType.RESPONSE, 0x00, "00001234 01020305 02 00"),
    (0x05, 7, MessageType.DATA, 0x00, "00000005 00000007 03 00"),
    (0x05, 7, MessageType.DATA, FLAG_REMOTE_CLOSED, "00000005 00000007 03 01"),
    (0x00, 7, MessageType.DATA, FLAG_NO_DATA, "00000000 00000007 03 04"),
    (0x00, 7, MessageType.DATA, FLAG_REMOTE_CLOSED | FLAG_NO_DATA, "00000000 00000007 03 05"),
    (0x400000, 0xFFFFFFFF, MessageType.DATA, 0x00, "00400000 ffffffff 03 00"),
]


@pytest.mark.parametrize(("length", "stream_id", "kind", "flags", "wire"), HEADER_TABLE)
def test_header_table(length: int, stream_id: int, kind: int, flags: int, wire: str) -> None:
    data = bytes.fromhex(wire)
    assert len(data) == 10
    assert encode_header(length, stream_id, kind, flags) == data
    assert decode_header(data) == FrameHeader(length, stream_id, kind, flags)


def test_flag_and_type_values() -> None:
    assert (FLAG_REMOTE_CLOSED, FLAG_REMOTE_OPEN, FLAG_NO_DATA) == (0x01, 0x02, 0x04)
    assert [int(t) for t in MessageType] == [1, 2, 3]
    assert MAX_MESSAGE_LENGTH == 4194304


def test_decode_header_at_offset() -> None:
    data = b"xyz" + bytes.fromhex("00000003 00000009 03 05")
    assert decode_header(data, 3) == FrameHeader(3, 9, 3, 5)


@pytest.mark.parametrize(
    ("length", "stream_id", "kind", "flags"),
    [(MAX_MESSAGE_LENGTH + 1, 1, 1, 0), (-1, 1, 1, 0), (0, 2**32, 1, 0), (0, 1, 256, 0)],
)
def test_header_values_out_of_range_are_refused(
    length: int, stream_id: int, kind: int, flags: int
) -> None:
    with pytest.raises(LocalProtocolError):
        encode_header(length, stream_id, kind, flags)


# --- whole frames as the connection writes them, per type and flag
def _frame(wire_header: str, body: bytes = b"") -> bytes:
    return bytes.fromhex(wire_header) + body


def test_server_data_frames_per_flag() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(_frame("00000000 00000001 01 01", b""))  # a server-streaming request
    server.send_data(1, b"abc")
    assert server.data_to_send() == _frame("00000003 00000001 03 00", b"abc")
    server.send_data(1, b"")
    assert server.data_to_send() == _frame("00000000 00000001 03 00")  # an empty message
    server.send_data(1, b"xy", end=True)
    assert server.data_to_send() == _frame("00000002 00000001 03 01", b"xy")

    server.receive_data(_frame("00000000 00000003 01 01"))
    server.send_data(3, None, end=True)
    assert server.data_to_send() == _frame("00000000 00000003 03 05")


def test_client_streaming_frames_per_flag() -> None:
    client = TtrpcConnection(Role.CLIENT)
    client.send_request("s", "m", b"", mode=RequestMode.CLIENT_STREAMING)
    assert client.data_to_send() == _frame("00000006 00000001 01 02", b"\x0a\x01s\x12\x01m")
    client.send_data(1, b"q")
    assert client.data_to_send() == _frame("00000001 00000001 03 00", b"q")
    client.send_data(1, None, end=True)
    assert client.data_to_send() == _frame("00000000 00000001 03 05")


def test_client_final_message_is_split_from_its_close() -> None:
    # The Go server rejects a close that carries data, so the client sends two frames.
    client = TtrpcConnection(Role.CLIENT)
    client.send_request("s", "m", mode=RequestMode.CLIENT_STREAMING)
    client.data_to_send()
    client.send_data(1, b"last", end=True)
    assert client.data_to_send() == _frame("00000004 00000001 03 00", b"last") + _frame(
        "00000000 00000001 03 05"
    )


def test_server_streaming_request_flags() -> None:
    client = TtrpcConnection(Role.CLIENT)
    client.send_request("s", "m", mode=RequestMode.SERVER_STREAMING)
    assert client.data_to_send() == _frame("00000006 00000001 01 01", b"\x0a\x01s\x12\x01m")


# --- envelopes
def test_error_response_envelope_bytes() -> None:
    # Response{status: Status{code: 12, message: "service foo"}}
    expected = b"\x0a\x0f" + b"\x08\x0c" + b"\x12\x0b" + b"service foo"
    assert encode_response(code=Code.UNIMPLEMENTED, message="service foo") == expected


def test_ok_response_has_no_status_field() -> None:
    assert encode_response(b"\x01\x02") == b"\x12\x02\x01\x02"
    assert encode_response() == b""


def test_decode_response_without_status_is_ok() -> None:
    decoded = decode_response(b"\x12\x02\x01\x02")
    assert (decoded.code, decoded.message, decoded.payload) == (0, "", b"\x01\x02")


def test_decode_response_with_status() -> None:
    data = envelope_pb2.Response(
        status=status_pb2.Status(code=8, message="too big"), payload=b"p"
    ).SerializeToString()
    decoded = decode_response(data)
    assert (decoded.code, decoded.message, decoded.payload) == (8, "too big", b"p")


def test_request_metadata_round_trip() -> None:
    data = encode_request("s", "m", b"", metadata=[("a", "1"), ("a", "2"), ("b", "")])
    request = decode_request(data)
    assert [(kv.key, kv.value) for kv in request.metadata] == [("a", "1"), ("a", "2"), ("b", "")]


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x0a\x02\xff\xfe", b"\xff"])
def test_malformed_envelopes(data: bytes) -> None:
    with pytest.raises(MalformedEnvelopeError):
        decode_request(data)
    with pytest.raises(MalformedEnvelopeError):
        decode_response(data)


def test_unencodable_request_is_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode_request("bad\udc80", "m", b"")
    with pytest.raises(LocalProtocolError):
        encode_request("s", "m", b"", timeout_nano=2**63)


def test_encode_frame_size_limit() -> None:
    assert len(encode_frame(1, MessageType.DATA, 0, bytes(MAX_MESSAGE_LENGTH))) == (
        10 + MAX_MESSAGE_LENGTH
    )
    with pytest.raises(OversizedMessageError) as info:
        encode_frame(1, MessageType.DATA, 0, bytes(MAX_MESSAGE_LENGTH + 1))
    assert info.value.code == 8
    assert info.value.message == "message length 4194305 exceed maximum message size of 4194304"
    assert isinstance(info.value, LocalProtocolError)
