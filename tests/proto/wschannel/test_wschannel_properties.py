"""Property tests: any split of the byte stream gives the same events; garbage only ever
raises podgate's ProtocolError subclasses (no other exception leaks)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import ProtocolError
from podgate.proto.wschannel import (
    ChannelConnection,
    ChannelData,
    Event,
    PingReceived,
    Role,
    TunnelConnection,
    TunnelData,
)

PROTOCOLS = st.sampled_from(
    [
        "v5.channel.k8s.io",
        "v4.channel.k8s.io",
        "channel.k8s.io",
        "",
        "base64.channel.k8s.io",
        "v4.base64.channel.k8s.io",
    ]
)
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("data"), st.integers(0, 4), st.binary(max_size=300)),
        st.tuples(st.just("ready"), st.integers(0, 4), st.just(b"")),
        st.tuples(st.just("ping"), st.just(0), st.binary(max_size=20)),
    ),
    max_size=12,
)


def feed_in_pieces(
    conn: ChannelConnection | TunnelConnection, data: bytes, cuts: list[int]
) -> list[Event]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    events: list[Event] = []
    for start, end in itertools.pairwise(points):
        events += conn.receive_data(data[start:end])
    return events


def script(sender: ChannelConnection, actions: list[tuple[str, int, bytes]]) -> bytes:
    for kind, channel, data in actions:
        if kind == "data":
            sender.send(channel, data)
        elif kind == "ready":
            sender.send_ready(channel)
        else:
            sender.ping(data)
    sender.close(1000)
    return sender.data_to_send()


@settings(max_examples=150, deadline=None)
@given(
    protocol=PROTOCOLS,
    actions=ACTIONS,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
    client_sends=st.booleans(),
)
def test_random_splits_give_the_same_events(
    protocol: str, actions: list[tuple[str, int, bytes]], cuts: list[int], client_sends: bool
) -> None:
    sender_role, receiver_role = (
        (Role.CLIENT, Role.SERVER) if client_sends else (Role.SERVER, Role.CLIENT)
    )
    wire = script(ChannelConnection(sender_role, protocol), actions)
    whole = ChannelConnection(receiver_role, protocol).receive_data(wire)
    pieces = feed_in_pieces(ChannelConnection(receiver_role, protocol), wire, cuts)
    assert pieces == whole
    # And the events are what was sent (empty data sends nothing; ready is empty data).
    expected: list[object] = []
    for kind, channel, data in actions:
        if kind == "data" and data:
            expected.append((channel, data))
        elif kind == "ready":
            expected.append((channel, b""))
        elif kind == "ping":
            expected.append(PingReceived(data))
    got: list[object] = [
        e
        if isinstance(e, PingReceived)
        else (getattr(e, "channel", None), getattr(e, "data", None))
        for e in whole[:-1]
    ]
    assert got == expected


@settings(max_examples=150, deadline=None)
@given(
    chunks=st.lists(st.binary(max_size=200), max_size=10),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
)
def test_tunnel_stream_survives_any_split(chunks: list[bytes], cuts: list[int]) -> None:
    cli = TunnelConnection(Role.CLIENT)
    for chunk in chunks:
        cli.send(chunk)
    wire = cli.data_to_send()
    events = feed_in_pieces(TunnelConnection(Role.SERVER), wire, cuts)
    assert all(isinstance(e, TunnelData) and e.data for e in events)
    assert b"".join(e.data for e in events if isinstance(e, TunnelData)) == b"".join(chunks)


@settings(max_examples=200, deadline=None)
@given(
    protocol=PROTOCOLS,
    role=st.sampled_from([Role.CLIENT, Role.SERVER]),
    chunks=st.lists(st.binary(min_size=1, max_size=64), max_size=8),
)
def test_garbage_raises_only_protocol_errors(
    protocol: str, role: Role, chunks: list[bytes]
) -> None:
    conn = ChannelConnection(role, protocol, max_message_bytes=256)
    try:
        for chunk in chunks:
            conn.receive_data(chunk)
        conn.receive_eof()
    except ProtocolError:
        pass


@st.composite
def framed_garbage(draw: st.DrawFn) -> bytes:
    """Well-formed masked frames with random opcodes, flags and payloads: gets past the
    header checks more often than raw bytes do."""
    out = b""
    for _ in range(draw(st.integers(1, 6))):
        first = draw(st.integers(0, 255))
        payload = draw(st.binary(max_size=40))
        out += bytes([first, 0x80 | len(payload)]) + b"\0\0\0\0" + payload
    return out


@settings(max_examples=200, deadline=None)
@given(data=framed_garbage(), tunnel=st.booleans(), protocol=PROTOCOLS)
def test_framed_garbage_raises_only_protocol_errors(
    data: bytes, tunnel: bool, protocol: str
) -> None:
    conn: ChannelConnection | TunnelConnection = (
        TunnelConnection(Role.SERVER) if tunnel else ChannelConnection(Role.SERVER, protocol)
    )
    try:
        conn.receive_data(data)
        conn.data_to_send()
    except ProtocolError:
        pass


# RFC 6455 5.2 length boundaries: 7-bit, 16-bit and 64-bit lengths and their edges.
SIZES = st.sampled_from([0, 1, 2, 124, 125, 126, 127, 1000, 65535, 65536, 70001])


def build_frame(opcode: int, payload: bytes, fin: bool, mask: bytes) -> bytes:
    """An RFC 6455 5.2 frame, written out independently of the code under test."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@st.composite
def fragmented_messages(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """Binary messages from a client, each cut into 1-3 frames at random points, with pings
    between frames: (the messages, the wire bytes)."""
    messages: list[bytes] = []
    wire = b""
    for _ in range(draw(st.integers(1, 4))):
        size = draw(SIZES)
        seed = draw(st.integers(0, 255))
        message = bytes((seed + i) % 256 for i in range(size))
        messages.append(message)
        cuts = sorted(draw(st.lists(st.integers(0, size), max_size=2)))
        pieces = [message[a:b] for a, b in itertools.pairwise([0, *cuts, size])]
        for i, piece in enumerate(pieces):
            mask = draw(st.binary(min_size=4, max_size=4))
            wire += build_frame(0x2 if i == 0 else 0x0, piece, i == len(pieces) - 1, mask)
            if draw(st.booleans()):
                wire += build_frame(0x9, b"p", True, mask)
    return messages, wire


@settings(max_examples=100, deadline=None)
@given(
    case=fragmented_messages(),
    cuts=st.lists(st.integers(min_value=0, max_value=300_000), max_size=12),
)
def test_fragmented_large_messages_survive_any_split(
    case: tuple[list[bytes], bytes], cuts: list[int]
) -> None:
    messages, wire = case
    events = feed_in_pieces(ChannelConnection(Role.SERVER, "v4.channel.k8s.io"), wire, cuts)
    data = [e for e in events if not isinstance(e, PingReceived)]
    assert data == [ChannelData(m[0], m[1:]) for m in messages if m]
    tunnel = feed_in_pieces(TunnelConnection(Role.SERVER), wire, cuts)
    assert all(isinstance(e, (TunnelData, PingReceived)) for e in tunnel)
    assert b"".join(e.data for e in tunnel if isinstance(e, TunnelData)) == b"".join(messages)
