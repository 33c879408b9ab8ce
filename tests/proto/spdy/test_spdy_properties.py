"""Property tests: round trips, split invariance, and hostile input only ever raising
ProtocolError."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from spdy_support import feed_in_pieces, merge_data

from podgate.proto.errors import LocalProtocolError, ProtocolError
from podgate.proto.spdy import (
    DataReceived,
    Event,
    HeaderCompressor,
    HeaderDecompressor,
    Role,
    SpdyConnection,
    StreamClosedError,
    StreamOpened,
)
from podgate.proto.spdy.frames import SettingsEntry, encode_settings, encode_window_update
from podgate.proto.spdy.headers import SYN_STREAM_FORBIDDEN_HEADERS

SETTINGS = settings(max_examples=150, deadline=None)

_text = st.characters(exclude_categories=["Cs"])  # lone surrogates are not encodable
names = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\0"),
    min_size=1,
    max_size=16,
).filter(lambda s: s == s.lower() and s not in SYN_STREAM_FORBIDDEN_HEADERS)
header_maps = st.dictionaries(names, st.text(alphabet=_text, max_size=40), max_size=6)


@SETTINGS
@given(st.lists(header_maps, min_size=1, max_size=6))
def test_header_blocks_round_trip_through_long_lived_contexts(maps: list[dict[str, str]]) -> None:
    compressor, decompressor = HeaderCompressor(), HeaderDecompressor()
    for headers in maps:
        assert decompressor.decompress(compressor.compress(headers)) == headers


@SETTINGS
@given(
    payload=st.binary(max_size=4000),
    max_frame=st.integers(1, 700),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_data_round_trips_in_frames_of_the_chosen_size(
    payload: bytes, max_frame: int, cuts: list[int]
) -> None:
    client = SpdyConnection(Role.CLIENT, max_data_frame=max_frame)
    sid = client.open_stream({})
    client.send_data(sid, payload, fin=True)
    wire = client.data_to_send()

    whole = SpdyConnection(Role.SERVER).receive_data(wire)
    assert whole[0] == StreamOpened(sid, {})
    frames = whole[1:]
    assert len(frames) == max(1, math.ceil(len(payload) / max_frame))
    assert all(isinstance(e, DataReceived) and len(e.data) <= max_frame for e in frames)
    assert [e.fin for e in frames if isinstance(e, DataReceived)][-1] is True

    split = feed_in_pieces(SpdyConnection(Role.SERVER), wire, cuts)
    assert merge_data(split) == [StreamOpened(sid, {}), DataReceived(sid, payload, fin=True)]


# --- random sessions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    kind: str
    index: int = 0
    data: bytes = b""
    fin: bool = False
    headers: dict[str, str] | None = None


ops = st.lists(
    st.one_of(
        st.builds(Op, st.just("open"), fin=st.booleans(), headers=header_maps),
        st.builds(
            Op,
            st.just("data"),
            st.integers(0, 8),
            st.binary(max_size=200),
            st.booleans(),
        ),
        st.builds(Op, st.just("reset"), st.integers(0, 8)),
        st.builds(Op, st.just("ping")),
        st.builds(Op, st.just("settings"), st.integers(0, 2**32 - 1)),
        st.builds(Op, st.just("window"), st.integers(1, 2**31 - 1)),
    ),
    max_size=25,
)


def run_client(script: list[Op]) -> tuple[SpdyConnection, bytes]:
    """Apply a script to a fresh client (invalid steps are skipped); return it and its output."""
    client = SpdyConnection(Role.CLIENT, max_data_frame=64)
    opened: list[int] = []
    extra = bytearray()
    for op in script:
        stream = opened[op.index % len(opened)] if opened else 1
        try:
            if op.kind == "open":
                opened.append(client.open_stream(op.headers or {}, fin=op.fin))
            elif op.kind == "data":
                client.send_data(stream, op.data, fin=op.fin)
            elif op.kind == "reset":
                client.reset_stream(stream)
            elif op.kind == "ping":
                client.ping()
            elif op.kind == "settings":
                extra += client.data_to_send() + encode_settings([SettingsEntry(4, op.index)])
            elif op.kind == "window":
                extra += client.data_to_send() + encode_window_update(stream, op.index)
        except LocalProtocolError:
            pass
    return client, bytes(extra) + client.data_to_send()


def serve(server: SpdyConnection, events: list[Event]) -> None:
    """A server that replies to every stream and answers with some data."""
    for event in events:
        try:
            if isinstance(event, StreamOpened):
                server.reply(event.stream_id)
                server.send_data(event.stream_id, bytes([event.stream_id % 256]) * 100)
            if isinstance(event, DataReceived) and event.fin:
                server.end_stream(event.stream_id)
        except StreamClosedError:
            pass  # the client reset it later in the same batch


@SETTINGS
@given(script=ops, cuts=st.lists(st.integers(0, 100_000), max_size=30))
def test_events_do_not_depend_on_how_input_is_split(script: list[Op], cuts: list[int]) -> None:
    _, wire = run_client(script)
    whole_server = SpdyConnection(Role.SERVER)
    whole = whole_server.receive_data(wire)
    split_server = SpdyConnection(Role.SERVER)
    split = feed_in_pieces(split_server, wire, cuts)
    assert merge_data(split) == merge_data(whole)
    assert split_server.data_to_send() == whole_server.data_to_send()

    # And the other direction: the server's answers, fed to two identical clients.
    serve(whole_server, whole)
    answer = whole_server.data_to_send()
    client_a, _ = run_client(script)
    client_b, _ = run_client(script)
    whole_back = client_a.receive_data(answer)
    split_back = feed_in_pieces(client_b, answer, cuts)
    assert merge_data(split_back) == merge_data(whole_back)
    assert client_b.data_to_send() == client_a.data_to_send()


def _feed_expecting_only_protocol_errors(
    conn: SpdyConnection, data: bytes, cuts: list[int]
) -> None:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for start, end in itertools.pairwise(bounds):
        try:
            conn.receive_data(data[start:end])
        except ProtocolError:
            assert conn.closed
            try:
                conn.receive_data(b"\x00" * 8)
            except ProtocolError:
                pass
            else:
                raise AssertionError("a dead connection accepted more input") from None
            return
    conn.receive_eof()


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 5000), max_size=10),
    role=st.sampled_from(Role),
)
def test_random_garbage_only_raises_protocol_errors(
    data: bytes, cuts: list[int], role: Role
) -> None:
    _feed_expecting_only_protocol_errors(SpdyConnection(role), data, cuts)


@settings(max_examples=200, deadline=None)
@given(
    script=ops,
    mutations=st.lists(
        st.tuples(
            st.sampled_from(["flip", "insert", "delete"]),
            st.integers(0, 10**6),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=6,
    ),
    cuts=st.lists(st.integers(0, 100_000), max_size=10),
)
def test_mutated_sessions_only_raise_protocol_errors(
    script: list[Op], mutations: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    _, wire = run_client(script)
    mutated = bytearray(wire)
    for kind, where, value in mutations:
        if kind == "insert":
            mutated.insert(where % (len(mutated) + 1), value)
        elif mutated:
            pos = where % len(mutated)
            if kind == "flip":
                mutated[pos] ^= value or 0x80
            else:
                del mutated[pos]
    _feed_expecting_only_protocol_errors(SpdyConnection(Role.SERVER), bytes(mutated), cuts)
