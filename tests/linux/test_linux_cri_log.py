"""CRI log entries as containerd writes them (internal/cri/io/logger.go), without processes."""

from __future__ import annotations

import pytest

from podgate.linux.shim import MAX_LOG_LINE, CriLogWriter, rfc3339nano

NOW = 1_000_000_000 * 1_000_000_000  # 2001-09-09T01:46:40Z, one billion seconds
STAMP = b"2001-09-09T01:46:40Z"


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "1970-01-01T00:00:00Z"),
        (1, "1970-01-01T00:00:00.000000001Z"),
        (1_500_000_000, "1970-01-01T00:00:01.5Z"),
        (86_400 * 10**9 + 120_000_000, "1970-01-02T00:00:00.12Z"),
        (NOW, "2001-09-09T01:46:40Z"),
        (NOW + 100, "2001-09-09T01:46:40.0000001Z"),
        (NOW + 123_456_789, "2001-09-09T01:46:40.123456789Z"),
    ],
)
def test_rfc3339nano_drops_trailing_zeros_like_go(ns: int, text: str) -> None:
    assert rfc3339nano(ns) == text


def _writer(max_line: int = MAX_LOG_LINE) -> tuple[CriLogWriter, list[bytes]]:
    out: list[bytes] = []
    return CriLogWriter(out.append, max_line), out


def test_full_lines() -> None:
    w, out = _writer()
    w.feed("stdout", b"a\nbc\n", NOW)
    w.feed("stderr", b"err\n", NOW)
    assert out == [
        STAMP + b" stdout F a\n",
        STAMP + b" stdout F bc\n",
        STAMP + b" stderr F err\n",
    ]


def test_crlf_empty_lines_and_lines_across_chunks() -> None:
    w, out = _writer()
    w.feed("stdout", b"x\r\n\n", NOW)
    w.feed("stdout", b"hel", NOW)
    assert out == [STAMP + b" stdout F x\n", STAMP + b" stdout F \n"]
    w.feed("stdout", b"lo\n", NOW + 5)
    assert out[2] == b"2001-09-09T01:46:40.000000005Z stdout F hello\n"


def test_streams_keep_separate_partial_lines() -> None:
    w, out = _writer()
    w.feed("stdout", b"o1", NOW)
    w.feed("stderr", b"e1\n", NOW)
    w.feed("stdout", b"o2\n", NOW)
    assert out == [STAMP + b" stderr F e1\n", STAMP + b" stdout F o1o2\n"]


def test_eof_without_newline_is_partial() -> None:
    w, out = _writer()
    w.feed("stdout", b"done\nno newline", NOW)
    w.finish("stdout", NOW)
    w.finish("stderr", NOW)  # nothing pending: nothing written
    assert out == [STAMP + b" stdout F done\n", STAMP + b" stdout P no newline\n"]


def test_long_lines_are_cut_into_partial_entries() -> None:
    w, out = _writer(max_line=4)
    w.feed("stdout", b"abcdefghij\nabcdefgh\nabcd\n", NOW)
    tags = [line[len(STAMP) + 1 :] for line in out]
    assert tags == [
        b"stdout P abcd\n",
        b"stdout P efgh\n",
        b"stdout F ij\n",
        b"stdout P abcd\n",
        b"stdout F efgh\n",
        b"stdout F abcd\n",
    ]


def test_long_output_without_newline_is_flushed_before_eof() -> None:
    w, out = _writer(max_line=4)
    w.feed("stdout", b"abcde", NOW)
    assert out == [STAMP + b" stdout P abcd\n"]
    w.feed("stdout", b"fgh", NOW)  # exactly the limit pending: not yet written
    assert len(out) == 1
    w.finish("stdout", NOW)
    assert out[1] == STAMP + b" stdout P efgh\n"


def test_default_limit_is_containerds_16k() -> None:
    assert MAX_LOG_LINE == 16384
    w, out = _writer()
    w.feed("stdout", b"a" * 20000 + b"\n", NOW)
    assert out == [
        STAMP + b" stdout P " + b"a" * 16384 + b"\n",
        STAMP + b" stdout F " + b"a" * (20000 - 16384) + b"\n",
    ]
