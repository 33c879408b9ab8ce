"""Relay two plain sockets in the kernel: `os.splice` through a pipe per direction.

The bytes never enter Python: per chunk of up to PIPE_BYTES, one splice moves them from the
source socket into the pipe and one (or a few, when the destination is slow) from the pipe
into the destination socket. With a ~1 MiB pipe this costs about what a C relay costs per GB
(see the shared docs' performance notes); a 64 KiB pipe doubles it.

One direction is the exception: from a unix socket into a TCP socket (the agent's dial-back
into the pod's server), splicing measured ~1.35x the CPU per GB of a plain recv_into and send
through a COPY_BYTES buffer, at ~0.7x the throughput, so that direction copies, in the same
loop (`python -m bench.relaymodes`; bench/README.md, "The agent path against the netns
path"). TCP into a unix socket, and TCP into TCP, splice: there splicing is the cheaper.

Streams that cannot be handed over (TLS, unsent bytes, already closed) fall back to the
ByteStream copy of podgate.aio.splice, with the same results and EOF/grace semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from typing import Final

from podgate.aio.errors import BrokenStreamError
from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS, SpliceResult, splice
from podgate.aio.streams import ByteStream, SocketStream

__all__ = ["COPY_BYTES", "PIPE_BYTES", "pipe", "splice_sockets", "wait_ready"]

# The pipe between the sockets: bytes moved per pair of splice calls. The kernel caps it at
# /proc/sys/fs/pipe-max-size for unprivileged processes (1 MiB by default).
PIPE_BYTES: Final = 1024 * 1024
# Linux's F_SETPIPE_SZ (not in Python's fcntl before 3.10 on every platform).
F_SETPIPE_SZ: Final = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_FLAGS: Final = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
# The buffer of a direction that copies (unix into TCP): as large as a SPDY DATA frame; more
# did not cost less per GB.
COPY_BYTES: Final = 256 * 1024
_TCP_FAMILIES: Final = (socket.AF_INET, socket.AF_INET6)


def pipe() -> tuple[int, int]:
    """A non-blocking pipe of PIPE_BYTES (or the most the kernel allows)."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # a smaller pipe still works, at more calls per GB
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
    return r, w


async def wait_ready(add: Callable[..., None], remove: Callable[[int], object], fd: int) -> None:
    """Wait until `fd` is readable (add_reader) or writable (add_writer)."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    add(fd, wake)
    try:
        await waiter
    finally:
        remove(fd)


async def _pump(
    src: socket.socket,
    dst: socket.socket,
    pending: bytes,
    at_eof: bool,
    count: Callable[[int], None],
) -> None:
    loop = asyncio.get_running_loop()
    try:
        if pending:  # received before the hand-over
            await loop.sock_sendall(dst, pending)
            count(len(pending))
        if not at_eof:
            if src.family == socket.AF_UNIX and dst.family in _TCP_FAMILIES:
                await _copy(src, dst, count)
            else:
                await _splice(src, dst, count)
        dst.shutdown(socket.SHUT_WR)
    except OSError as exc:  # reset, broken pipe: the relay is over, both ways
        raise BrokenStreamError(str(exc)) from exc


async def _splice(src: socket.socket, dst: socket.socket, count: Callable[[int], None]) -> None:
    loop = asyncio.get_running_loop()
    r, w = pipe()
    try:
        while True:
            try:
                n = os.splice(src.fileno(), w, PIPE_BYTES, flags=_FLAGS)
            except BlockingIOError:
                await wait_ready(loop.add_reader, loop.remove_reader, src.fileno())
                continue
            if n == 0:
                return
            left = n
            while left:
                try:
                    left -= os.splice(r, dst.fileno(), left, flags=_FLAGS)
                except BlockingIOError:
                    await wait_ready(loop.add_writer, loop.remove_writer, dst.fileno())
            count(n)
    finally:
        os.close(r)
        os.close(w)


async def _copy(src: socket.socket, dst: socket.socket, count: Callable[[int], None]) -> None:
    """The same loop through a buffer of ours: from a unix socket into TCP, a recv and a send
    cost less than two splices (see the module's docstring)."""
    loop = asyncio.get_running_loop()
    buffer = bytearray(COPY_BYTES)  # pages are only touched as far as reads fill them
    view = memoryview(buffer)
    while True:
        try:
            n = src.recv_into(buffer)
        except BlockingIOError:
            await wait_ready(loop.add_reader, loop.remove_reader, src.fileno())
            continue
        if n == 0:
            return
        sent = 0
        while sent < n:
            try:
                sent += dst.send(view[sent:n])
            except BlockingIOError:
                await wait_ready(loop.add_writer, loop.remove_writer, dst.fileno())
        count(n)


async def splice_sockets(
    a: ByteStream,
    b: ByteStream,
    *,
    grace: float | None = HALF_CLOSE_GRACE_SECONDS,
    abort_on_error: bool = False,
) -> SpliceResult:
    """Copy a→b and b→a until both directions end, then close both (abort both instead when
    `abort_on_error` and a direction failed). In the kernel when both are plain
    SocketStreams; else as podgate.aio.splice.splice."""
    if not (
        isinstance(a, SocketStream)
        and isinstance(b, SocketStream)
        and a.can_hand_over()
        and b.can_hand_over()
    ):
        result = await splice(a, b, grace=grace)
        if abort_on_error and result.error is not None:
            for stream in (a, b):
                if isinstance(stream, SocketStream):
                    stream.abort()
        return result
    sock_a, pending_a, eof_a = a.take_socket()
    sock_b, pending_b, eof_b = b.take_socket()
    result = SpliceResult()

    def a_to_b(n: int) -> None:
        result.a_to_b += n

    def b_to_a(n: int) -> None:
        result.b_to_a += n

    pending: set[asyncio.Task[None]] = {
        asyncio.create_task(_pump(sock_a, sock_b, pending_a, eof_a, a_to_b), name="ksplice a->b"),
        asyncio.create_task(_pump(sock_b, sock_a, pending_b, eof_b, b_to_a), name="ksplice b->a"),
    }
    try:
        while pending:
            timeout = grace if len(pending) == 1 else None
            done, pending = await asyncio.wait(
                pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break  # grace ran out
            for task in done:
                exc = task.exception()
                if exc is not None:
                    if not isinstance(exc, BrokenStreamError):
                        raise exc
                    # Without its traceback: its frames hold `result` (see splice).
                    result.error = result.error or exc.with_traceback(None)
            if result.error is not None:
                break
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, BrokenStreamError):
                await task
        sock_a.close()
        sock_b.close()
        if abort_on_error and result.error is not None:
            a.abort()
            b.abort()
        await asyncio.gather(a.aclose(), b.aclose(), return_exceptions=True)
    return result
