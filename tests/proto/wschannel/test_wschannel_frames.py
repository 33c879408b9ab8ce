"""Frame headers and masking against the examples of RFC 6455 section 5.7."""

from __future__ import annotations

import pytest

from podgate.proto.wschannel.frames import FIN, Opcode, apply_mask, encode_header, rotate

RFC_MASK = bytes.fromhex("37fa213d")


def test_rfc_masked_hello() -> None:
    # RFC 6455 5.7: "Hello" masked with 37 fa 21 3d is 7f 9f 4d 51 58.
    assert apply_mask(b"Hello", RFC_MASK) == bytes.fromhex("7f9f4d5158")
    assert apply_mask(bytes.fromhex("7f9f4d5158"), RFC_MASK) == b"Hello"
    assert encode_header(FIN | Opcode.TEXT, 5, RFC_MASK) == bytes.fromhex("818537fa213d")


def test_rotated_key_continues_the_mask() -> None:
    # Masking "Hello" in two pieces, the second with the key rotated by the first's length,
    # gives the RFC bytes.
    assert apply_mask(b"He", RFC_MASK) + apply_mask(b"llo", rotate(RFC_MASK, 2)) == (
        bytes.fromhex("7f9f4d5158")
    )
    assert rotate(RFC_MASK, 0) == RFC_MASK
    assert rotate(RFC_MASK, 1) == bytes.fromhex("fa213d37")
    assert rotate(RFC_MASK, 5) == rotate(RFC_MASK, 1)
    assert apply_mask(memoryview(b"xHello")[1:], RFC_MASK) == bytes.fromhex("7f9f4d5158")


@pytest.mark.parametrize(
    ("first", "length", "expected"),
    [
        # RFC 6455 5.7: an unmasked "Hello" text frame.
        (FIN | Opcode.TEXT, 5, "8105"),
        # RFC 6455 5.7: unmasked ping "Hello".
        (FIN | Opcode.PING, 5, "8905"),
        # RFC 6455 5.7: 256 bytes of binary data in a single unmasked frame.
        (FIN | Opcode.BINARY, 256, "827e0100"),
        # RFC 6455 5.7: 64 KiB of binary data in a single unmasked frame.
        (FIN | Opcode.BINARY, 65536, "827f0000000000010000"),
        # RFC 6455 5.2: 125 is the largest 7-bit length, 65535 the largest 16-bit one.
        (FIN | Opcode.BINARY, 125, "827d"),
        (FIN | Opcode.BINARY, 126, "827e007e"),
        (FIN | Opcode.BINARY, 65535, "827effff"),
        # RFC 6455 5.7: the first fragment of an unmasked text message.
        (Opcode.TEXT, 3, "0103"),
        (FIN | Opcode.CONTINUATION, 2, "8002"),
    ],
)
def test_unmasked_headers(first: int, length: int, expected: str) -> None:
    assert encode_header(first, length) == bytes.fromhex(expected)


def test_masked_long_header_sets_the_mask_bit_and_appends_the_key() -> None:
    assert encode_header(FIN | Opcode.BINARY, 65536, RFC_MASK) == bytes.fromhex(
        "82ff0000000000010000" + "37fa213d"
    )
