"""Channel framing tables from k8s-streaming.md section 5.2 and kubectl-api-surface.md 6.1/10."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.wschannel import (
    CLOSE,
    ERROR,
    RESIZE,
    STDERR,
    STDIN,
    STDOUT,
    ChannelCodec,
    CloseCode,
    WebSocketError,
    encode_port,
)


def test_channel_numbers() -> None:
    assert (STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE) == (0, 1, 2, 3, 4, 255)


@pytest.mark.parametrize("protocol", ["base64.channel.k8s.io", "v4.base64.channel.k8s.io"])
def test_base64_examples(protocol: str) -> None:
    codec = ChannelCodec(protocol)
    assert codec.base64
    # Client stdin "foo\n" and server stdout "\n", as in the reference.
    assert codec.decode("0Zm9vCg==") == (STDIN, b"foo\n")
    assert codec.encode(STDIN, b"foo\n") == "0Zm9vCg=="
    assert codec.encode(STDOUT, b"\n") == "1Cg=="
    assert codec.decode("1Cg==") == (STDOUT, b"\n")
    # The ready message is the bare channel digit.
    assert codec.encode(STDOUT, b"") == "1"
    # The same text arriving in a binary frame decodes alike.
    assert codec.decode(b"0Zm9vCg==") == (STDIN, b"foo\n")


@pytest.mark.parametrize(
    "protocol", ["", "channel.k8s.io", "v4.channel.k8s.io", "v5.channel.k8s.io"]
)
def test_binary_framing(protocol: str) -> None:
    codec = ChannelCodec(protocol)
    assert not codec.base64
    assert codec.encode(STDOUT, b"hi\n") == b"\x01hi\n"
    assert codec.encode(STDOUT, b"") == b"\x01"
    assert codec.decode(b"\x00input-data\n") == (STDIN, b"input-data\n")
    # Resize as kubectl sends it (kubectl-api-surface.md section 6.1).
    assert codec.decode(b'\x04{"Width":100,"Height":30}\n') == (
        RESIZE,
        b'{"Width":100,"Height":30}\n',
    )
    # The Python client writes stdin as text frames starting with "\x00".
    assert codec.decode("\x00ls -l\n") == (STDIN, b"ls -l\n")


def test_v5_close_message_bytes() -> None:
    codec = ChannelCodec("v5.channel.k8s.io")
    assert codec.has_close
    assert codec.decode(b"\xff\x00") == (CLOSE, b"\x00")
    assert not ChannelCodec("v4.channel.k8s.io").has_close


def test_port_header_for_port_80() -> None:
    # kubectl-api-surface.md section 10: "for port 80: 00 50 00 and 01 50 00".
    codec = ChannelCodec("v4.channel.k8s.io")
    assert codec.encode(0, encode_port(80)) == bytes.fromhex("005000")
    assert codec.encode(1, encode_port(80)) == bytes.fromhex("015000")


@pytest.mark.parametrize("message", ["0Zm9vCg=", "0Zm9v$g==", "0é", "/Zm9v", "1Cg==="])
def test_bad_base64_is_a_remote_error(message: str) -> None:
    codec = ChannelCodec("v4.base64.channel.k8s.io")
    with pytest.raises(RemoteProtocolError) as info:
        codec.decode(message)
    assert isinstance(info.value, WebSocketError)
    assert info.value.close_code == CloseCode.INVALID_PAYLOAD


def test_empty_message_is_an_error_for_the_codec() -> None:
    with pytest.raises(RemoteProtocolError):
        ChannelCodec("v4.channel.k8s.io").decode(b"")


def test_unknown_protocol_is_local_misuse() -> None:
    with pytest.raises(LocalProtocolError):
        ChannelCodec("v9.channel.k8s.io")
    with pytest.raises(LocalProtocolError):
        ChannelCodec("SPDY/3.1+portforward.k8s.io")


def test_channel_ranges() -> None:
    with pytest.raises(LocalProtocolError):
        ChannelCodec("v4.channel.k8s.io").encode(256, b"x")
    with pytest.raises(LocalProtocolError):
        ChannelCodec("base64.channel.k8s.io").encode(80, b"x")
    assert ChannelCodec("base64.channel.k8s.io").encode(10, b"") == ":"


@settings(max_examples=200, deadline=None)
@given(
    protocol=st.sampled_from(
        [
            "",
            "channel.k8s.io",
            "v4.channel.k8s.io",
            "v5.channel.k8s.io",
            "base64.channel.k8s.io",
            "v4.base64.channel.k8s.io",
        ]
    ),
    channel=st.integers(min_value=0, max_value=79),
    data=st.binary(max_size=300),
)
def test_round_trip(protocol: str, channel: int, data: bytes) -> None:
    codec = ChannelCodec(protocol)
    assert codec.decode(codec.encode(channel, data)) == (channel, data)
