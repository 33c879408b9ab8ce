import hashlib
import struct
import zlib

from podgate.proto.spdy.dictionary import HEADER_DICTIONARY


def test_digests_match_the_reference() -> None:
    assert len(HEADER_DICTIONARY) == 1423
    assert zlib.adler32(HEADER_DICTIONARY) == 0xE3C6A7C2
    assert (
        hashlib.sha256(HEADER_DICTIONARY).hexdigest()
        == "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"
    )


def test_structure_is_65_tokens_then_a_574_byte_tail() -> None:
    pos = 0
    tokens: list[bytes] = []
    while len(tokens) < 65:
        (length,) = struct.unpack_from(">I", HEADER_DICTIONARY, pos)
        tokens.append(HEADER_DICTIONARY[pos + 4 : pos + 4 + length])
        pos += 4 + length
    assert pos == 849
    assert tokens[:3] == [b"options", b"head", b"post"]
    assert tokens[-3:] == [b"set-cookie", b"keep-alive", b"origin"]
    tail = HEADER_DICTIONARY[pos:]
    assert len(tail) == 574
    assert tail.startswith(b"100101201202205206300302")
    assert tail.endswith(b"utf-,*,enq=0.")
