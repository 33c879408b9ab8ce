"""The host side of a Firecracker-style hybrid-vsock device, for sandboxes emulated without a VM.

Run as `python -m podgate.linux.vmm --uds PATH --guest-prefix PREFIX`. It listens on the unix
socket PATH (mode 0600) the way Firecracker listens on its `uds_path`. For each connection it
reads `CONNECT <port>\\n` exactly as Firecracker's muxer does: 10 bytes (the shortest valid
line, "connect 0\\n"), then one byte at a time until a newline or 32 bytes, so payload sent
right behind the line is never consumed. The first word must be `connect` in any case, the
second a u32 (Rust's `u32::from_str`: an optional '+', then ASCII digits).

The emulated guest port P is the unix socket `PREFIX_P` (where an agent listening on
`unix://PREFIX_1024` is). If it accepts, the host gets `OK <hostport>\\n` with a host port
allocated as Firecracker does (from 2^30, wrapping inside [2^30, 2^31)) and the two connections
are spliced. If nothing listens, or the line is malformed, the host connection is closed
without a reply.

Guest-initiated connections need no emulation: the guest dials `hvsock://PATH`, which is the
unix socket `PATH_<port>` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Final

from podgate.aio.errors import ConnectError, StreamError
from podgate.aio.ksplice import splice_sockets
from podgate.aio.streams import SocketStream
from podgate.linux.proc import (
    SpawnError,
    atomic_write_json,
    process_ref,
    spawn_detached,
    wait_ready_file,
)
from podgate.linux.vsock import Address, Listener, Scheme, connect, listen
from podgate.model import ProcessRef

__all__ = [
    "CONN_REQUEST_TIMEOUT_SECONDS",
    "FIRST_HOST_PORT",
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "MIN_REQUEST_BYTES",
    "READY_LINE",
    "InvalidPortRequestError",
    "Muxer",
    "VmmError",
    "main",
    "parse_connect_request",
    "read_connect_request",
    "serve",
    "start_vmm",
]

log = logging.getLogger(__name__)

# Firecracker reads len("connect 0\n") bytes first: no valid request is shorter.
MIN_REQUEST_BYTES: Final = 10
# Firecracker's request buffer; a line that has not ended by then is parsed as it stands.
MAX_REQUEST_BYTES: Final = 32
# Firecracker's per-device connection limit; further host connections are accepted and dropped.
MAX_CONNECTIONS: Final = 1023
# Firecracker's CONN_REQUEST_TIMEOUT_MS: how long the guest may take to accept.
CONN_REQUEST_TIMEOUT_SECONDS: Final = 2.0
# How long a host may take to send its CONNECT line. Firecracker parses it when the socket
# first turns readable; a slow sender here gets this long before being dropped.
REQUEST_LINE_TIMEOUT_SECONDS: Final = 10.0
# Host ports live in [2^30, 2^31); the first one handed out is 2^30 (Firecracker's docs show
# "OK 1073741824").
FIRST_HOST_PORT: Final = 1 << 30
_HOST_PORT_HIGH_BIT: Final = 1 << 31
_U32_MAX: Final = 0xFFFFFFFF
# How long `start_vmm` waits for the ready file, seconds.
VMM_START_TIMEOUT: Final = 10.0
READY_LINE: Final = "vmm ready"

_RUST_U32 = re.compile(r"\+?[0-9]+")


class InvalidPortRequestError(ValueError):
    """A host connection's first line is not `connect <u32>` (Firecracker: InvalidPortRequest)."""


class VmmError(Exception):
    """The muxer process could not be started; the message says why."""


def parse_connect_request(request: bytes) -> int:
    """The guest port a host connection asks for, parsed as Firecracker parses it."""
    try:
        text = request.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidPortRequestError(f"request is not UTF-8: {request!r}") from None
    words = text.split()
    if not words or words[0].lower() != "connect":
        raise InvalidPortRequestError(f"not a connect request: {request!r}")
    if len(words) < 2 or not _RUST_U32.fullmatch(words[1]) or int(words[1]) > _U32_MAX:
        raise InvalidPortRequestError(f"no u32 port in {request!r}")
    return int(words[1])


async def read_connect_request(stream: SocketStream) -> bytes:
    """The request line, read without touching a byte after it (EOFError if the host quits)."""
    request = bytearray()
    while len(request) < MIN_REQUEST_BYTES:
        chunk = await stream.receive(MIN_REQUEST_BYTES - len(request))
        if not chunk:
            raise EOFError("host closed the connection before its request")
        request += chunk
    while request[-1:] != b"\n" and len(request) < MAX_REQUEST_BYTES:
        byte = await stream.receive(1)
        if not byte:
            raise EOFError("host closed the connection inside its request")
        request += byte
    return bytes(request)


class Muxer:
    """Routes host connections on the device socket to the emulated guest's listeners."""

    def __init__(self, guest_prefix: str, *, max_connections: int = MAX_CONNECTIONS) -> None:
        self.guest_prefix = guest_prefix
        self.max_connections = max_connections
        self._active = 0
        self._last_port = FIRST_HOST_PORT - 1
        self._ports: set[int] = set()
        self._tasks: set[asyncio.Task[object]] = set()

    @property
    def active(self) -> int:
        return self._active

    def allocate_port(self) -> int:
        """Firecracker's allocator: the next free port after the last one, inside [2^30, 2^31)."""
        while True:
            self._last_port = ((self._last_port + 1) & ~_HOST_PORT_HIGH_BIT) | FIRST_HOST_PORT
            if self._last_port not in self._ports:
                self._ports.add(self._last_port)
                return self._last_port

    def release_port(self, port: int) -> None:
        self._ports.discard(port)

    async def listen(self, uds: str) -> Listener:
        """Listen on the device socket `uds` (mode 0600; a stale socket file is replaced)."""
        return await listen(Address(Scheme.UNIX, path=uds), self.handle, mode=0o600)

    async def handle(self, host: SocketStream) -> None:
        """Serve one host connection (it is closed by the caller afterwards)."""
        if self._active >= self.max_connections:
            log.warning("connection limit (%d) reached: dropping a host connection", self._active)
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._active += 1
        try:
            await self._handle(host)
        finally:
            self._active -= 1
            if task is not None:
                self._tasks.discard(task)

    async def aclose(self) -> None:
        """End every connection being served (stop the listener first)."""
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _handle(self, host: SocketStream) -> None:
        try:
            async with asyncio.timeout(REQUEST_LINE_TIMEOUT_SECONDS):
                request = await read_connect_request(host)
            port = parse_connect_request(request)
        except (TimeoutError, EOFError, StreamError, InvalidPortRequestError) as exc:
            log.info("dropping host connection: %s", exc or "no request in time")
            return
        target = Address(Scheme.UNIX, path=f"{self.guest_prefix}_{port}")
        try:
            async with asyncio.timeout(CONN_REQUEST_TIMEOUT_SECONDS):
                guest = await connect(target)
        except (TimeoutError, ConnectError) as exc:
            log.info("guest port %d: not accepted, closing the host connection: %s", port, exc)
            return
        host_port = self.allocate_port()
        started = asyncio.get_running_loop().time()
        try:
            try:
                host.write(b"OK %d\n" % host_port)
            except StreamError as exc:
                log.info("guest port %d: the host left before OK: %s", port, exc)
                return
            result = await splice_sockets(host, guest)  # in the kernel when it can
        finally:
            self.release_port(host_port)
            await guest.aclose()
        log.info(
            "guest port %d (host port %d) closed: %d bytes to the guest, %d back in %.3f s%s",
            port,
            host_port,
            result.a_to_b,
            result.b_to_a,
            asyncio.get_running_loop().time() - started,
            f", error: {result.error}" if result.error else "",
        )


async def serve(uds: str, guest_prefix: str, *, ready_file: str | None = None) -> None:
    """Run a muxer until SIGTERM or SIGINT; then stop listening and end every connection."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    muxer = Muxer(guest_prefix)
    try:
        listener = await muxer.listen(uds)
    except (OSError, StreamError) as exc:
        message = f"vmm: cannot listen on {uds}: {exc}"
        if ready_file:
            atomic_write_json(ready_file, {"error": message})
        raise VmmError(message) from exc
    log.info("hybrid vsock muxer on %s, guest ports at %s_<port>", uds, guest_prefix)
    if ready_file:
        me = process_ref(os.getpid())
        atomic_write_json(ready_file, {"pid": me.pid, "start_time": me.start_time})
    print(READY_LINE, flush=True)
    try:
        await stop.wait()
    finally:
        listener.close()
        await muxer.aclose()


async def start_vmm(
    uds: str,
    guest_prefix: str,
    log_file: str,
    *,
    ready_file: str | None = None,
    timeout: float = VMM_START_TIMEOUT,
) -> ProcessRef:
    """Start a detached muxer for one sandbox and wait until it listens on `uds`.

    Its stderr goes to `log_file`; its ready file is `ready_file` (default `<uds>.ready`).
    Stop it with SIGTERM through the returned ref. Raises VmmError on failure.
    """
    ready_file = ready_file or f"{uds}.ready"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ready_file)
    argv = [
        sys.executable,
        "-m",
        "podgate.linux.vmm",
        "--uds",
        uds,
        "--guest-prefix",
        guest_prefix,
        "--ready-file",
        ready_file,
        "--daemon",
    ]
    try:
        await spawn_detached(argv, log_file)
        data = await wait_ready_file(ready_file, timeout, log_file)
    except SpawnError as exc:
        raise VmmError(str(exc)) from exc
    return ProcessRef(pid=int(data["pid"]), start_time=int(data["start_time"]))


def _daemonize() -> None:
    if os.fork() != 0:
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podgate.linux.vmm")
    parser.add_argument("--uds", required=True, help="the device socket hosts connect to")
    parser.add_argument(
        "--guest-prefix", required=True, help="guest port P is the unix socket PREFIX_P"
    )
    parser.add_argument("--ready-file", default="", help="write {pid, start_time} here")
    parser.add_argument("--daemon", action="store_true", help="fork away (for start_vmm)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s vmm: %(message)s",
        stream=sys.stderr,
    )
    if args.daemon:
        _daemonize()
    try:
        asyncio.run(serve(args.uds, args.guest_prefix, ready_file=args.ready_file or None))
    except VmmError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
