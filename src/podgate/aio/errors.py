"""Network errors of the asyncio layer; OS errors are mapped here, once."""

from __future__ import annotations

import contextlib
import copy
import errno
from collections.abc import Iterator
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class StreamError(Exception):
    """Root of every error a ByteStream raises."""


class ClosedStreamError(StreamError):
    """We used a stream after closing it (or writing after our EOF)."""


class BrokenStreamError(StreamError):
    """The peer went away abruptly (reset, connection lost)."""


class BusyStreamError(StreamError):
    """Two tasks received (or sent) on one stream at once: their bytes would interleave."""


class StreamResetError(BrokenStreamError):
    """A multiplexed stream was reset by the peer; `status` is the protocol's code."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class StalledStreamError(StreamResetError):
    """We reset a stream whose reader made no progress for too long, so that the connection
    carrying it could read on."""


class ForwardError(StreamResetError):
    """A forwarded connection failed further along; the message is the explanation to pass on
    to the client (e.g. a runtime's `error forwarding port …` text)."""


class ConnectError(StreamError):
    """A connection could not be made; `errno` is kept for messages like containerd's."""

    def __init__(self, message: str, err: int | None = None) -> None:
        super().__init__(message)
        self.errno = err


def fresh(error: E) -> E:
    """A copy of a stored error, to raise in its place (`raise fresh(self._reset)`).

    Raising the stored instance hangs the traceback on it, and with it every frame it passed
    through and their locals (the stream itself, the chunk a splice was copying): a reference
    cycle from the object that stores the error, freed only when the cycle collector runs,
    which an idle daemon may not do for a long time after a burst of reset streams. The copy
    has the same type, message and attributes, and no traceback."""
    return copy.copy(error)


class ConflictGuard:
    """Detects a second task entering receive() or send() while the first still waits (as
    trio's ConflictDetector): interleaved reads or writes would corrupt the byte order."""

    __slots__ = ("_busy", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._busy = False

    def __enter__(self) -> None:
        if self._busy:
            raise BusyStreamError(f"another task is already {self._what} on this stream")
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


_BROKEN = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ESHUTDOWN}


@contextlib.contextmanager
def map_os_errors() -> Iterator[None]:
    """Turn OS errors into this module's errors (connection setup and I/O alike)."""
    try:
        yield
    except ConnectionRefusedError as exc:
        raise ConnectError(f"connect: {exc.strerror or 'connection refused'}", exc.errno) from exc
    except OSError as exc:
        if exc.errno in _BROKEN:
            raise BrokenStreamError(str(exc)) from exc
        raise ConnectError(str(exc), exc.errno) from exc
