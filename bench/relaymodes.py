"""What a one-way socket relay costs per GB, spliced through a pipe or copied through a buffer,
for each pair of socket kinds podgate relays between (why podgate.aio.ksplice copies from a
unix socket into TCP and splices everywhere else).

A writer process sends SIZE bytes in 256 KiB writes (a SPDY DATA frame's worth, as the daemon
writes) into the relay's source socket; the relay process (a uvloop event loop, waiting for
readiness between calls as ksplice does) moves them to its destination socket; a reader
process reads them. The relay's CPU (user + system, from wait4) per GB and the wall-clock
throughput are printed for each mode, the modes alternating within each round.

    python -m bench.relaymodes --size 1G --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import socket
import statistics
import time
from collections.abc import Callable

import uvloop

from bench.common import parse_size

CHUNK_BYTES = 256 * 1024
PIPE_BYTES = 1024 * 1024
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
KINDS = ("unix-tcp", "tcp-unix", "tcp-tcp")
MODES = ("splice", "copy")


def _pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        a, b = socket.socketpair()
        return a, b
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


async def _ready(add: Callable[..., None], remove: Callable[[int], object], fd: int) -> None:
    waiter = asyncio.get_running_loop().create_future()
    add(fd, lambda: waiter.done() or waiter.set_result(None))
    try:
        await waiter
    finally:
        remove(fd)


async def _splice(src: socket.socket, dst: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    while True:
        try:
            n = os.splice(src.fileno(), w, PIPE_BYTES, flags=SPLICE_FLAGS)
        except BlockingIOError:
            await _ready(loop.add_reader, loop.remove_reader, src.fileno())
            continue
        if n == 0:
            break
        while n:
            try:
                n -= os.splice(r, dst.fileno(), n, flags=SPLICE_FLAGS)
            except BlockingIOError:
                await _ready(loop.add_writer, loop.remove_writer, dst.fileno())
    os.close(r)
    os.close(w)


async def _copy(src: socket.socket, dst: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    while True:
        try:
            n = src.recv_into(buffer)
        except BlockingIOError:
            await _ready(loop.add_reader, loop.remove_reader, src.fileno())
            continue
        if n == 0:
            break
        sent = 0
        while sent < n:
            try:
                sent += dst.send(view[sent:n])
            except BlockingIOError:
                await _ready(loop.add_writer, loop.remove_writer, dst.fileno())


def _relay(mode: str, src: socket.socket, dst: socket.socket) -> None:
    src.setblocking(False)
    dst.setblocking(False)
    uvloop.run((_splice if mode == "splice" else _copy)(src, dst))
    dst.shutdown(socket.SHUT_WR)


def _write(sock: socket.socket, size: int) -> None:
    data = os.urandom(CHUNK_BYTES)
    for _ in range(size // CHUNK_BYTES):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def _read(sock: socket.socket, size: int) -> None:
    buffer = bytearray(PIPE_BYTES)
    got = 0
    while n := sock.recv_into(buffer):
        got += n
    if got != size:
        raise SystemExit(f"the reader got {got} of {size} bytes")


def _fork(
    work: Callable[[], None], keep: list[socket.socket], everything: list[socket.socket]
) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for sock in everything:
                if sock not in keep:
                    sock.close()
            work()
        except BaseException as exc:  # the child reports any failure and exits
            print(f"child failed: {exc!r}", flush=True)
            code = 1
        os._exit(code)
    return pid


def run_once(kind: str, mode: str, size: int) -> tuple[float, float]:
    """(relay CPU seconds per GB, GB/s) of one relay run."""
    source_kind, _, dest_kind = kind.partition("-")
    writer_end, relay_in = _pair(source_kind)
    relay_out, reader_end = _pair(dest_kind)
    every = [writer_end, relay_in, relay_out, reader_end]
    started = time.monotonic()
    pids = {
        "relay": _fork(lambda: _relay(mode, relay_in, relay_out), [relay_in, relay_out], every),
        "reader": _fork(lambda: _read(reader_end, size), [reader_end], every),
        "writer": _fork(lambda: _write(writer_end, size), [writer_end], every),
    }
    for sock in every:
        sock.close()
    cpu = 0.0
    for name, pid in pids.items():
        _, status, usage = os.wait4(pid, 0)
        if status != 0:
            raise SystemExit(f"the {name} failed (status {status})")
        if name == "relay":
            cpu = usage.ru_utime + usage.ru_stime
    elapsed = time.monotonic() - started
    gb = size / 1e9
    return cpu / gb, gb / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relaymodes")
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help="source-destination kinds")
    args = parser.parse_args()
    size = args.size - args.size % CHUNK_BYTES
    print(f"one-way relay, {size // (1024 * 1024)} MiB per run, {args.runs} rounds")
    for kind in args.kinds.split(","):
        results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.runs):
            for mode in MODES:
                results[mode].append(run_once(kind, mode, size))
        for mode in MODES:
            cpu = [c for c, _ in results[mode]]
            rate = [r for _, r in results[mode]]
            print(
                f"{kind:9} {mode:6} relay {statistics.median(cpu):.2f} s/GB "
                f"({min(cpu):.2f}–{max(cpu):.2f}), {statistics.median(rate):.2f} GB/s "
                f"({min(rate):.2f}–{max(rate):.2f})"
            )


if __name__ == "__main__":
    main()
