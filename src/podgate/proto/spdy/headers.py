"""SPDY/3 name/value header blocks and their per-direction zlib contexts.

Each direction of a connection has exactly one compression context, living as long as the
connection; SYN_STREAM, SYN_REPLY and HEADERS share it. Header names and values are text on the
API side and bytes on the wire: UTF-8, with `surrogateescape` so that any byte string a peer sends
survives a decode/encode round trip unchanged.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy.dictionary import HEADER_DICTIONARY
from podgate.proto.spdy.errors import SpdyConnectionError
from podgate.proto.spdy.frames import BytesLike, GoAwayStatus

__all__ = [
    "MAX_HEADER_BLOCK_BYTES",
    "MAX_HEADER_PAIRS",
    "SYN_REPLY_FORBIDDEN_HEADERS",
    "SYN_STREAM_FORBIDDEN_HEADERS",
    "HeaderCompressor",
    "HeaderDecompressor",
    "decode_header_block",
    "encode_header_block",
]

# bytes, decompressed; k8s blocks are a few dozen bytes, and this caps what a zlib bomb can
# make us allocate per block.
MAX_HEADER_BLOCK_BYTES = 256 * 1024
# pairs per block; k8s sends at most three, and the count is attacker-controlled.
MAX_HEADER_PAIRS = 256
# bytes of compressed input handed to zlib per call; bounds the `unconsumed_tail` copies.
_INFLATE_INPUT_STEP = 16 * 1024
_MIN_PAIR_BYTES = 8  # two uint32 lengths, even for an empty name and value

# spdystream rejects these names (fatal) in a SYN_STREAM, and all but `host` in a SYN_REPLY.
SYN_STREAM_FORBIDDEN_HEADERS = frozenset(
    {"connection", "host", "keep-alive", "proxy-connection", "transfer-encoding"}
)
SYN_REPLY_FORBIDDEN_HEADERS = SYN_STREAM_FORBIDDEN_HEADERS - {"host"}

_U32 = struct.Struct(">I")
_ENCODING = "utf-8"
_ERRORS = "surrogateescape"


def encode_header_block(
    headers: Mapping[str, str], *, forbidden: frozenset[str] = frozenset()
) -> bytes:
    """Serialise an uncompressed name/value block. Several values for one name are the caller's
    job: join them with NUL into one value (the wire format has each name once)."""
    if len(headers) > MAX_HEADER_PAIRS:
        raise LocalProtocolError(f"{len(headers)} headers, more than {MAX_HEADER_PAIRS}")
    parts = [_U32.pack(len(headers))]
    seen: set[bytes] = set()
    for name, value in headers.items():
        if not name:
            raise LocalProtocolError("empty header name")
        if name != name.lower():
            raise LocalProtocolError(f"header name {name!r} is not lower-case")
        if "\0" in name:
            raise LocalProtocolError(f"header name {name!r} contains NUL")
        if name in forbidden:
            raise LocalProtocolError(f"header {name!r} is forbidden in this frame")
        try:
            raw_name = name.encode(_ENCODING, _ERRORS)
            raw_value = value.encode(_ENCODING, _ERRORS)
        except UnicodeEncodeError as exc:
            raise LocalProtocolError(f"header {name!r} cannot be encoded: {exc}") from None
        if raw_name in seen:  # distinct str keys can encode alike only via surrogateescape
            raise LocalProtocolError(f"duplicate header name {name!r}")
        seen.add(raw_name)
        parts += (_U32.pack(len(raw_name)), raw_name, _U32.pack(len(raw_value)), raw_value)
    block = b"".join(parts)
    if len(block) > MAX_HEADER_BLOCK_BYTES:
        raise LocalProtocolError(f"header block of {len(block)} bytes is too large")
    return block


def decode_header_block(
    block: BytesLike, *, forbidden: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Parse an uncompressed name/value block that must be consumed exactly. Every fault is a
    connection error, as in spdystream."""
    view = memoryview(block)
    size = len(view)
    if size < 4:
        raise _fatal("header block truncated before the pair count")
    count = _U32.unpack_from(view)[0]
    if count > MAX_HEADER_PAIRS:
        raise _fatal(f"header block claims {count} pairs, more than {MAX_HEADER_PAIRS}")
    if count * _MIN_PAIR_BYTES > size - 4:
        raise _fatal(f"header block claims {count} pairs but has only {size - 4} bytes")
    headers: dict[str, str] = {}
    pos = 4
    for _ in range(count):
        raw_name, pos = _read_string(view, pos)
        raw_value, pos = _read_string(view, pos)
        name = raw_name.decode(_ENCODING, _ERRORS)
        if name != name.lower():
            raise _fatal(f"header name {name!r} is not lower-case")
        if name in headers:
            raise _fatal(f"duplicate header name {name!r}")
        if name in forbidden:
            raise _fatal(f"header {name!r} is forbidden in this frame")
        headers[name] = raw_value.decode(_ENCODING, _ERRORS)
    if pos != size:
        raise _fatal(f"{size - pos} bytes of trailing garbage after the header block")
    return headers


def _read_string(view: memoryview, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(view):
        raise _fatal("header block truncated in a length field")
    length = _U32.unpack_from(view, pos)[0]
    pos += 4
    end = pos + length
    if end > len(view):
        raise _fatal("header block truncated in a name or value")
    return bytes(view[pos:end]), end


class HeaderCompressor:
    """Our sending context: level 9, the SPDY dictionary, a sync flush after every block.

    The first block starts with the zlib header `78 f9 e3 c6 a7 c2`; later blocks continue the
    same deflate stream and have no header.
    """

    def __init__(self) -> None:
        self._zlib = zlib.compressobj(
            9, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY, HEADER_DICTIONARY
        )

    def compress(
        self, headers: Mapping[str, str], *, forbidden: frozenset[str] = frozenset()
    ) -> bytes:
        """Encode and compress one block. Validation happens before zlib is touched, so a
        refused block leaves the context usable."""
        block = encode_header_block(headers, forbidden=forbidden)
        return self._zlib.compress(block) + self._zlib.flush(zlib.Z_SYNC_FLUSH)


class HeaderDecompressor:
    """The peer's context, inflated with a hard cap on output so a zlib bomb costs us at most
    MAX_HEADER_BLOCK_BYTES. Also accepts a stream without FDICT, as Go's zlib reader does."""

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(zdict=HEADER_DICTIONARY)

    def decompress(
        self, compressed: BytesLike, *, forbidden: frozenset[str] = frozenset()
    ) -> dict[str, str]:
        return decode_header_block(self.inflate(compressed), forbidden=forbidden)

    def inflate(self, compressed: BytesLike) -> bytes:
        """Inflate one block's compressed bytes (the rest of its frame) without parsing them."""
        view = memoryview(compressed)
        out = bytearray()
        try:
            for start in range(0, len(view), _INFLATE_INPUT_STEP):
                chunk: BytesLike = view[start : start + _INFLATE_INPUT_STEP]
                while chunk:
                    # One byte of headroom tells "exactly at the cap" from "over it".
                    room = MAX_HEADER_BLOCK_BYTES - len(out) + 1
                    out += self._zlib.decompress(chunk, room)
                    if len(out) > MAX_HEADER_BLOCK_BYTES:
                        raise _fatal(f"header block inflates past {MAX_HEADER_BLOCK_BYTES} bytes")
                    chunk = self._zlib.unconsumed_tail
        except zlib.error as exc:
            raise _fatal(f"header block does not decompress: {exc}") from None
        if self._zlib.unused_data:
            # The peer ended its deflate stream (Go's reader would stop there too); whatever
            # follows cannot be header data.
            raise _fatal("data after the end of the header compression stream")
        return bytes(out)


def _fatal(message: str) -> SpdyConnectionError:
    return SpdyConnectionError(message, GoAwayStatus.PROTOCOL_ERROR)
