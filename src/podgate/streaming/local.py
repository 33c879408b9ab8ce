"""A StreamTarget whose "pod" is this host: commands run as local processes, ports are loopback.

It serves the demo (`podgate demo`) and the protocol tests with real processes and real
sockets; the runtime supplies the namespace-backed target with the same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import pty
import signal
import struct
import termios
from collections.abc import Mapping, Sequence

from podgate.aio.datagram import DatagramStream, connected_udp_socket
from podgate.aio.errors import ConnectError, StreamError
from podgate.aio.streams import ByteStream, SocketStream
from podgate.streaming.target import ExecIO, PodRef, TargetError

log = logging.getLogger(__name__)

# Read size for a process's pipes and pty.
PIPE_READ_BYTES = 64 * 1024
# Output reads smaller than this wait up to OUTPUT_BATCH_SECONDS for more before going out.
SMALL_OUTPUT_BYTES = 4096
OUTPUT_BATCH_SECONDS = 0.002
# How long a tty session waits for the client's first terminal size before starting.
FIRST_RESIZE_WAIT_SECONDS = 1.0
# How long output may keep flowing after the process exited (grandchildren holding the pipe).
OUTPUT_DRAIN_SECONDS = 2.0


class LocalTarget:
    """Pods are local: exec runs processes, open_port dials 127.0.0.1 (then ::1, for TCP).

    `port_map` maps a pod port to a local one, for TCP and UDP alike; `udp_port_map`, when
    given, overrides it for UDP."""

    def __init__(
        self,
        *,
        port_map: Mapping[int, int] | None = None,
        attach_command: Sequence[str] = ("cat",),
        cwd: str | None = None,
        udp_port_map: Mapping[int, int] | None = None,
    ) -> None:
        self.port_map = dict(port_map or {})
        self.udp_port_map = dict(udp_port_map or {})
        self.attach_command = tuple(attach_command)
        self.cwd = cwd
        self._attach_lock = asyncio.Lock()

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        if protocol == "udp":
            local = self.udp_port_map.get(port, self.port_map.get(port, port))
            try:
                sock = connected_udp_socket("127.0.0.1", local)
            except OSError as exc:
                raise TargetError(
                    f'failed to open udp to localhost:{port} inside pod "{pod}": {exc}'
                ) from exc
            return DatagramStream(sock, label=f"udp {pod}:{port}")
        if protocol != "tcp":
            raise TargetError(f"unsupported port-forward protocol {protocol!r}")
        local = self.port_map.get(port, port)
        errors = []
        for host in ("127.0.0.1", "::1"):
            try:
                return await SocketStream.connect(host, local)
            except ConnectError as exc:
                errors.append(f"dial tcp {host}:{local}: {exc}")
        raise TargetError(
            f'failed to connect to localhost:{port} inside pod "{pod}": ' + "; ".join(errors)
        )

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        if not command:
            raise TargetError("no command given")
        return await run_process(command, io, cwd=self.cwd)

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        # One attached session at a time; the process gets stdin once, as a container with
        # stdinOnce does, and is started afresh for the next attach.
        async with self._attach_lock:
            return await run_process(self.attach_command, io, cwd=self.cwd)


async def run_process(command: Sequence[str], io: ExecIO, *, cwd: str | None = None) -> int:
    """Run a command with `io` as stdio (a pty when io.tty) and return its exit code.

    Exit codes follow the shell convention for signals (128 + signal number), as runtimes do.
    """
    try:
        if io.tty:
            return await _run_pty(command, io, cwd)
        return await _run_pipes(command, io, cwd)
    except FileNotFoundError as exc:
        raise TargetError(f'exec: "{command[0]}": executable file not found in $PATH') from exc
    except PermissionError as exc:
        raise TargetError(f'exec: "{command[0]}": permission denied') from exc
    except OSError as exc:  # E2BIG, ENOEXEC, EMFILE…: the command never ran
        raise TargetError(f'exec: "{command[0]}": {exc.strerror or exc}') from exc


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


async def _copy_in(src: ByteStream, dst: asyncio.StreamWriter) -> None:
    try:
        while chunk := await src.receive():
            dst.write(chunk)
            await dst.drain()
    except (StreamError, ConnectionError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            dst.close()


async def _copy_out(src: asyncio.StreamReader, dst: ByteStream | None) -> None:
    while chunk := await _read_batched(src):
        if dst is not None:
            try:
                await dst.send(chunk)
            except StreamError:
                dst = None  # the client went away; keep draining so the process never blocks


async def _read_batched(src: asyncio.StreamReader) -> bytes:
    """A read, topped up for a moment when it was small: a process printing line by line
    would otherwise cost one frame and one write per line all the way to the client."""
    chunk = await src.read(PIPE_READ_BYTES)
    if not chunk or len(chunk) >= SMALL_OUTPUT_BYTES:
        return chunk
    parts = [chunk]
    size = len(chunk)
    deadline = asyncio.get_running_loop().time() + OUTPUT_BATCH_SECONDS
    while size < PIPE_READ_BYTES:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            break
        try:
            more = await asyncio.wait_for(src.read(PIPE_READ_BYTES - size), remaining)
        except TimeoutError:
            break
        if not more:
            break
        parts.append(more)
        size += len(more)
    return b"".join(parts)


async def _run_pipes(command: Sequence[str], io: ExecIO, cwd: str | None) -> int:
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE if io.stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    feeder = None
    if io.stdin is not None:
        assert proc.stdin is not None
        feeder = asyncio.create_task(_copy_in(io.stdin, proc.stdin), name="exec stdin")
    outputs = asyncio.gather(_copy_out(proc.stdout, io.stdout), _copy_out(proc.stderr, io.stderr))
    try:
        returncode = await proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(outputs), OUTPUT_DRAIN_SECONDS)
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        outputs.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await outputs
        if feeder is not None:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
    return _exit_code(returncode)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def set_winsize(fd: int, width: int, height: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))


async def _run_pty(command: Sequence[str], io: ExecIO, cwd: str | None) -> int:
    loop = asyncio.get_running_loop()
    master, slave = pty.openpty()
    sized = asyncio.Event()

    async def apply_resizes() -> None:
        assert io.resizes is not None
        async for size in io.resizes:
            with contextlib.suppress(OSError):
                set_winsize(master, size.width, size.height)
            sized.set()

    helpers = []
    if io.resizes is not None:
        # The client sends its terminal size first thing; a shell started before it arrives
        # would see 0x0. Wait for it, briefly (a client may never send one).
        helpers.append(asyncio.create_task(apply_resizes(), name="pty resize"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sized.wait(), FIRST_RESIZE_WAIT_SECONDS)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            # setsid and the controlling tty happen in preexec: uvloop runs preexec_fn before
            # it sets up the child's stdio, so the slave is named by its own fd there.
            preexec_fn=functools.partial(_make_controlling_tty, slave),
        )
    except BaseException:
        for task in helpers:
            task.cancel()
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)
    output_done = loop.create_future()

    def on_readable() -> None:
        try:
            data = os.read(master, PIPE_READ_BYTES)
        except OSError:  # EIO once the last slave fd is closed
            data = b""
        if not data:
            loop.remove_reader(master)
            if not output_done.done():
                output_done.set_result(None)
            return
        queue.put_nowait(data)

    queue: asyncio.Queue[bytes] = asyncio.Queue()
    loop.add_reader(master, on_readable)

    async def forward_output() -> None:
        out = io.stdout
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, output_done}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                while not queue.empty():
                    chunk = queue.get_nowait()
                    if out is not None:
                        with contextlib.suppress(StreamError):
                            await out.send(chunk)
                return
            chunk = getter.result()
            while not queue.empty() and len(chunk) < PIPE_READ_BYTES:
                chunk += queue.get_nowait()  # whatever else is already there goes along
            if out is not None:
                try:
                    await out.send(chunk)
                except StreamError:
                    out = None

    async def forward_input() -> None:
        assert io.stdin is not None
        with contextlib.suppress(StreamError):
            while chunk := await io.stdin.receive():
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(master, view) :]
                    except BlockingIOError:
                        await asyncio.sleep(0.005)

    if io.stdin is not None:
        helpers.append(asyncio.create_task(forward_input(), name="pty stdin"))
    output = asyncio.create_task(forward_output(), name="pty output")
    try:
        returncode = await proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(output), OUTPUT_DRAIN_SECONDS)
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        loop.remove_reader(master)
        for task in [*helpers, output]:
            task.cancel()
        for task in [*helpers, output]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        os.close(master)
    return _exit_code(returncode)


def _make_controlling_tty(slave: int) -> None:
    # Runs in the child between fork and exec: a new session whose controlling terminal is
    # the pty slave (still open here whatever the event loop did with stdio so far).
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
