"""The client side of one benchmark run, in its own process so its CPU is its own.

    python -m bench.client throughput --via spdy --port P --direction upload --size N
    python -m bench.client conns --via tcp --kind connect --port P --count N

`--via tcp` is a plain socket to a TCP port (the target itself, socat, or kubectl's local
port); `spdy`, `tunnel` and `ws` use podgate's own clients against a podgate API server.
`--watch name=pid` (repeatable) reports the CPU those processes spent during the timed part
only, so session setup and teardown stay out of the per-GB figures. The result is one JSON
line on stdout; a failed run reports {"error": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import (
    BULK_REMOTE_PORT,
    ECHO_REMOTE_PORT,
    IO_CHUNK_BYTES,
    LOOP_CHOICES,
    MAX_REPLY_LINE_BYTES,
    POD_NAME,
    POD_NAMESPACE,
    Pattern,
    Verifier,
    download_request,
    parse_sink_reply,
    resolve_loop,
    run_on,
    upload_request,
)
from bench.procs import cpu_seconds
from podgate.aio.streams import ByteStream
from podgate.streaming.client import Endpoint, PortForwardSession, pod_path, portforward_websocket

# One byte each way per connection in the connection benchmarks.
ECHO_PROBE = b"x"
# Longest a single connect or echo may take before the run counts as failed.
CONNECT_TIMEOUT_SECONDS = 10.0

Closer = Callable[[], Awaitable[None]]


class Meter:
    """Wall time, this process's CPU and the watched processes' CPU between start and stop."""

    def __init__(self, watch: dict[str, int]) -> None:
        self.watch = watch
        self.seconds = 0.0
        self.client_cpu = 0.0
        self.cpu: dict[str, float] = {}
        self._t0 = self._c0 = 0.0
        self._w0: dict[str, float] = {}

    def start(self) -> None:
        self._w0 = {name: cpu_seconds(pid) for name, pid in self.watch.items()}
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.client_cpu = time.process_time() - self._c0
        self.cpu = {name: cpu_seconds(pid) - self._w0[name] for name, pid in self.watch.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "client_cpu": self.client_cpu, "cpu": self.cpu}


class DeadlineError(Exception):
    pass


def _check(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise DeadlineError("run exceeded its time limit")


# --------------------------------------------------------------------------- plain TCP


def _tcp_connect(port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_line(sock: socket.socket) -> bytes:
    line = bytearray()
    while b"\n" not in line and len(line) <= MAX_REPLY_LINE_BYTES:
        data = sock.recv(MAX_REPLY_LINE_BYTES)
        if not data:
            break
        line += data
    return bytes(line)


def tcp_throughput(
    port: int, direction: str, size: int, timeout: float, meter: Meter
) -> str | None:
    pattern = Pattern()
    deadline = time.monotonic() + timeout
    with _tcp_connect(port, timeout) as sock:
        meter.start()
        if direction == "upload":
            sock.sendall(upload_request(size))
            offset = 0
            while offset < size:
                _check(deadline)
                n = min(IO_CHUNK_BYTES, size - offset)
                sock.sendall(pattern.chunk(offset, n))
                offset += n
            error = parse_sink_reply(_recv_line(sock), size)
        else:
            sock.sendall(download_request(size))
            verifier = Verifier(pattern, size)
            buf = bytearray(IO_CHUNK_BYTES)
            view = memoryview(buf)
            while not verifier.done:
                _check(deadline)
                n = sock.recv_into(view, min(len(buf), size - verifier.received))
                if n == 0:
                    break
                verifier.feed(view[:n])
            error = _download_error(verifier)
        meter.stop()
    return error


def tcp_conns(port: int, count: int, budget: float, meter: Meter) -> list[float]:
    latencies: list[float] = []
    deadline = time.monotonic() + budget
    meter.start()
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        with _tcp_connect(port, CONNECT_TIMEOUT_SECONDS) as sock:
            sock.sendall(ECHO_PROBE)
            got = sock.recv(len(ECHO_PROBE))
            latencies.append(time.perf_counter() - t0)
        if got != ECHO_PROBE:
            raise RuntimeError(f"echo returned {got!r}")
    meter.stop()
    return latencies


# --------------------------------------------------------------------------- podgate


async def podgate_open(via: str, port: int, remote: int) -> tuple[ByteStream, Closer]:
    """Upgrade a new connection and open one forwarded stream to `remote`."""
    endpoint = Endpoint("127.0.0.1", port)
    path = pod_path(POD_NAMESPACE, POD_NAME, "portforward")
    if via == "ws":
        channels, streams, reader = await portforward_websocket(endpoint, path, [remote])

        async def close_ws() -> None:
            await channels.aclose()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

        return streams[remote], close_ws
    session = await PortForwardSession.connect(endpoint, path, websocket=via == "tunnel", udp=True)
    try:
        forwarded = await session.open(remote)
    except BaseException:
        await session.aclose()
        raise
    return forwarded.data, session.aclose


async def _read_line(stream: ByteStream) -> bytes:
    line = bytearray()
    while b"\n" not in line and len(line) <= MAX_REPLY_LINE_BYTES:
        data = await stream.receive(MAX_REPLY_LINE_BYTES)
        if not data:
            break
        line += data
    return bytes(line)


def _download_error(verifier: Verifier) -> str | None:
    if verifier.ok:
        return None
    return f"download: received {verifier.received} of {verifier.expected} bytes" + (
        f", first bad byte at {verifier.first_bad}" if verifier.first_bad is not None else ""
    )


async def podgate_throughput(
    via: str, port: int, direction: str, size: int, timeout: float, meter: Meter
) -> str | None:
    pattern = Pattern()
    stream, close = await podgate_open(via, port, BULK_REMOTE_PORT)
    try:
        async with asyncio.timeout(timeout):
            meter.start()
            if direction == "upload":
                await stream.send(upload_request(size))
                offset = 0
                while offset < size:
                    n = min(IO_CHUNK_BYTES, size - offset)
                    await stream.send(pattern.chunk(offset, n))
                    offset += n
                error = parse_sink_reply(await _read_line(stream), size)
            else:
                await stream.send(download_request(size))
                verifier = Verifier(pattern, size)
                while not verifier.done:
                    chunk = await stream.receive()
                    if not chunk:
                        break
                    verifier.feed(chunk)
                error = _download_error(verifier)
            meter.stop()
    finally:
        await close()
    return error


async def _echo_once(stream: ByteStream) -> None:
    await stream.send(ECHO_PROBE)
    got = await stream.receive(len(ECHO_PROBE))
    if got != ECHO_PROBE:
        raise RuntimeError(f"echo returned {got!r}")


async def podgate_stream_conns(
    via: str, port: int, count: int, budget: float, meter: Meter
) -> list[float]:
    """New forwarded connections on one open session: open the stream pair, echo, reset."""
    endpoint = Endpoint("127.0.0.1", port)
    path = pod_path(POD_NAMESPACE, POD_NAME, "portforward")
    session = await PortForwardSession.connect(endpoint, path, websocket=via == "tunnel", udp=True)
    latencies: list[float] = []
    deadline = time.monotonic() + budget
    try:
        meter.start()
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                forwarded = await session.open(ECHO_REMOTE_PORT)
                await _echo_once(forwarded.data)
            latencies.append(time.perf_counter() - t0)
            # As kubectl when its local connection ends: remove (reset) both streams.
            await forwarded.data.aclose()
            await forwarded.error_stream.aclose()
        meter.stop()
    finally:
        await session.aclose()
    return latencies


async def podgate_session_conns(
    via: str, port: int, count: int, budget: float, meter: Meter
) -> list[float]:
    """New sessions: HTTP upgrade, one stream, one echo (latency), then close."""
    latencies: list[float] = []
    deadline = time.monotonic() + budget
    meter.start()
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
            stream, close = await podgate_open(via, port, ECHO_REMOTE_PORT)
            try:
                await _echo_once(stream)
                latencies.append(time.perf_counter() - t0)
            finally:
                await close()
    meter.stop()
    return latencies


# --------------------------------------------------------------------------- results


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of an ascending list."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def latency_summary(latencies: list[float]) -> dict[str, Any]:
    if not latencies:
        return {"count": 0}
    ordered = sorted(latencies)
    return {
        "count": len(ordered),
        "p50_us": percentile(ordered, 0.50) * 1e6,
        "p99_us": percentile(ordered, 0.99) * 1e6,
        "mean_us": sum(ordered) / len(ordered) * 1e6,
        "max_us": ordered[-1] * 1e6,
    }


def _parse_watch(items: list[str]) -> dict[str, int]:
    watch = {}
    for item in items:
        name, _, pid = item.partition("=")
        watch[name] = int(pid)
    return watch


def run(args: argparse.Namespace) -> dict[str, Any]:
    meter = Meter(_parse_watch(args.watch))
    loop = resolve_loop(args.loop)
    result: dict[str, Any] = {"loop": loop if args.via != "tcp" else "-"}
    if args.command == "throughput":
        if args.via == "tcp":
            error = tcp_throughput(args.port, args.direction, args.size, args.timeout, meter)
        else:
            error = run_on(
                loop,
                podgate_throughput(
                    args.via, args.port, args.direction, args.size, args.timeout, meter
                ),
            )
        result.update(meter.as_dict(), bytes=args.size, verified=error is None, error=error)
        return result
    if args.via == "tcp":
        latencies = tcp_conns(args.port, args.count, args.budget, meter)
    elif args.kind == "stream":
        latencies = run_on(
            loop, podgate_stream_conns(args.via, args.port, args.count, args.budget, meter)
        )
    else:
        latencies = run_on(
            loop, podgate_session_conns(args.via, args.port, args.count, args.budget, meter)
        )
    result.update(meter.as_dict(), **latency_summary(latencies), error=None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.client")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("throughput", "conns"):
        p = sub.add_parser(name)
        p.add_argument("--via", choices=("tcp", "spdy", "tunnel", "ws"), required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
        p.add_argument("--loop", choices=LOOP_CHOICES, default="podgate")
        if name == "throughput":
            p.add_argument("--direction", choices=("upload", "download"), required=True)
            p.add_argument("--size", type=int, required=True)
            p.add_argument("--timeout", type=float, default=120.0)
        else:
            p.add_argument("--kind", choices=("connect", "stream", "session"), default="connect")
            p.add_argument("--count", type=int, required=True)
            p.add_argument("--budget", type=float, default=30.0)
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # any failure is this run's result, not a crash of the bench
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
