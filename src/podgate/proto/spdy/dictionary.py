"""The SPDY/3 zlib dictionary (draft-3 §2.6.10.1) that primes both header-compression contexts.

Every SPDY/3 peer, spdystream included, compresses name/value blocks against these exact bytes;
a single wrong byte makes the first header block undecodable, so the digest is checked on import.
"""

from __future__ import annotations

import hashlib
import zlib

__all__ = ["HEADER_DICTIONARY"]

HEADER_DICTIONARY = (
    # 65 length-prefixed tokens (uint32 big-endian length, then the text).
    b"\x00\x00\x00\x07options"
    b"\x00\x00\x00\x04head"
    b"\x00\x00\x00\x04post"
    b"\x00\x00\x00\x03put"
    b"\x00\x00\x00\x06delete"
    b"\x00\x00\x00\x05trace"
    b"\x00\x00\x00\x06accept"
    b"\x00\x00\x00\x0eaccept-charset"
    b"\x00\x00\x00\x0faccept-encoding"
    b"\x00\x00\x00\x0faccept-language"
    b"\x00\x00\x00\x0daccept-ranges"
    b"\x00\x00\x00\x03age"
    b"\x00\x00\x00\x05allow"
    b"\x00\x00\x00\x0dauthorization"
    b"\x00\x00\x00\x0dcache-control"
    b"\x00\x00\x00\x0aconnection"
    b"\x00\x00\x00\x0ccontent-base"
    b"\x00\x00\x00\x10content-encoding"
    b"\x00\x00\x00\x10content-language"
    b"\x00\x00\x00\x0econtent-length"
    b"\x00\x00\x00\x10content-location"
    b"\x00\x00\x00\x0bcontent-md5"
    b"\x00\x00\x00\x0dcontent-range"
    b"\x00\x00\x00\x0ccontent-type"
    b"\x00\x00\x00\x04date"
    b"\x00\x00\x00\x04etag"
    b"\x00\x00\x00\x06expect"
    b"\x00\x00\x00\x07expires"
    b"\x00\x00\x00\x04from"
    b"\x00\x00\x00\x04host"
    b"\x00\x00\x00\x08if-match"
    b"\x00\x00\x00\x11if-modified-since"
    b"\x00\x00\x00\x0dif-none-match"
    b"\x00\x00\x00\x08if-range"
    b"\x00\x00\x00\x13if-unmodified-since"
    b"\x00\x00\x00\x0dlast-modified"
    b"\x00\x00\x00\x08location"
    b"\x00\x00\x00\x0cmax-forwards"
    b"\x00\x00\x00\x06pragma"
    b"\x00\x00\x00\x12proxy-authenticate"
    b"\x00\x00\x00\x13proxy-authorization"
    b"\x00\x00\x00\x05range"
    b"\x00\x00\x00\x07referer"
    b"\x00\x00\x00\x0bretry-after"
    b"\x00\x00\x00\x06server"
    b"\x00\x00\x00\x02te"
    b"\x00\x00\x00\x07trailer"
    b"\x00\x00\x00\x11transfer-encoding"
    b"\x00\x00\x00\x07upgrade"
    b"\x00\x00\x00\x0auser-agent"
    b"\x00\x00\x00\x04vary"
    b"\x00\x00\x00\x03via"
    b"\x00\x00\x00\x07warning"
    b"\x00\x00\x00\x10www-authenticate"
    b"\x00\x00\x00\x06method"
    b"\x00\x00\x00\x03get"
    b"\x00\x00\x00\x06status"
    b"\x00\x00\x00\x06200 OK"
    b"\x00\x00\x00\x07version"
    b"\x00\x00\x00\x08HTTP/1.1"
    b"\x00\x00\x00\x03url"
    b"\x00\x00\x00\x06public"
    b"\x00\x00\x00\x0aset-cookie"
    b"\x00\x00\x00\x0akeep-alive"
    b"\x00\x00\x00\x06origin"
    # A raw ASCII tail without length prefixes.
    b"100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    b"203 Non-Authoritative Information"
    b"204 No Content"
    b"301 Moved Permanently"
    b"400 Bad Request"
    b"401 Unauthorized"
    b"403 Forbidden"
    b"404 Not Found"
    b"500 Internal Server Error"
    b"501 Not Implemented"
    b"503 Service Unavailable"
    b"Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec "
    b"00:00:00 "
    b"Mon, Tue, Wed, Thu, Fri, Sat, Sun, "
    b"GMT"
    b"chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,"
    b"text/plain,text/javascript,"
    b"publicprivatemax-age="
    b"gzip,deflate,sdch"
    b"charset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)

_EXPECTED_LENGTH = 1423
_EXPECTED_ADLER32 = 0xE3C6A7C2  # also the DICTID in every first zlib header: 78 f9 e3 c6 a7 c2
_EXPECTED_SHA256 = "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"

if (
    len(HEADER_DICTIONARY) != _EXPECTED_LENGTH
    or zlib.adler32(HEADER_DICTIONARY) != _EXPECTED_ADLER32
    or hashlib.sha256(HEADER_DICTIONARY).hexdigest() != _EXPECTED_SHA256
):  # pragma: no cover - only a corrupted source file gets here
    raise ImportError("SPDY/3 header dictionary is corrupt")
