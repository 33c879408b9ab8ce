"""exec/attach semantics: protocol versions, options, stream setup, resize, error stream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.k8s import StatusError, status_internal_error
from podgate.proto.remotecommand import (
    CLIENT_SPDY_PROTOCOLS,
    MAX_RESIZE_BUFFER,
    SERVER_SPDY_PROTOCOLS,
    STREAM_CREATION_TIMEOUT,
    V1,
    V1_BASE64,
    V2,
    V3,
    V4,
    V4_BASE64,
    V5,
    Accept,
    ExecOptions,
    Ignore,
    InvalidExecOptions,
    Reject,
    ResizeDecoder,
    ResizeProtocolError,
    SpdyStreamSet,
    StreamType,
    TerminalSize,
    encode_resize,
    error_stream_payload,
    expected_streams,
    has_close_signal,
    parse_options,
    parse_query,
    parse_target,
    protocol_version,
    status_is_json,
    status_payload,
    supports_resize,
)

ERR, IN, OUT, SERR, RSZ = (
    StreamType.ERROR,
    StreamType.STDIN,
    StreamType.STDOUT,
    StreamType.STDERR,
    StreamType.RESIZE,
)

# --- protocol names (k8s-streaming.md §4.1, §5.1, §5.3) ---------------------------------------


def test_protocol_names() -> None:
    assert (V1, V2, V3, V4, V5) == (
        "channel.k8s.io",
        "v2.channel.k8s.io",
        "v3.channel.k8s.io",
        "v4.channel.k8s.io",
        "v5.channel.k8s.io",
    )
    assert SERVER_SPDY_PROTOCOLS == (V4, V3, V2, V1)
    assert CLIENT_SPDY_PROTOCOLS == (V5, V4, V3, V2, V1)


@pytest.mark.parametrize(
    ("protocol", "version", "resize", "json_status", "close"),
    [
        ("", 1, False, False, False),
        (V1, 1, False, False, False),
        (V1_BASE64, 1, False, False, False),
        (V2, 2, False, False, False),
        (V3, 3, True, False, False),
        (V4, 4, True, True, False),
        (V4_BASE64, 4, True, True, False),
        (V5, 5, True, True, True),
    ],
)
def test_version_features(
    protocol: str, version: int, resize: bool, json_status: bool, close: bool
) -> None:
    assert protocol_version(protocol) == version
    assert supports_resize(protocol) is resize
    assert supports_resize(protocol, websocket=True) is True
    assert status_is_json(protocol) is json_status
    assert has_close_signal(protocol) is close


def test_unknown_protocol_is_our_bug() -> None:
    with pytest.raises(LocalProtocolError):
        protocol_version("portforward.k8s.io")


def test_websocket_channels() -> None:
    assert [t.channel for t in (IN, OUT, SERR, ERR, RSZ)] == [0, 1, 2, 3, 4]
    assert [t.value for t in StreamType] == ["error", "stdin", "stdout", "stderr", "resize"]


# --- options: the exact URLs of kubectl-api-surface.md §3 and §10, k8s-streaming.md §9 -------


@pytest.mark.parametrize(
    ("target", "options"),
    [
        (
            "/api/v1/namespaces/default/pods/nginx/exec"
            "?command=cat&container=main&stderr=true&stdin=true&stdout=true",
            ExecOptions(("cat",), "main", stdin=True, stdout=True, stderr=True),
        ),
        (
            "/api/v1/namespaces/default/pods/nginx/exec"
            "?command=ls&command=-l&container=main&stderr=true&stdout=true",
            ExecOptions(("ls", "-l"), "main", stdout=True, stderr=True),
        ),
        (
            "/api/v1/namespaces/default/pods/nginx/exec"
            "?command=sh&container=main&stdin=true&stdout=true&tty=true",
            ExecOptions(("sh",), "main", stdin=True, stdout=True, tty=True),
        ),
        (
            "/api/v1/namespaces/default/pods/nginx/attach"
            "?container=main&stdin=true&stdout=true&tty=true",
            ExecOptions((), "main", stdin=True, stdout=True, tty=True),
        ),
        (
            "/api/v1/namespaces/default/pods/nginx/attach?container=main&stderr=true&stdout=true",
            ExecOptions((), "main", stdout=True, stderr=True),
        ),
        # Python client 37.0.2: no container, explicit lower-case booleans.
        (
            "/api/v1/namespaces/default/pods/nginx/exec"
            "?command=ls&command=-l&stderr=true&stdin=false&stdout=true&tty=false",
            ExecOptions(("ls", "-l"), None, stdout=True, stderr=True),
        ),
        # Python client <= 36: booleans spelled True/False.
        (
            "/api/v1/namespaces/default/pods/nginx/exec"
            "?command=a&command=b&container=c&stderr=True&stdin=False&stdout=True&tty=False",
            ExecOptions(("a", "b"), "c", stdout=True, stderr=True),
        ),
        # kubectl 1.33 over WebSocket (k8s-streaming.md §5.5).
        (
            "/api/v1/namespaces/default/pods/foo/exec"
            "?command=cat&container=c1&stderr=true&stdin=true&stdout=true",
            ExecOptions(("cat",), "c1", stdin=True, stdout=True, stderr=True),
        ),
        # tty with stderr: stderr is dropped.
        (
            "/exec?command=sh&stderr=true&stdin=true&stdout=true&tty=true",
            ExecOptions(("sh",), None, stdin=True, stdout=True, tty=True),
        ),
        # Escapes in arguments.
        (
            "/exec?command=sh&command=-c&command=echo+hi%20%26%26+exit+3&stdout=true",
            ExecOptions(("sh", "-c", "echo hi && exit 3"), None, stdout=True),
        ),
    ],
)
def test_api_server_options(target: str, options: ExecOptions) -> None:
    _, query = parse_target(target)
    assert parse_options(query) == options


def test_kubelet_options() -> None:
    path, query = parse_target(b"/exec/ns/pod/ctr?command=ls&input=1&output=1&error=1&tty=1")
    assert path == "/exec/ns/pod/ctr"
    assert parse_options(query, kubelet_style=True) == ExecOptions(
        ("ls",), None, stdin=True, stdout=True, stderr=False, tty=True
    )


def test_options_from_a_raw_query_string() -> None:
    assert parse_options("command=ls&stdout=true") == ExecOptions(("ls",), stdout=True)
    assert parse_options(b"command=ls&output=1", kubelet_style=True) == ExecOptions(
        ("ls",), stdout=True
    )


def test_kubelet_only_literal_one_is_true() -> None:
    _, query = parse_target("/exec/ns/pod/ctr?command=ls&input=true&output=1&error=True&tty=yes")
    assert parse_options(query, kubelet_style=True) == ExecOptions(("ls",), stdout=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("0", False),
        ("false", False),
        ("False", False),
        ("FALSE", False),
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("", True),
    ],
)
def test_api_server_booleans(value: str | None, expected: bool) -> None:
    query = [("stdout", "true")] if value is None else [("stdout", "true"), ("stdin", value)]
    assert parse_options(query).stdin is expected


def test_first_value_of_a_repeated_boolean_wins() -> None:
    assert parse_options([("stdout", "false"), ("stdout", "true"), ("stdin", "1")]).stdout is False


@pytest.mark.parametrize(
    ("query", "kubelet_style"),
    [
        ("command=ls", False),
        ("command=ls&stdin=false&stdout=0&stderr=FALSE", False),
        ("command=sh&stderr=true&tty=true", False),
        ("command=ls&stdin=true&stdout=true", True),
        ("command=ls&error=1&tty=1", True),
    ],
)
def test_no_stream_requested_is_400(query: str, kubelet_style: bool) -> None:
    with pytest.raises(InvalidExecOptions) as info:
        parse_options(parse_query(query), kubelet_style=kubelet_style)
    err = info.value
    assert isinstance(err, RemoteProtocolError)
    assert err.code == 400
    assert err.message == "you must specify at least 1 of stdin, stdout, stderr"


@pytest.mark.parametrize(
    ("query", "pairs"),
    [
        ("a=1&b=2&a=3", [("a", "1"), ("b", "2"), ("a", "3")]),
        ("a+b=c+d", [("a b", "c d")]),
        ("x=%2F%e2%82%ac", [("x", "/€")]),
        ("flag&=v&&k=", [("flag", ""), ("", "v"), ("k", "")]),
        ("bad=%zz&ok=1", [("ok", "1")]),
        ("bad=%4&ok=1", [("ok", "1")]),
        ("semi=1;x=2&ok=1", [("ok", "1")]),
        ("", []),
    ],
)
def test_parse_query_like_go(query: str, pairs: list[tuple[str, str]]) -> None:
    assert parse_query(query) == pairs


def test_parse_query_refuses_invalid_utf8() -> None:
    with pytest.raises(StatusError) as info:
        parse_query("command=%ff")
    assert info.value.code == 400


def test_parse_target_without_query() -> None:
    assert parse_target("/api/v1/namespaces/default/pods/nginx/portforward") == (
        "/api/v1/namespaces/default/pods/nginx/portforward",
        [],
    )


# --- expected streams and SPDY setup (k8s-streaming.md §4.3) ----------------------------------


@pytest.mark.parametrize(
    ("opts", "protocol", "streams"),
    [
        # exec foo -- echo hi
        (ExecOptions(("echo", "hi"), stdout=True, stderr=True), V4, {ERR, OUT, SERR}),
        # exec -it
        (ExecOptions(("sh",), stdin=True, stdout=True, tty=True), V4, {ERR, IN, OUT, RSZ}),
        (ExecOptions(("sh",), stdin=True, stdout=True, tty=True), V3, {ERR, IN, OUT, RSZ}),
        (ExecOptions(("sh",), stdin=True, stdout=True, tty=True), V2, {ERR, IN, OUT}),
        (ExecOptions(("sh",), stdin=True, stdout=True, tty=True), V1, {ERR, IN, OUT}),
        (ExecOptions(("cat",), stdin=True, stdout=True, stderr=True), V5, {ERR, IN, OUT, SERR}),
    ],
)
def test_expected_streams(opts: ExecOptions, protocol: str, streams: set[StreamType]) -> None:
    assert expected_streams(opts, protocol) == frozenset(streams)


def _kubectl_sequence(types: list[str]) -> list[tuple[int, dict[str, str]]]:
    return [(1 + 2 * i, {"streamtype": t}) for i, t in enumerate(types)]


@pytest.mark.parametrize(
    ("opts", "types"),
    [
        (ExecOptions(("echo", "hi"), stdout=True, stderr=True), ["error", "stdout", "stderr"]),
        (
            ExecOptions(("sh",), stdin=True, stdout=True, tty=True),
            ["error", "stdin", "stdout", "resize"],
        ),
    ],
)
def test_kubectl_stream_sequence_completes(opts: ExecOptions, types: list[str]) -> None:
    streams = SpdyStreamSet(expected_streams(opts, V4), now=0.0)
    sequence = _kubectl_sequence(types)
    for n, (sid, headers) in enumerate(sequence):
        assert not streams.complete
        assert streams.add(sid, headers) == Accept(sid, StreamType(headers["streamtype"]))
        assert len(streams.missing) == len(types) - n - 1
    assert streams.complete
    assert streams.streams == {
        StreamType(t): sid for sid, t in zip((1, 3, 5, 7)[: len(types)], types, strict=True)
    }


def test_unknown_and_unrequested_streams_are_ignored() -> None:
    streams = SpdyStreamSet(frozenset({ERR, OUT}), now=0.0)
    assert streams.add(1, {"streamtype": "bogus"}) == Ignore(1, "bogus")
    assert streams.add(3, {}) == Ignore(3, "")
    assert streams.add(5, {"streamtype": "stdin"}) == Ignore(5, "stdin")
    assert not streams.complete
    assert streams.add(7, {"streamtype": "error"}) == Accept(7, ERR)
    assert streams.add(9, {"streamtype": "stdout"}) == Accept(9, OUT)
    assert streams.complete


def test_duplicate_stream_type_is_rejected() -> None:
    streams = SpdyStreamSet(frozenset({ERR, OUT, SERR}), now=0.0)
    assert streams.add(1, {"streamtype": "error"}) == Accept(1, ERR)
    assert isinstance(streams.add(3, {"streamtype": "error"}), Reject)
    assert streams.streams == {ERR: 1}


def test_header_lookup_is_go_like() -> None:
    streams = SpdyStreamSet(frozenset({ERR, OUT}), now=0.0)
    # Go canonicalises header names and Header.Get returns the first of NUL-joined values.
    assert streams.add(1, {"streamType": "error"}) == Accept(1, ERR)
    assert streams.add(3, {"streamtype": "stdout\0stderr"}) == Accept(3, OUT)


def test_stream_creation_deadline() -> None:
    assert STREAM_CREATION_TIMEOUT == 30.0
    streams = SpdyStreamSet(frozenset({ERR, OUT}), now=100.0)
    assert streams.deadline(120.0) == 130.0
    streams.add(1, {"streamtype": "error"})
    assert not streams.expired(129.999)
    assert streams.expired(130.0)
    streams.add(3, {"streamtype": "stdout"})
    assert not streams.expired(1000.0)


def test_stream_creation_clock_starts_at_first_look() -> None:
    streams = SpdyStreamSet(frozenset({ERR, OUT}))
    assert not streams.expired(5.0)
    assert streams.deadline(20.0) == 35.0
    assert not streams.expired(34.9)
    assert streams.expired(35.0)


def test_stream_set_needs_an_error_stream() -> None:
    with pytest.raises(LocalProtocolError):
        SpdyStreamSet(frozenset({OUT}), now=0.0)


# --- resize ----------------------------------------------------------------------------------


def test_encode_resize_as_kubectl() -> None:
    # kubectl-api-surface.md §6.1 and k8s-streaming.md §4.4.
    assert encode_resize(100, 30) == b'{"Width":100,"Height":30}\n'
    assert encode_resize(0, 0) == b'{"Width":0,"Height":0}\n'


@pytest.mark.parametrize(("w", "h"), [(-1, 0), (0, 65536)])
def test_encode_resize_range(w: int, h: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_resize(w, h)


@pytest.mark.parametrize(
    ("data", "sizes"),
    [
        (b'{"Width":100,"Height":30}\n', [(100, 30)]),
        (b'{"Width":0,"Height":0}\n', [(0, 0)]),
        # Python clients: other key order, spaces, no newline (k8s-streaming.md §9).
        (b'{"Height": 24, "Width": 80}', [(80, 24)]),
        (b'{"Height": 24, "Width": 80}{"Height": 25, "Width": 81}', [(80, 24), (81, 25)]),
        # attach -t sends (w+1, h+1) then (w, h).
        (b'{"Width":101,"Height":31}\n{"Width":100,"Height":30}\n', [(101, 31), (100, 30)]),
        (b'{"width":1,"HEIGHT":2}', [(1, 2)]),
        (b'{"Width":1}', [(1, 0)]),
        (b'{"Width":null,"Height":5}', [(0, 5)]),
        (b'{"Width":1,"width":9,"Height":2}', [(9, 2)]),
        (b'{"Width":65535,"Height":65535}', [(65535, 65535)]),
        (b'{"x":"}{\\"","Width":3,"y":[{"z":[]}],"Height":4}', [(3, 4)]),
        (b'{"x":-1.5,"Width":3,"Height":4}', [(3, 4)]),
        (b" \r\n\t", []),
        (b"", []),
    ],
)
def test_resize_decoder(data: bytes, sizes: list[tuple[int, int]]) -> None:
    decoder = ResizeDecoder()
    assert decoder.feed(data) == [TerminalSize(w, h) for w, h in sizes]
    decoder.end()


@pytest.mark.parametrize(
    "data",
    [
        b'{"Width":65536,"Height":1}',
        b'{"Width":-1,"Height":1}',
        b'{"Width":-0,"Height":1}',
        b'{"Width":80.0,"Height":1}',
        b'{"Width":8e1,"Height":1}',
        b'{"Width":"80","Height":1}',
        b'{"Width":true,"Height":1}',
        b'{"Width":{},"Height":1}',
        b'{"Width":NaN}',
        b"[1,2]",
        b"null",
        b"80 24",
        b"{]",
        b'{"Width":1,}',
        b"{" * 40,
    ],
)
def test_resize_decoder_rejects(data: bytes) -> None:
    with pytest.raises(ResizeProtocolError):
        ResizeDecoder().feed(data)


def test_resize_decoder_is_bounded() -> None:
    decoder = ResizeDecoder()
    chunk = b'{"pad":"' + b"x" * (MAX_RESIZE_BUFFER - 8)
    assert decoder.feed(chunk) == []
    with pytest.raises(ResizeProtocolError):
        decoder.feed(b"x" * 16)


def test_resize_decoder_stays_failed() -> None:
    decoder = ResizeDecoder()
    with pytest.raises(ResizeProtocolError):
        decoder.feed(b"nope")
    with pytest.raises(ResizeProtocolError):
        decoder.feed(b'{"Width":1,"Height":1}')


def test_resize_end_inside_an_event() -> None:
    decoder = ResizeDecoder()
    assert decoder.feed(b'{"Width":1,"Height":1}{"Width":2') == [TerminalSize(1, 1)]
    with pytest.raises(ResizeProtocolError):
        decoder.end()


_DIM = st.integers(0, 65535)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.tuples(_DIM, _DIM), max_size=10))
def test_resize_round_trip(sizes: list[tuple[int, int]]) -> None:
    decoder = ResizeDecoder()
    stream = b"".join(encode_resize(w, h) for w, h in sizes)
    assert decoder.feed(stream) == [TerminalSize(w, h) for w, h in sizes]


def _python_style(w: int, h: int) -> bytes:
    return b'{"Height": %d, "Width": %d}' % (h, w)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(_DIM, _DIM, st.booleans()), min_size=1, max_size=8),
    data=st.data(),
)
def test_resize_random_splits(sizes: list[tuple[int, int, bool]], data: st.DataObject) -> None:
    stream = b"".join(
        encode_resize(w, h) if kubectl else _python_style(w, h) for w, h, kubectl in sizes
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = ResizeDecoder()
    got: list[TerminalSize] = []
    for start, stop in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += decoder.feed(stream[start:stop])
    decoder.end()
    assert got == [TerminalSize(w, h) for w, h, _ in sizes]


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(max_size=64), max_size=8))
def test_resize_garbage_only_raises_resize_errors(chunks: list[bytes]) -> None:
    decoder = ResizeDecoder()
    try:
        for chunk in chunks:
            for size in decoder.feed(chunk):
                assert 0 <= size.width <= 65535
                assert 0 <= size.height <= 65535
        decoder.end()
    except ResizeProtocolError as exc:
        assert isinstance(exc, RemoteProtocolError)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet='{}[]":,0123456789 \nWidthHeg-.\\', max_size=80))
def test_resize_jsonish_garbage_only_raises_resize_errors(text: str) -> None:
    try:
        ResizeDecoder().feed(text.encode())
    except ResizeProtocolError:
        pass


# --- error stream (k8s-streaming.md §4.4) ----------------------------------------------------

RUNTIME_TEXT = "error executing command [sh -c exit 3], exit code 3"


@pytest.mark.parametrize("protocol", [V4, V5, V4_BASE64])
def test_v4_error_stream_is_always_json(protocol: str) -> None:
    assert error_stream_payload(protocol, 0) == b'{"metadata":{},"status":"Success"}'
    assert error_stream_payload(protocol, 3, RUNTIME_TEXT) == (
        b'{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit '
        b'code: error executing command [sh -c exit 3], exit code 3","reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"3"}]}}'
    )


@pytest.mark.parametrize("protocol", ["", V1, V2, V3, V1_BASE64])
def test_old_error_stream_is_text_on_failure_only(protocol: str) -> None:
    assert error_stream_payload(protocol, 0) is None
    assert error_stream_payload(protocol, 3, RUNTIME_TEXT) == (
        b"command terminated with non-zero exit code: " + RUNTIME_TEXT.encode()
    )
    assert error_stream_payload(protocol, None, "boom") == b"Internal error occurred: boom"


def test_internal_error_payload_v4() -> None:
    assert status_payload(V4, status_internal_error("boom")) == (
        b'{"metadata":{},"status":"Failure","message":"Internal error occurred: boom",'
        b'"reason":"InternalError","details":{"causes":[{"message":"boom"}]},"code":500}'
    )
    assert error_stream_payload(V4, None, "boom") == status_payload(
        V4, status_internal_error("boom")
    )


def test_failure_without_message_is_our_bug() -> None:
    with pytest.raises(LocalProtocolError):
        error_stream_payload(V4, None)
