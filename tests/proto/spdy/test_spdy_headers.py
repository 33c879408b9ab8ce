"""Name/value blocks and the zlib contexts, including hostile input."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import pytest
from spdy_support import h

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy import (
    MAX_HEADER_BLOCK_BYTES,
    HeaderCompressor,
    HeaderDecompressor,
    Role,
    SpdyConnection,
    SpdyConnectionError,
)
from podgate.proto.spdy.dictionary import HEADER_DICTIONARY
from podgate.proto.spdy.frames import encode_syn_stream
from podgate.proto.spdy.headers import (
    SYN_REPLY_FORBIDDEN_HEADERS,
    SYN_STREAM_FORBIDDEN_HEADERS,
    decode_header_block,
    encode_header_block,
)


def block(*pairs: tuple[bytes, bytes], count: int | None = None) -> bytes:
    """An uncompressed name/value block written out by hand (§1.4)."""
    out = struct.pack(">I", len(pairs) if count is None else count)
    for name, value in pairs:
        out += struct.pack(">I", len(name)) + name + struct.pack(">I", len(value)) + value
    return out


def compress_like_a_peer(*raw_blocks: bytes) -> list[bytes]:
    z = zlib.compressobj(9, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY, HEADER_DICTIONARY)
    return [z.compress(b) + z.flush(zlib.Z_SYNC_FLUSH) for b in raw_blocks]


def test_encode_block_layout() -> None:
    assert encode_header_block({}) == h("00 00 00 00")
    assert encode_header_block({"streamtype": "error"}) == h(
        "00 00 00 01 | 00 00 00 0a 73 74 72 65 61 6d 74 79 70 65 | 00 00 00 05 65 72 72 6f 72"
    )
    # Several values travel as one NUL-joined value.
    assert encode_header_block({"a": "x\0y"}) == block((b"a", b"x\0y"))


def test_decode_block_layout() -> None:
    assert decode_header_block(block()) == {}
    raw = block((b"port", b"8080"), (b"streamtype", b"data"), (b"requestid", b"0"))
    assert decode_header_block(raw) == {"port": "8080", "streamtype": "data", "requestid": "0"}
    assert decode_header_block(block((b"a", b"x\0y"), (b"", b""))) == {"a": "x\0y", "": ""}


def test_non_utf8_bytes_survive_a_round_trip() -> None:
    raw = block((b"x-bin", b"\xff\xfe\x00"))
    decoded = decode_header_block(raw)
    assert encode_header_block(decoded) == raw


@pytest.mark.parametrize(
    ("raw", "forbidden"),
    [
        (block((b"Streamtype", b"error")), frozenset[str]()),
        (block((b"a", b"1"), (b"a", b"2")), frozenset()),
        (block((b"host", b"x")), SYN_STREAM_FORBIDDEN_HEADERS),
        (block((b"transfer-encoding", b"x")), SYN_REPLY_FORBIDDEN_HEADERS),
        (block((b"connection", b"x")), SYN_REPLY_FORBIDDEN_HEADERS),
        (b"", frozenset()),  # no count
        (b"\x00\x00\x01", frozenset()),  # partial count
        (block((b"a", b"1"))[:-1], frozenset()),  # value cut short
        (block((b"abc", b"1"))[:9], frozenset()),  # name cut short
        (block((b"a", b"1"), count=2) + b"\x00\x00\x00\x00\x00\x00", frozenset()),  # count lies
        (block((b"a", b"1")) + b"\x00", frozenset()),  # trailing garbage
        (block(count=257) + bytes(257 * 8), frozenset()),  # too many pairs
    ],
)
def test_decode_block_faults_are_fatal(raw: bytes, forbidden: frozenset[str]) -> None:
    with pytest.raises(SpdyConnectionError):
        decode_header_block(raw, forbidden=forbidden)


def test_host_is_allowed_in_syn_reply() -> None:
    assert decode_header_block(block((b"host", b"x")), forbidden=SYN_REPLY_FORBIDDEN_HEADERS) == {
        "host": "x"
    }


@pytest.mark.parametrize(
    ("headers", "forbidden"),
    [
        ({"Streamtype": "error"}, frozenset[str]()),
        ({"": "x"}, frozenset()),
        ({"a\0b": "x"}, frozenset()),
        ({"host": "x"}, SYN_STREAM_FORBIDDEN_HEADERS),
        ({"x": "\ud800"}, frozenset()),  # lone surrogate: not encodable
        ({str(i): "" for i in range(257)}, frozenset()),
        ({"a": "x" * MAX_HEADER_BLOCK_BYTES}, frozenset()),
    ],
)
def test_encode_refuses(headers: dict[str, str], forbidden: frozenset[str]) -> None:
    with pytest.raises(LocalProtocolError):
        encode_header_block(headers, forbidden=forbidden)


def test_refused_block_leaves_the_compressor_usable() -> None:
    comp, decomp = HeaderCompressor(), HeaderDecompressor()
    with pytest.raises(LocalProtocolError):
        comp.compress({"Bad": "x"})
    assert decomp.decompress(comp.compress({"ok": "1"})) == {"ok": "1"}


def test_first_block_carries_the_zlib_header_with_the_dictionary_id() -> None:
    # §1.4 / §1.5: 78 f9 e3 c6 a7 c2 (CMF, FLG with FDICT, DICTID), later blocks have none,
    # and every block ends with the sync-flush marker 00 00 ff ff.
    comp = HeaderCompressor()
    first = comp.compress({"streamtype": "error"})
    second = comp.compress({"streamtype": "stdout"})
    assert first.startswith(h("78 f9 e3 c6 a7 c2"))
    assert not second.startswith(h("78"))
    assert first.endswith(h("00 00 ff ff"))
    assert second.endswith(h("00 00 ff ff"))


def test_kubectl_blocks_decompress_through_one_context() -> None:
    decomp = HeaderDecompressor()
    first = h(
        "78 f9 e3 c6 a7 c2 62 60 60 60 04 a7 b3 92 a2 d4 c4 5c 68 51 c2 9a 0a 0a 68"
        " 00 00 00 00 ff ff"
    )
    second = h("c2 2a c5 56 5c 92 92 5f 5a 02 00 00 00 ff ff")
    assert decomp.decompress(first) == {"streamtype": "error"}
    assert decomp.decompress(second) == {"streamtype": "stdout"}


def test_second_block_alone_does_not_decompress() -> None:
    with pytest.raises(SpdyConnectionError):
        HeaderDecompressor().decompress(h("c2 2a c5 56 5c 92 92 5f 5a 02 00 00 00 ff ff"))


def test_stream_without_dictionary_is_accepted() -> None:
    # Go's zlib reader takes a stream with no FDICT (reference §1.4); so do we.
    z = zlib.compressobj(9)
    data = z.compress(block((b"a", b"b"))) + z.flush(zlib.Z_SYNC_FLUSH)
    assert data.startswith(h("78 da"))
    assert HeaderDecompressor().decompress(data) == {"a": "b"}


def test_block_split_mid_flush_is_fatal() -> None:
    # The compressed block must be exactly the rest of the frame: a block cut before its
    # flush marker yields a truncated name/value block.
    (data,) = compress_like_a_peer(block((b"streamtype", b"error")))
    with pytest.raises(SpdyConnectionError):
        HeaderDecompressor().decompress(data[:-6])


def test_garbage_is_fatal() -> None:
    with pytest.raises(SpdyConnectionError):
        HeaderDecompressor().decompress(b"\x00\x01\x02garbage")


def test_data_after_a_finished_zlib_stream_is_fatal() -> None:
    z = zlib.compressobj(9, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY, HEADER_DICTIONARY)
    data = z.compress(block()) + z.flush(zlib.Z_FINISH)
    with pytest.raises(SpdyConnectionError):
        HeaderDecompressor().decompress(data + b"\x00\x00")


def test_block_at_exactly_the_cap_is_accepted() -> None:
    value = b"v" * (MAX_HEADER_BLOCK_BYTES - len(block((b"a", b""))))
    raw = block((b"a", value))
    assert len(raw) == MAX_HEADER_BLOCK_BYTES
    (data,) = compress_like_a_peer(raw)
    assert HeaderDecompressor().decompress(data) == {"a": value.decode()}
    (data,) = compress_like_a_peer(block((b"a", value + b"v")))
    with pytest.raises(SpdyConnectionError):
        HeaderDecompressor().decompress(data)


@pytest.fixture(scope="module")
def zlib_bomb() -> tuple[bytes, int]:
    """A SYN_STREAM whose block claims one 2 GiB header value and inflates to over 1 GiB."""
    z = zlib.compressobj(9, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY, HEADER_DICTIONARY)
    parts = [z.compress(struct.pack(">II", 1, 1) + b"a" + struct.pack(">I", 2**31))]
    zeros = bytes(16 * 1024 * 1024)
    inflated = 0
    while inflated <= 2**30:
        parts.append(z.compress(zeros))
        inflated += len(zeros)
    parts.append(z.flush(zlib.Z_SYNC_FLUSH))
    compressed = b"".join(parts)
    return encode_syn_stream(1, compressed), inflated


def test_zlib_bomb_is_rejected_with_bounded_memory(zlib_bomb: tuple[bytes, int]) -> None:
    frame, inflated = zlib_bomb
    assert inflated > 2**30
    assert 500_000 < len(frame) < 4 * 1024 * 1024  # ~1 MB on the wire
    conn = SpdyConnection(Role.SERVER)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(SpdyConnectionError):
            conn.receive_data(frame)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The frame itself was allocated before tracing began; what we allocate on top of it is
    # bounded by the inflate cap, not by the 1 GiB the block would expand to.
    assert peak < 4 * 1024 * 1024
    assert elapsed < 20.0  # inflating the whole 1 GiB would take minutes
    assert conn.closed


def test_huge_pair_count_is_rejected_without_allocating() -> None:
    warmup, data = compress_like_a_peer(block(), struct.pack(">I", 2**31) + b"\x00" * 12)
    decomp = HeaderDecompressor()
    assert decomp.decompress(warmup) == {}  # zlib allocates its window on first use
    tracemalloc.start()
    try:
        with pytest.raises(SpdyConnectionError, match="pairs"):
            decomp.decompress(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # zlib's 32 KiB output block; nothing scales with the count


def test_pair_count_larger_than_the_bytes_present_is_rejected() -> None:
    # 200 pairs is under the cap, but 200 pairs need at least 1,600 bytes.
    (data,) = compress_like_a_peer(struct.pack(">I", 200) + block((b"a", b"b"))[4:])
    with pytest.raises(SpdyConnectionError, match="only"):
        HeaderDecompressor().decompress(data)
