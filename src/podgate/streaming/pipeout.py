"""A process's output (a socket, a pipe or a pty master) read in the event loop's own callback.

Each readiness is one `os.read` of up to OUTPUT_READ_BYTES appended to a buffer; the consumer
takes everything buffered at once. There is no task, timer or `wait_for` per read, and nothing
ever waits for more to arrive: a lone keystroke's echo is read and handed over at once, while
under a flood the reads that land during a send pile up and leave together in one frame.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from typing import Any

# Largest single read: as much as a pipe can hold (64 KiB by default, more when enlarged) and
# more, so a full pipe empties in one system call.
OUTPUT_READ_BYTES = 256 * 1024
# Unsent output beyond this stops the reads: the process then blocks on its full pipe and the
# client's pace, not our memory, sets its speed.
OUTPUT_BUFFER_BYTES = 1024 * 1024


def output_socketpair() -> tuple[int, int]:
    """(ours, the command's) descriptors for a command's stdout or stderr: a unix socket pair,
    never a pipe. A process that splices from a socket into a pipe (busybox `cat` reading its
    stdin with sendfile) holds the pipe's lock while it waits for input, and our read of the
    other end then sleeps in the kernel until input comes, O_NONBLOCK or not: the whole event
    loop stops, including whatever would have sent that input. A socket's reader takes no lock
    that its writer can hold. Both are close-on-exec; the spawn dup()s the command's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.shutdown(socket.SHUT_WR)  # the command reads nothing back from its output
    return ours.detach(), theirs.detach()


async def spawn_with_outputs(
    argv: Sequence[str], **options: Any
) -> tuple[asyncio.subprocess.Process, int, int]:
    """Start `argv` with its stdout and stderr on output_socketpair()s; returns the process
    and our ends of both (the caller reads them with PipeOutput and closes them). `options`
    go to create_subprocess_exec (stdin, cwd, start_new_session…)."""
    out_r, out_w = output_socketpair()
    err_r, err_w = output_socketpair()
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=out_w, stderr=err_w, **options)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return proc, out_r, err_r


class PipeOutput:
    """Reads `fd` (made non-blocking) until EOF; EIO counts as EOF (a pty whose last slave fd
    closed). The caller owns the fd: `stop()` removes the reader, closing is the caller's."""

    def __init__(self, fd: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        os.set_blocking(fd, False)
        self._buffer = bytearray()
        self._eof = False
        self._reading = False
        self._waiter: asyncio.Future[None] | None = None
        self._resume()

    @property
    def buffered(self) -> int:
        """Bytes read and not yet taken."""
        return len(self._buffer)

    def _resume(self) -> None:
        if not self._reading and not self._eof:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, OUTPUT_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EIO from a pty master once the process side is gone
            data = b""
        if data:
            self._buffer += data
            if len(self._buffer) >= OUTPUT_BUFFER_BYTES:
                self._pause()
        else:
            self._pause()
            self._eof = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self) -> bytearray:
        """Everything read so far and not yet taken (at least one byte), or empty at EOF.
        The buffer is handed over, never reused: a transport may keep it until sent."""
        while not self._buffer and not self._eof:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk, self._buffer = self._buffer, bytearray()
        self._resume()
        return chunk

    def stop(self) -> None:
        """Stop reading (idempotent); buffered output is dropped with the object."""
        self._pause()
        self._eof = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
