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
from podgate.aio.tasks import cancel_and_wait
from podgate.streaming.pipeout import PipeOutput, spawn_with_outputs
from podgate.streaming.target import ExecIO, PodRef, TargetError

log = logging.getLogger(__name__)

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


async def _copy_out(src: PipeOutput, dst: ByteStream | None) -> None:
    while chunk := await src.read():
        if dst is not None:
            try:
                await dst.send(chunk)
            except StreamError:
                dst = None  # the client went away; keep draining so the process never blocks


async def _run_pipes(command: Sequence[str], io: ExecIO, cwd: str | None) -> int:
    # Our own descriptors rather than asyncio's pipes: the output is read by PipeOutput (large
    # reads in the loop's callback) instead of a StreamReader with a task per read, and from
    # sockets, which a command cannot lock against our reads (output_socketpair).
    proc, out_r, err_r = await spawn_with_outputs(
        command,
        stdin=asyncio.subprocess.PIPE if io.stdin else asyncio.subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
    )
    stdout, stderr = PipeOutput(out_r), PipeOutput(err_r)
    feeder = None
    if io.stdin is not None:
        assert proc.stdin is not None
        feeder = asyncio.create_task(_copy_in(io.stdin, proc.stdin), name="exec stdin")
    outputs = asyncio.gather(_copy_out(stdout, io.stdout), _copy_out(stderr, io.stderr))
    try:
        returncode = await proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(outputs), OUTPUT_DRAIN_SECONDS)
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        await cancel_and_wait(outputs)
        if feeder is not None:
            await cancel_and_wait(feeder)
        for pipe, fd in ((stdout, out_r), (stderr, err_r)):
            pipe.stop()
            os.close(fd)
    return _exit_code(returncode)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def set_winsize(fd: int, width: int, height: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))


async def _run_pty(command: Sequence[str], io: ExecIO, cwd: str | None) -> int:
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
    output_reader = PipeOutput(master)

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
    output = asyncio.create_task(_copy_out(output_reader, io.stdout), name="pty output")
    try:
        returncode = await proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(output), OUTPUT_DRAIN_SECONDS)
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        output_reader.stop()
        await cancel_and_wait(*helpers, output)
        os.close(master)
    return _exit_code(returncode)


def _make_controlling_tty(slave: int) -> None:
    # Runs in the child between fork and exec: a new session whose controlling terminal is
    # the pty slave (still open here whatever the event loop did with stdio so far).
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
