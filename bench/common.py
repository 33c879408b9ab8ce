"""What every bench process shares: the verification pattern, the target's wire format, sizes.

The bytes moved are a fixed pseudo-random pattern, so the receiving end checks every byte with
a memcmp against the expected slice (no hashing on the hot path, which would cap the direct
path below the loopback limit) and any loss, duplication or reordering shows.
"""

from __future__ import annotations

import random
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

from podgate.aio.loop import loop_name, run

T = TypeVar("T")

# Pattern period: an odd length, so reordered frames (power-of-two sizes) never line up with it.
PATTERN_BYTES = 1024 * 1024 + 13
# Largest piece handed to one send/recv: big calls keep per-call overhead out of the figures.
IO_CHUNK_BYTES = 1024 * 1024
# Seed of the pattern; every process derives the same bytes from it.
PATTERN_SEED = 20240613
# Longest request line a client sends to the target ("U <size>\n" / "D <size>\n").
MAX_REQUEST_LINE_BYTES = 64
# Longest reply line the sink sends back.
MAX_REPLY_LINE_BYTES = 128

# Ports the benchmark pod "exposes"; each podgate server maps them to the target's real ports.
BULK_REMOTE_PORT = 7001
ECHO_REMOTE_PORT = 7000
POD_NAMESPACE = "default"
POD_NAME = "bench"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'1G', '256M', '2MiB', '4096' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 256M, 1G, 2MiB)")
    size = int(float(m[1]) * _UNITS[m[2].lower()])
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def format_size(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


class Pattern:
    """The byte stream every path carries: offset i holds byte i % PATTERN_BYTES of a seed."""

    def __init__(self, seed: int = PATTERN_SEED) -> None:
        period = random.Random(seed).randbytes(PATTERN_BYTES)
        # Doubled, so any window of up to one period starting anywhere is one contiguous slice.
        self._doubled = period + period
        self._view = memoryview(self._doubled)

    def chunk(self, offset: int, size: int) -> memoryview:
        """Read-only view of the `size` bytes at stream `offset` (size <= PATTERN_BYTES)."""
        start = offset % PATTERN_BYTES
        return self._view[start : start + min(size, PATTERN_BYTES)]

    def first_mismatch(self, offset: int, data: bytes | bytearray | memoryview) -> int | None:
        """Index in `data` of the first byte that differs from the pattern at stream `offset`
        (None: all match). The check is a memcmp without copies; only a failing piece is
        searched byte by byte."""
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            piece = view[pos : pos + PATTERN_BYTES]
            start = (offset + pos) % PATTERN_BYTES
            if not self._doubled.startswith(piece, start):
                expected = self._view[start : start + len(piece)]
                return pos + next(i for i in range(len(piece)) if piece[i] != expected[i])
            pos += len(piece)
        return None


class Verifier:
    """Checks a received stream against the pattern; remembers the first bad offset."""

    def __init__(self, pattern: Pattern, expected: int) -> None:
        self.pattern = pattern
        self.expected = expected
        self.received = 0
        self.first_bad: int | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        size = len(data)
        if self.received + size > self.expected:
            if self.first_bad is None:
                self.first_bad = self.expected
        elif self.first_bad is None:
            bad = self.pattern.first_mismatch(self.received, data)
            if bad is not None:
                self.first_bad = self.received + bad
        self.received += size

    @property
    def done(self) -> bool:
        return self.received >= self.expected

    @property
    def ok(self) -> bool:
        return self.first_bad is None and self.received == self.expected


def upload_request(size: int) -> bytes:
    """Ask the target to sink `size` pattern bytes and then report."""
    return b"U %d\n" % size


def download_request(size: int) -> bytes:
    """Ask the target to send `size` pattern bytes."""
    return b"D %d\n" % size


def sink_reply(received: int, first_bad: int | None) -> bytes:
    if first_bad is None:
        return b"OK %d\n" % received
    return b"BAD %d %d\n" % (received, first_bad)


def parse_sink_reply(line: bytes, expected: int) -> str | None:
    """None when the sink verified exactly `expected` bytes, else what went wrong."""
    parts = line.split()
    if len(parts) == 2 and parts[0] == b"OK" and parts[1] == str(expected).encode():
        return None
    return f"sink reported {line.decode(errors='replace').strip()!r}, expected OK {expected}"


# "podgate": whatever podgate itself runs on (podgate.aio.loop: uvloop when installed).
LOOP_CHOICES = ("podgate", "asyncio", "uvloop")


def resolve_loop(choice: str) -> str:
    """The event loop a choice means on this machine: "asyncio" or "uvloop"."""
    if choice == "podgate":
        return loop_name()
    return choice


def run_on(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """Run `main` the way podgate runs its own event loop, on the resolved `loop`."""
    return run(main, use_uvloop=loop == "uvloop")


# The parts beside the loopback paths, each with its --PART/--no-PART switch (most on by
# default as root); --only names the ones to run and turns every other off.
PARTS = (
    "runtime",
    "containerd",
    "gateway",
    "forward",
    "images",
    "podstart",
    "authflood",
    "manyforwards",
    "proxy",
)
