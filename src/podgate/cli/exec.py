"""`podgate exec` and `podgate attach`: kubectl's, over podgate's own protocol clients.

The transport is kubectl 1.30+'s: WebSocket `v5.channel.k8s.io` first, SPDY when the server
answers the WebSocket request with anything but a proper 101 (kubectl-api-surface.md §1.3).
The remote command's exit code becomes podgate's; a failure to run it at all exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import stat
import sys
import termios
import tty as ttymod
from collections.abc import AsyncIterator, Callable, Iterator

import click

from podgate.aio.errors import ConflictGuard, StreamError
from podgate.aio.loop import run
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.cli.portforward import kubeconfig_options, load_api
from podgate.kubeconfig import ApiServer
from podgate.proto.errors import ProtocolError
from podgate.proto.remotecommand import TerminalSize
from podgate.streaming.client import (
    ExecResult,
    UpgradeError,
    exec_query,
    exec_spdy,
    exec_websocket,
    pod_path,
)

# Exit code for "could not run the command" (kubectl's).
FAILURE_EXIT_CODE = 1
NO_TTY_WARNING = "Unable to use a TTY - input is not a terminal or the right kind of file"
TRANSPORTS = ("auto", "websocket", "spdy")


class FdStream(ByteStream):
    """Our stdin as a readable stream, or stdout/stderr as a writable one, without threads.

    A pipe or terminal is read through the event loop (non-blocking, restored on close); a
    regular file is read directly, which never blocks for long. Writes wait on the loop when
    the descriptor happens to be non-blocking (a terminal shares one with stdin).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._loop = asyncio.get_running_loop()
        self._restore_flags: int | None = None
        self._eof = False
        # One waiter per direction: the loop keeps one reader/writer callback per fd.
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")

    def _prepare_read(self) -> None:
        if self._restore_flags is not None:
            return
        mode = os.fstat(self.fd).st_mode
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        self._restore_flags = flags
        if not stat.S_ISREG(mode):
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)

    async def _wait(self, add: Callable[..., None], remove: Callable[[int], object]) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        add(self.fd, wake)
        try:
            await ready
        finally:
            remove(self.fd)

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            return await self._receive(max_bytes)

    async def _receive(self, max_bytes: int) -> bytes:
        if self._eof:
            return b""
        self._prepare_read()
        while True:
            try:
                data = os.read(self.fd, max_bytes)
            except BlockingIOError:
                await self._wait(self._loop.add_reader, self._loop.remove_reader)
                continue
            except OSError as exc:  # EIO: the terminal went away
                raise StreamError(str(exc)) from exc
            if not data:
                self._eof = True
            return data

    async def send(self, data: Buffer) -> None:
        with self._sending:
            await self._send(data)

    async def _send(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                written = os.write(self.fd, view)
            except BlockingIOError:
                await self._wait(self._loop.add_writer, self._loop.remove_writer)
                continue
            except OSError as exc:  # EPIPE: whoever read our output left
                raise StreamError(str(exc)) from exc
            view = view[written:]

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        if self._restore_flags is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETFL, self._restore_flags)
            self._restore_flags = None


def terminal_size(fd: int) -> TerminalSize:
    size = os.get_terminal_size(fd)
    return TerminalSize(width=size.columns, height=size.lines)


async def terminal_sizes(fd: int, *, redraw: bool = False) -> AsyncIterator[TerminalSize]:
    """The terminal's size now, then again after every SIGWINCH that changed it.

    With `redraw` the first size is sent one larger first, as `kubectl attach -t` does, so a
    program already running redraws its screen.
    """
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    loop.add_signal_handler(signal.SIGWINCH, changed.set)
    try:
        size = terminal_size(fd)
        if redraw:
            yield TerminalSize(width=size.width + 1, height=size.height + 1)
        yield size
        while True:
            await changed.wait()
            changed.clear()
            new = terminal_size(fd)
            if new != size:
                size = new
                yield size
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """Raw mode for the session (keys go to the remote terminal as typed), restored after."""
    saved = termios.tcgetattr(fd)
    try:
        ttymod.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_session(
    api: ApiServer,
    path: str,
    *,
    stdin: bool,
    tty: bool,
    transport: str,
    redraw: bool = False,
) -> ExecResult:
    """Connect (WebSocket, then SPDY) and run one exec/attach with our stdio."""
    loop_streams = [FdStream(0) if stdin else None, FdStream(1), None if tty else FdStream(2)]
    in_stream, out_stream, err_stream = loop_streams
    try:
        if transport != "spdy":
            try:
                return await exec_websocket(
                    api.endpoint,
                    path,
                    stdin=in_stream,
                    stdout=out_stream,
                    stderr=err_stream,
                    tty=tty,
                    resizes=terminal_sizes(0, redraw=redraw) if tty else None,
                )
            except UpgradeError as exc:
                # Fall back on any complete non-101 answer, as kubectl; not on silence.
                if transport == "websocket" or exc.status == 0:
                    raise
        return await exec_spdy(
            api.endpoint,
            path,
            stdin=in_stream,
            stdout=out_stream,
            stderr=err_stream,
            tty=tty,
            resizes=terminal_sizes(0, redraw=redraw) if tty else None,
            want_stdin=stdin,
        )
    finally:
        for stream in loop_streams:
            if stream is not None:
                await stream.aclose()


def _run_command(
    api: ApiServer, path: str, *, stdin: bool, tty: bool, transport: str, redraw: bool = False
) -> int:
    """Run the session with the terminal set up; returns the exit code for podgate."""
    raw = tty and stdin and sys.stdin.isatty()
    try:
        with raw_terminal(0) if raw else contextlib.nullcontext():
            result = run(
                run_session(api, path, stdin=stdin, tty=tty, transport=transport, redraw=redraw)
            )
    except UpgradeError as exc:
        text = str(exc)
        click.echo(text if text.startswith("Error from server") else f"error: {text}", err=True)
        return FAILURE_EXIT_CODE
    except (StreamError, OSError, ProtocolError) as exc:
        click.echo(f"error: {exc}", err=True)
        return FAILURE_EXIT_CODE
    if result.exit_code != 0:
        if (
            result.error
            and result.exit_code == FAILURE_EXIT_CODE
            and "exit code" not in result.error
        ):
            click.echo(f"error: {result.error}", err=True)
        else:
            click.echo(f"command terminated with exit code {result.exit_code}", err=True)
    return result.exit_code


def _tty_allowed(tty: bool) -> bool:
    if tty and not sys.stdin.isatty():
        click.echo(NO_TTY_WARNING, err=True)
        return False
    return tty


_COMMON = [
    click.option("-i", "--stdin", "stdin", is_flag=True, help="Pass stdin to the container."),
    click.option("-t", "--tty", "tty", is_flag=True, help="Stdin is a TTY (raw mode, resizes)."),
    click.option("-c", "--container", default=None, help="Container [default: the first]."),
    click.option(
        "--transport",
        type=click.Choice(TRANSPORTS),
        default="auto",
        show_default=True,
        help="auto: WebSocket v5, SPDY if refused.",
    ),
]


def _common(f: Callable[..., object]) -> Callable[..., object]:
    for option in reversed(_COMMON):
        f = option(f)
    return kubeconfig_options(f)


@click.command("exec", context_settings={"ignore_unknown_options": False})
@click.argument("pod")
@click.argument("command", nargs=-1, required=True)
@_common
@click.pass_context
def exec_command(
    ctx: click.Context,
    pod: str,
    command: tuple[str, ...],
    stdin: bool,
    tty: bool,
    container: str | None,
    transport: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
) -> None:
    """Run COMMAND in a container of POD: podgate exec [-i] [-t] POD -- COMMAND [ARG...].

    The command's exit code is podgate's; 1 when it could not be run.
    """
    api = load_api(kubeconfig, context, namespace)
    tty = _tty_allowed(tty)
    name = pod.removeprefix("pod/").removeprefix("pods/")
    query = exec_query(command, container=container, stdin=stdin, stdout=True, tty=tty)
    path = api.path(pod_path(api.namespace, name, "exec")) + "?" + query
    ctx.exit(_run_command(api, path, stdin=stdin, tty=tty, transport=transport))


@click.command("attach")
@click.argument("pod")
@_common
@click.pass_context
def attach_command(
    ctx: click.Context,
    pod: str,
    stdin: bool,
    tty: bool,
    container: str | None,
    transport: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
) -> None:
    """Attach to the running process of a container in POD (its stdin with -i).

    Ends when the process ends; its exit code is podgate's.
    """
    api = load_api(kubeconfig, context, namespace)
    tty = _tty_allowed(tty)
    name = pod.removeprefix("pod/").removeprefix("pods/")
    query = exec_query((), container=container, stdin=stdin, stdout=True, tty=tty)
    path = api.path(pod_path(api.namespace, name, "attach")) + "?" + query
    ctx.exit(_run_command(api, path, stdin=stdin, tty=tty, transport=transport, redraw=tty))
