"""Datagrams on a byte stream (podgate's UDP port-forward framing): uint16 big-endian length,
then the payload; exact bytes, round trips under any chunking, and the limits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.datagram import (
    MAX_DATAGRAM_BYTES,
    MAX_FRAME_BYTES,
    DatagramDecoder,
    TruncatedDatagramError,
    encode_datagram,
    encode_datagrams,
)
from podgate.proto.errors import LocalProtocolError, RemoteProtocolError


@pytest.mark.parametrize(
    ("payload", "frame"),
    [
        (b"abc", bytes.fromhex("00 03 61 62 63")),
        (b"", bytes.fromhex("00 00")),
        (b"\x00", bytes.fromhex("00 01 00")),
        (b"x" * 255, bytes.fromhex("00 ff") + b"x" * 255),
        (b"y" * 256, bytes.fromhex("01 00") + b"y" * 256),
        (b"z" * 0x1234, bytes.fromhex("12 34") + b"z" * 0x1234),
        (b"m" * 65535, bytes.fromhex("ff ff") + b"m" * 65535),
    ],
    ids=["abc", "empty", "nul", "255", "256", "0x1234", "max"],
)
def test_frame_bytes(payload: bytes, frame: bytes) -> None:
    assert encode_datagram(payload) == frame
    assert DatagramDecoder().feed(frame) == [payload]


def test_limits() -> None:
    assert MAX_DATAGRAM_BYTES == 65535
    assert MAX_FRAME_BYTES == 65537


@pytest.mark.parametrize("size", [65536, 70000, 1 << 20])
def test_oversize_datagram_is_refused(size: int) -> None:
    with pytest.raises(LocalProtocolError, match=f"{size} bytes"):
        encode_datagram(b"\x00" * size)


def test_several_frames_back_to_back() -> None:
    wire = encode_datagrams([b"a", b"", b"bc"])
    assert wire == bytes.fromhex("00 01 61 00 00 00 02 62 63")
    assert DatagramDecoder().feed(wire) == [b"a", b"", b"bc"]


def test_partial_frames_across_feeds() -> None:
    decoder = DatagramDecoder()
    assert decoder.feed(b"\x00") == []
    assert decoder.buffered == 1
    assert decoder.feed(b"\x03ab") == []
    assert decoder.buffered == 4
    assert decoder.feed(b"c\x00") == [b"abc"]
    assert decoder.buffered == 1
    assert decoder.feed(b"\x00\x00\x01") == [b""]
    assert decoder.feed(b"Z") == [b"Z"]
    assert decoder.buffered == 0
    decoder.receive_eof()  # a clean end


@pytest.mark.parametrize("tail", [b"\x00", b"\x00\x05", b"\x00\x05abcd"])
def test_eof_inside_a_frame_is_the_peers_fault(tail: bytes) -> None:
    decoder = DatagramDecoder()
    assert decoder.feed(encode_datagram(b"ok") + tail) == [b"ok"]
    with pytest.raises(TruncatedDatagramError, match=f"{len(tail)} bytes into") as info:
        decoder.receive_eof()
    assert isinstance(info.value, RemoteProtocolError)


def test_byte_at_a_time() -> None:
    wire = bytes.fromhex("00 02 68 69 00 00 00 01 21")
    decoder = DatagramDecoder()
    out: list[bytes] = []
    for i in range(len(wire)):
        out += decoder.feed(wire[i : i + 1])
    assert out == [b"hi", b"", b"!"]


payloads = st.lists(
    st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda n, b: bytes([b]) * n, st.integers(0, MAX_DATAGRAM_BYTES), st.integers(0, 255)
        ),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(items=payloads, cuts=st.lists(st.integers(min_value=0), max_size=20))
def test_round_trip_with_random_splits(items: list[bytes], cuts: list[int]) -> None:
    wire = encode_datagrams(items)
    assert len(wire) == sum(2 + len(p) for p in items)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    decoder = DatagramDecoder()
    out: list[bytes] = []
    for start, stop in itertools.pairwise(points):
        out += decoder.feed(wire[start:stop])
        # Every complete frame is out: at most one partial frame is ever held.
        assert decoder.buffered < MAX_FRAME_BYTES
    assert out == items
    assert decoder.buffered == 0
    decoder.receive_eof()
