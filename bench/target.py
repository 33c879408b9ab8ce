"""The "pod" side of every benchmark path: a bulk sink/source port and a 1-byte echo port.

Run as `python -m bench.target`; it prints one JSON line with its ports, then serves until
SIGTERM. Bulk connections are plain blocking sockets with a thread each (the fastest Python can
move bytes, so the target never limits a path); the echo port is an asyncio protocol on uvloop
when available, so connection setup is measured against a quick echo.

Bulk wire format: the client sends one line, `U <n>\\n` (then n pattern bytes: the sink checks
each byte and answers `OK <n>\\n`, or `BAD <received> <first bad offset>\\n`) or `D <n>\\n` (the
source sends n pattern bytes, then EOF).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from typing import cast

from bench.common import (
    IO_CHUNK_BYTES,
    MAX_REQUEST_LINE_BYTES,
    Pattern,
    Verifier,
    sink_reply,
)

# A connection that sends nothing for this long is dropped (a crashed client must not pin a
# thread forever).
IDLE_TIMEOUT_SECONDS = 120.0
# Largest transfer one request may ask for.
MAX_TRANSFER_BYTES = 1 << 40
LISTEN_BACKLOG = 1024

_pattern = Pattern()


def _read_request(conn: socket.socket) -> tuple[bytes, int, bytes] | None:
    head = bytearray()
    while b"\n" not in head:
        data = conn.recv(MAX_REQUEST_LINE_BYTES)
        if not data:
            return None
        head += data
        if len(head) > MAX_REQUEST_LINE_BYTES and b"\n" not in head:
            return None
    line, _, rest = bytes(head).partition(b"\n")
    parts = line.split()
    if len(parts) != 2 or parts[0] not in (b"U", b"D") or not parts[1].isdigit():
        return None
    size = int(parts[1])
    if not 0 < size <= MAX_TRANSFER_BYTES:
        return None
    return parts[0], size, rest


def _drain_until_eof(conn: socket.socket) -> None:
    buf = bytearray(64 * 1024)
    with contextlib.suppress(OSError):
        while conn.recv_into(buf):
            pass


def _sink(conn: socket.socket, size: int, rest: bytes) -> None:
    verifier = Verifier(_pattern, size)
    verifier.feed(rest)
    buf = bytearray(IO_CHUNK_BYTES)
    view = memoryview(buf)
    while verifier.received < size:
        n = conn.recv_into(view, min(len(buf), size - verifier.received))
        if n == 0:
            break
        verifier.feed(view[:n])
    bad = None
    if not verifier.ok:
        bad = verifier.first_bad if verifier.first_bad is not None else verifier.received
    conn.sendall(sink_reply(verifier.received, bad))
    _drain_until_eof(conn)


def _source(conn: socket.socket, size: int) -> None:
    offset = 0
    while offset < size:
        n = min(IO_CHUNK_BYTES, size - offset)
        conn.sendall(_pattern.chunk(offset, n))
        offset += n
    conn.shutdown(socket.SHUT_WR)
    _drain_until_eof(conn)


def _serve_bulk(conn: socket.socket) -> None:
    with conn:
        try:
            conn.settimeout(IDLE_TIMEOUT_SECONDS)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request = _read_request(conn)
            if request is None:
                return
            kind, size, rest = request
            if kind == b"U":
                _sink(conn, size, rest)
            else:
                _source(conn, size)
        except OSError:
            pass  # the client went away; its own report says so


def _accept_loop(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve_bulk, args=(conn,), daemon=True, name="bulk").start()


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check here.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close once the client has finished


async def _main() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(LISTEN_BACKLOG)
    threading.Thread(target=_accept_loop, args=(listener,), daemon=True, name="accept").start()
    loop = asyncio.get_running_loop()
    echo = await loop.create_server(_Echo, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    ready = {
        "bulk_port": listener.getsockname()[1],
        "echo_port": echo.sockets[0].getsockname()[1],
        "pid": os.getpid(),
        "loop": type(loop).__module__.split(".")[0],
    }
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    async with echo:
        await stop.wait()
    listener.close()


def main() -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main())
    else:
        uvloop.run(_main())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
