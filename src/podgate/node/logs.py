"""Container logs in the CRI format, read back for `kubectl logs` (tail, timestamps, follow).

A CRI log line is `<RFC3339Nano> <stdout|stderr> <F|P> <content>`; `P` marks a piece of a long
line whose rest follows, so pieces are joined before a line is shown.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

# Read size while following or scanning a log file.
LOG_READ_BYTES = 256 * 1024
# How often a followed log is checked for growth (kubelet uses inotify; polling is plenty).
FOLLOW_POLL_SECONDS = 0.1
# A line longer than this (joined pieces) is cut: one runaway line must not exhaust memory.
MAX_LOG_LINE_BYTES = 1024 * 1024


class LogSourceLost(Exception):
    """Whether a followed container still runs cannot be told (its runtime does not answer):
    the follow ends with an error, never as if the container had exited."""


@dataclass(frozen=True, slots=True)
class LogLine:
    timestamp: str
    stream: str
    content: bytes  # without the newline


def parse_cri_line(raw: bytes) -> tuple[str, str, bool, bytes] | None:
    """(timestamp, stream, partial, content) of one line without its newline; None if bad."""
    parts = raw.split(b" ", 3)
    if len(parts) < 3:
        return None
    timestamp, stream, tag = parts[0], parts[1], parts[2]
    if stream not in (b"stdout", b"stderr") or tag not in (b"F", b"P"):
        return None
    content = parts[3] if len(parts) == 4 else b""
    return timestamp.decode("ascii", "replace"), stream.decode(), tag == b"P", content


class LineAssembler:
    """Joins P pieces into whole lines, per stream."""

    def __init__(self) -> None:
        self._pending: dict[str, bytearray] = {}

    def feed(self, raw: bytes) -> LogLine | None:
        parsed = parse_cri_line(raw)
        if parsed is None:
            return None
        timestamp, stream, partial, content = parsed
        buf = self._pending.setdefault(stream, bytearray())
        if len(buf) < MAX_LOG_LINE_BYTES:
            buf += content[: MAX_LOG_LINE_BYTES - len(buf)]
        if partial:
            return None
        line = LogLine(timestamp, stream, bytes(buf))
        buf.clear()
        return line


def render(line: LogLine, timestamps: bool) -> bytes:
    prefix = f"{line.timestamp} ".encode() if timestamps else b""
    return prefix + line.content + b"\n"


async def read_log(
    path: str,
    *,
    tail_lines: int | None = None,
    timestamps: bool = False,
    follow: bool = False,
    still_running: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The log as `kubectl logs` prints it. With `follow`, keeps going while the file grows
    and `still_running()` says so; ends once the container stopped and the file is drained.
    `still_running()` raises LogSourceLost when it cannot tell; that ends the follow too."""
    reader = _LogFile(path)
    if tail_lines is not None:
        window: collections.deque[bytes] = collections.deque(maxlen=max(tail_lines, 0))
        async for line in reader.new_lines():
            window.append(render(line, timestamps))
        if window:
            yield b"".join(window)
    else:
        async for line in reader.new_lines():
            yield render(line, timestamps)
    while follow:
        grew = False
        async for line in reader.new_lines():
            grew = True
            yield render(line, timestamps)
        if grew:
            continue
        if still_running is not None and not await still_running():
            async for line in reader.new_lines():  # output written just before the exit
                yield render(line, timestamps)
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)


class _LogFile:
    """Reads whole CRI lines from where the last read stopped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0  # just past the last complete line
        self.assembler = LineAssembler()

    async def new_lines(self) -> AsyncIterator[LogLine]:
        pending = b""
        while True:
            chunk = await asyncio.to_thread(
                _read_at, self.path, self.offset + len(pending), LOG_READ_BYTES
            )
            if not chunk:
                return
            data = pending + chunk
            start = 0
            while (end := data.find(b"\n", start)) != -1:
                self.offset += end + 1 - start
                line = self.assembler.feed(data[start:end])
                start = end + 1
                if line is not None:
                    yield line
            pending = data[start:]
            if len(pending) > 2 * MAX_LOG_LINE_BYTES:
                # A writer that never ends its line: skip what cannot be a valid CRI line.
                self.offset += len(pending)
                pending = b""


def _read_at(path: str, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        return b""


@dataclass(frozen=True, slots=True)
class LogSource:
    """Where a container's log is, and how to tell whether more may come."""

    path: str
    still_running: Callable[[], Awaitable[bool]]  # may raise LogSourceLost


def log_exists(path: str) -> bool:
    return os.path.exists(path)
