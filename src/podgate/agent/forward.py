"""`podgate agent forward PORT`: one connection between stdin/stdout and localhost:PORT.

For forwarding through an exec session (what `wincat` or `socat - TCP:localhost:PORT` do):
connect to 127.0.0.1:PORT, else [::1]:PORT, then copy stdin to the socket and the socket to
stdout on two blocking threads. stdin's EOF becomes a shutdown of our sending half; the
socket's EOF closes stdout. When one direction has finished, the other gets
`HALF_CLOSE_GRACE_SECONDS`, then the process exits.

Plain read/write, not `os.splice`: a splice between a pipe and a blocking socket holds the
pipe's lock while it waits on the socket, so whoever holds the other end of our stdin or
stdout pipe (an event loop, with the pipe non-blocking) would block inside read() or write()
until the TCP peer moved — a deadlock when that same loop also drives the peer.

Exit status: 0 when both directions ended cleanly, 1 when the port refused (containerd's
message on stderr) or a copy failed.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from typing import Final, TextIO

from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS
from podgate.forwarders import localhost_refused_message

__all__ = ["COPY_CHUNK_BYTES", "copy_fd", "dial_localhost_blocking", "run_forward"]

# Bytes moved per read: larger reads mean fewer wake-ups for bulk transfers.
COPY_CHUNK_BYTES: Final = 256 * 1024


def _go_strerror(err: int) -> str:
    text = os.strerror(err)
    return text[:1].lower() + text[1:]


class ForwardRefusedError(ConnectionError):
    """Neither 127.0.0.1 nor ::1 accepted; str() is containerd's message."""


def dial_localhost_blocking(port: int) -> socket.socket:
    """A connected blocking socket to 127.0.0.1:`port`, else [::1]:`port`."""
    failures: list[str] = []
    for family, network, host, shown in (
        (socket.AF_INET, "tcp4", "127.0.0.1", "127.0.0.1"),
        (socket.AF_INET6, "tcp6", "::1", "[::1]"),
    ):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            reason = _go_strerror(exc.errno or errno.EAFNOSUPPORT)
            failures.append(f"dial {network} {shown}:{port}: socket: {reason}")
            continue
        try:
            sock.connect((host, port))
        except OSError as exc:
            sock.close()
            reason = _go_strerror(exc.errno or errno.ECONNREFUSED)
            failures.append(f"dial {network} {shown}:{port}: connect: {reason}")
            continue
        return sock
    raise ForwardRefusedError(localhost_refused_message(port, *failures))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def copy_fd(src: int, dst: int) -> int:
    """Copy `src` to `dst` until EOF on `src`; returns the bytes moved."""
    total = 0
    buffer = bytearray(COPY_CHUNK_BYTES)
    view = memoryview(buffer)
    while moved := os.readv(src, [buffer]):
        _write_all(dst, view[:moved])
        total += moved
    return total


class _Direction(threading.Thread):
    def __init__(self, name: str, src: int, dst: int, done: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.src = src
        self.dst = dst
        self.moved = 0
        self.error: OSError | None = None
        self._done = done
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            self.moved = copy_fd(self.src, self.dst)
        except OSError as exc:
            self.error = exc
        finally:
            self.finished.set()
            self._done.set()


def run_forward(
    port: int,
    *,
    stdin: int = 0,
    stdout: int = 1,
    stderr: TextIO | None = None,
    grace: float = HALF_CLOSE_GRACE_SECONDS,
) -> int:
    """Forward between the `stdin`/`stdout` descriptors and localhost:`port`; the exit code."""
    err = stderr if stderr is not None else sys.stderr
    try:
        sock = dial_localhost_blocking(port)
    except ForwardRefusedError as exc:
        print(f"podgate agent forward: {exc}", file=err)
        return 1
    any_done = threading.Event()
    up = _Direction("stdin->socket", stdin, sock.fileno(), any_done)
    down = _Direction("socket->stdout", sock.fileno(), stdout, any_done)
    up.start()
    down.start()
    any_done.wait()
    first, other = (up, down) if up.finished.is_set() else (down, up)
    _finish(first, sock, stdout)
    if first.error is None:
        other.finished.wait(grace)
    if other.finished.is_set():
        _finish(other, sock, stdout)
    code = 0
    for direction in (up, down):
        if direction.error is not None:
            print(f"podgate agent forward: {direction.name}: {direction.error}", file=err)
            code = 1
    sock.close()
    return code


def _finish(direction: _Direction, sock: socket.socket, stdout: int) -> None:
    if stdout in (direction.src, direction.dst):
        # Replace stdout with /dev/null rather than close it: the reader sees EOF and nobody
        # later writes into a reused descriptor number.
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stdout)
        finally:
            os.close(null)
        return
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # already reset by the peer; the other direction reports it
