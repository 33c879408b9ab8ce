"""The pre-auth head scanner: simple heads come off the buffer exactly as h11 reads them; any
other head stops the scan and every byte not taken goes on to the full parser unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podgate.proto.pipeline import HeadScanner
from podgate.proto.upgrade import MAX_HEAD_BYTES, ServerHandshake, UpgradeRequest

SIMPLE = (
    b"GET /api/v1/namespaces/default/pods?limit=500 HTTP/1.1\r\n"
    b"Host: 127.0.0.1:6443\r\n"
    b"User-Agent: kubectl/v1.33.0\r\n"
    b"Accept:  application/json;as=Table \t\r\n"
    b"Authorization: Bearer abc\r\n\r\n"
)


def h11_requests(data: bytes) -> list[UpgradeRequest]:
    handshake = ServerHandshake()
    out = []
    request = handshake.receive_data(data)
    while request is not None:
        out.append(request)
        handshake.respond(401)
        request = handshake.receive_data(b"")
    return out


def scan(data: bytes) -> tuple[list[UpgradeRequest], HeadScanner]:
    scanner = HeadScanner()
    scanner.receive_data(data)
    out = []
    while (request := scanner.next_request()) is not None:
        out.append(request)
    return out, scanner


def test_simple_heads_read_as_h11_reads_them() -> None:
    requests, scanner = scan(SIMPLE * 3)
    assert requests == h11_requests(SIMPLE * 3)
    assert len(requests) == 3 and not scanner.stopped
    assert scanner.take_rest() == b""


@pytest.mark.parametrize(
    "head",
    [
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi",
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
        b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET /x HTTP/1.0\r\nHost: a\r\n\r\n",
        b"GET /x HTTP/1.1\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n folded\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nBad Name: 1\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
        b"\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
)
def test_other_heads_stop_the_scan_and_pass_on_unchanged(head: bytes) -> None:
    data = SIMPLE + head + SIMPLE
    requests, scanner = scan(data)
    assert len(requests) == 1
    assert scanner.stopped
    assert scanner.take_rest() == head + SIMPLE


def test_a_head_too_long_to_finish_stops_the_scan() -> None:
    scanner = HeadScanner()
    scanner.receive_data(b"GET /" + b"a" * MAX_HEAD_BYTES)
    assert scanner.next_request() is None
    assert scanner.stopped


def test_the_last_head_can_be_handed_back() -> None:
    scanner = HeadScanner()
    scanner.receive_data(SIMPLE + SIMPLE[:10])
    assert scanner.next_request() is not None
    assert scanner.next_request() is None and not scanner.stopped
    assert scanner.take_rest(with_last=True) == SIMPLE + SIMPLE[:10]


@given(st.lists(st.integers(min_value=1, max_value=len(SIMPLE) * 4 - 1), max_size=8))
def test_any_split_gives_the_same_requests(cuts: list[int]) -> None:
    data = SIMPLE * 4
    scanner = HeadScanner()
    got = []
    last = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        scanner.receive_data(data[last:cut])
        last = cut
        while (request := scanner.next_request()) is not None:
            got.append(request)
    assert got == h11_requests(data)
