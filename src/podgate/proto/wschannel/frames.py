"""RFC 6455 frame constants and header encoding (section 5.2), and the masking primitive.

Masking is websockets' `apply_mask` (C, SSE2/NEON; pure Python only where its extension is
missing). Everything else about frames is here and in `endpoint.py`; see there for why.
"""

from __future__ import annotations

import struct
from enum import IntEnum

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - platforms without the compiled extension
    from websockets.utils import apply_mask

__all__ = [
    "FIN",
    "MASK_BYTES",
    "MAX_CONTROL_PAYLOAD_BYTES",
    "MAX_HEADER_BYTES",
    "Opcode",
    "apply_mask",
    "encode_header",
    "rotate",
]


class Opcode(IntEnum):
    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


FIN = 0x80
RSV_BITS = 0x70  # no extension is ever negotiated, so all three must be clear
OPCODE_BITS = 0x0F
MASK_BIT = 0x80
LENGTH_BITS = 0x7F
# Length codes in the second byte that announce a 16-bit or 64-bit extended length.
LENGTH_16 = 126
LENGTH_64 = 127
# RFC 6455 5.5: control frame payloads are at most 125 bytes.
MAX_CONTROL_PAYLOAD_BYTES = 125
# Largest payload a 16-bit extended length carries.
MAX_LENGTH_16 = 0xFFFF
# The masking key is 32 bits.
MASK_BYTES = 4
# 2 fixed bytes, up to 8 of extended length, then a 4-byte masking key.
MAX_HEADER_BYTES = 2 + 8 + MASK_BYTES

_SHORT = struct.Struct("!BB")
_MEDIUM = struct.Struct("!BBH")
_LONG = struct.Struct("!BBQ")


def encode_header(first: int, length: int, mask: bytes | None = None) -> bytes:
    """The header of a frame: `first` is FIN|opcode, `mask` the key when we are a client."""
    bit = 0 if mask is None else MASK_BIT
    if length < LENGTH_16:
        head = _SHORT.pack(first, bit | length)
    elif length <= MAX_LENGTH_16:
        head = _MEDIUM.pack(first, bit | LENGTH_16, length)
    else:
        head = _LONG.pack(first, bit | LENGTH_64, length)
    return head if mask is None else head + mask


def rotate(mask: bytes, offset: int) -> bytes:
    """The key that unmasks (or masks) payload starting `offset` bytes into the frame."""
    offset %= MASK_BYTES
    return mask[offset:] + mask[:offset] if offset else mask
