"""A warm parent for the per-pod helpers (container shims, pod holders): each is forked from an
interpreter that has already imported it, instead of being a new interpreter.

Most of a spawned helper's start is the interpreter and its imports, and all of that memory is
its own. Forked from this process it starts in milliseconds and shares the pages neither
touches with the forker and with every other helper forked from it (PSS divides shared pages).

`python -m podgate.linux.forker [MODULE ...]` talks to the daemon over its stdin, one end of a
unix socket pair: it says "ready", then answers requests, one JSON line {"module": M, "args":
[...], "log": FILE} for one of its modules (default: HELPERS), with the exit status of the
first fork as a line (0: the helper is on its way; it reports through its ready file, as a
spawned one does). A helper is
forked twice and starts a new session: it is no child of the forker or the daemon and outlives
both, and runs as `python -m M ARGS --foreground` would. The forker lives as long as the
daemon: the daemon's end closing (EOF), a `kill -9` of the daemon included, ends it. No path
names it, so nothing else can ask it for anything.

Modules named on the command line (the sandbox shim's) are forked by a second stage: a child
of this forker, started with the first request for one of them, that imports them, runs their
`warm(scratch)` and forks their `main(argv)`. Requests for them go through this forker to it.
Their imports (asyncio, for one) stay out of the pages every container shim maps, and what the
stage did not write it shares with this forker and every helper of both.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from podgate.linux.proc import SpawnError, fork_call, helper_env, log_tail, spawn_detached

# asyncio and logging are the daemon side's (Forker), imported where used: the forker process
# imports this module, and what it imports is in every helper it forks.
if TYPE_CHECKING:
    import asyncio

__all__ = ["HELPERS", "Forker", "main"]

# What the first forker forks (the per-pod helpers of every pod), by module name.
HELPERS: Final = ("podgate.linux.shim", "podgate.linux.holder")

# Starting the forker (an interpreter importing the shim) on a loaded machine, seconds.
FORKER_START_TIMEOUT: Final = 30.0
# One request: a fork and the first child's exit, seconds.
REQUEST_TIMEOUT: Final = 10.0
_READY: Final = b"ready\n"
_MAX_REQUEST: Final = 64 * 1024
# The answer to a request the forker could not read or run (no exit status is negative).
_BAD_REQUEST: Final = -1


# The helpers of the forker being run (this process): module name -> its main(argv).
_serving: dict[str, Callable[[Sequence[str] | None], int]] = {}


def _grandchild(module: str, args: list[str], log_file: str) -> int:
    """The helper, in a new session, with the stdio a spawned one gets."""
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    for name in os.listdir("/proc/self/fd"):  # the forker's socket and pipes, not ours
        if int(name) > 2:
            with contextlib.suppress(OSError):
                os.close(int(name))
    return _serving[module]([*args, "--foreground"])


def _fork_helper(module: str, args: list[str], log_file: str) -> int:
    """Fork, setsid, fork again; the first child's exit status (0 once the helper is forked)."""

    def first_child() -> int:
        os.setsid()
        fork_call(lambda: _grandchild(module, args, log_file), "forked helper")
        return 0

    pid = fork_call(first_child, "forker")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class _Stage:
    """The second stage: a child of this forker that imports `modules` and forks them."""

    def __init__(self, modules: list[str], upstream: socket.socket) -> None:
        self.modules = frozenset(modules)
        self._upstream = upstream  # the daemon's socket: not the stage's to keep
        self._conn: socket.socket | None = None
        self._pid = 0

    def ask(self, request: bytes) -> bytes:
        """Its answer to `request`; a new stage once if the old one is gone."""
        for attempt in (1, 2):
            try:
                conn = self._conn or self._start()
                conn.sendall(request + b"\n")
                answer = _read_line(conn)
                if answer:
                    return answer
                raise OSError("the second stage exited")
            except OSError as exc:
                self._stop()
                if attempt == 2:
                    raise OSError(f"no second stage: {exc}") from exc
        raise AssertionError("unreachable")

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair()

        def stage() -> int:
            ours.close()
            self._upstream.close()
            return _run_stage(theirs, sorted(self.modules))

        pid = fork_call(stage, "forker: the second stage failed")
        theirs.close()
        self._conn, self._pid = ours, pid
        if _read_line(ours) != _READY:
            raise OSError("the second stage did not start")
        return ours

    def close(self) -> None:
        """Stop the stage (helpers it forked keep running)."""
        self._stop()

    def _stop(self) -> None:
        conn, self._conn = self._conn, None
        pid, self._pid = self._pid, 0
        if conn is not None:
            conn.close()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _run_stage(conn: socket.socket, modules: list[str]) -> int:
    """The second stage's life: import and warm `modules`, then fork them until EOF."""
    _serving.clear()
    with tempfile.TemporaryDirectory(prefix="podgate-forker-") as scratch:
        _serving.update(_load(modules, scratch))
    gc.collect()
    gc.freeze()
    conn.sendall(_READY)
    serve(conn, functools.partial(_answer, None))
    return 0


def _read_line(conn: socket.socket) -> bytes:
    """One line from the stage (they are short); b"" at EOF."""
    line = b""
    while not line.endswith(b"\n") and len(line) < _MAX_REQUEST:
        chunk = conn.recv(1)
        if not chunk:
            return b""
        line += chunk
    return line


def _answer(stage: _Stage | None, request: bytes) -> bytes:
    try:
        data = json.loads(request)
        module, args = str(data["module"]), [str(a) for a in data["args"]]
        if stage is not None and module in stage.modules:
            return stage.ask(request)
        if module not in _serving:
            raise ValueError(f"no helper {module!r}")
        code = _fork_helper(module, args, str(data["log"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"forker: bad request: {exc}", file=sys.stderr)
        code = _BAD_REQUEST
    return b"%d\n" % code


def serve(conn: socket.socket, answer: Callable[[bytes], bytes]) -> None:
    """Answer requests on `conn` until the daemon's end closes."""
    buffered = b""
    while True:
        newline = buffered.find(b"\n")
        if newline >= 0:
            request, buffered = buffered[:newline], buffered[newline + 1 :]
            conn.sendall(answer(request))
            continue
        if len(buffered) > _MAX_REQUEST:
            return
        chunk = conn.recv(_MAX_REQUEST)
        if not chunk:
            return
        buffered += chunk


def _load(modules: list[str], scratch: str) -> dict[str, Callable[[Sequence[str] | None], int]]:
    """Import the helper modules named, warm them; their mains by name."""
    mains = {}
    for name in modules:
        module = importlib.import_module(name)
        warm = getattr(module, "warm", None)
        if warm is not None:
            warm(scratch)
        mains[name] = module.main
    return mains


def main(argv: Sequence[str] | None = None) -> int:
    modules = list(sys.argv[1:] if argv is None else argv)
    if any(m.startswith("-") for m in modules):
        usage = "usage: python -m podgate.linux.forker [MODULE ...]  (stdin: a unix socket)"
        print(usage, file=sys.stderr)
        return 2
    conn = socket.socket(fileno=os.dup(0))
    # What the helpers will use, imported and run once (podgate.linux.shim.warm), frozen out
    # of the collector's way, so their pages stay shared after a fork. No thread is left
    # running: the forker only forks.
    try:
        with tempfile.TemporaryDirectory(prefix="podgate-forker-") as scratch:
            _serving.update(_load(list(HELPERS), scratch))
    except (ImportError, AttributeError) as exc:
        print(f"forker: cannot load its helpers: {exc}", file=sys.stderr)
        return 2
    gc.collect()
    gc.freeze()
    stage = _Stage(modules, conn) if modules else None
    try:
        conn.sendall(_READY)
        serve(conn, functools.partial(_answer, stage))
    except OSError as exc:
        print(f"forker: the daemon's socket failed: {exc}", file=sys.stderr)
    finally:
        conn.close()
        if stage is not None:
            stage.close()
    return 0


def _warn(message: str, *args: object) -> None:
    import logging

    logging.getLogger(__name__).warning(message, *args)


class Forker:
    """The daemon's side: starts the forker on first use (again if it died) and asks it for
    helpers."""

    def __init__(self, log_file: str, modules: Sequence[str] = ()) -> None:
        """`modules`: what it forks besides HELPERS, from its second stage."""
        import asyncio

        self.log_file = log_file
        self.modules = tuple(modules)
        self._process: subprocess.Popen[bytes] | None = None
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the forker ahead of the first helper; a failure is only logged (the first
        helper tries again, and spawns a new interpreter if that fails too)."""
        async with self._lock:
            try:
                await self._ensure_running()
            except (OSError, TimeoutError) as exc:
                _warn("helper forker did not start: %s", exc)

    async def spawn(self, module: str, args: list[str], log_file: str) -> None:
        """Fork `python -m module args` (which daemonizes itself when spawned); a spawned one
        if the forker cannot be had. SpawnError if the helper could not be started."""
        if module not in HELPERS and module not in self.modules:
            raise SpawnError(f"no helper {module!r}")
        try:
            code = await self._request(module, args, log_file)
        except (OSError, TimeoutError, ValueError) as exc:
            _warn("helper forker unavailable (%s); spawning %s", exc, module)
            await spawn_detached([sys.executable, "-m", module, *args], log_file)
            return
        if code != 0:
            raise SpawnError(f"{module} fork exited with {code}: {log_tail(log_file)}")

    async def _request(self, module: str, args: list[str], log_file: str) -> int:
        import asyncio

        request = json.dumps({"module": module, "args": args, "log": log_file}).encode()
        async with self._lock:  # one request at a time on the one socket
            try:
                reader, writer = await self._ensure_running()
                # The first request for a module of the second stage starts the stage.
                timeout = REQUEST_TIMEOUT if module in HELPERS else FORKER_START_TIMEOUT
                async with asyncio.timeout(timeout):
                    writer.write(request + b"\n")
                    line = await reader.readline()
                if not line:
                    raise OSError("the helper forker exited")
                return int(line)
            except BaseException:
                self.close()  # mid-request, its answer is lost: a new one next time
                raise

    async def _ensure_running(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        import asyncio

        if self._stream is not None and self._process is not None and self._process.poll() is None:
            return self._stream
        self.close()
        ours, theirs = socket.socketpair()
        self._sock = ours
        try:
            self._process = await asyncio.to_thread(self._popen, theirs)
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            self.close()
            raise
        self._stream = reader, writer
        try:
            async with asyncio.timeout(FORKER_START_TIMEOUT):
                ready = await reader.readline()
        except BaseException:
            self.close()
            raise
        if ready != _READY:
            self.close()
            raise OSError(f"the helper forker did not start: {log_tail(self.log_file)}")
        return reader, writer

    def _popen(self, conn: socket.socket) -> subprocess.Popen[bytes]:
        with open(self.log_file, "ab") as log_out:
            return subprocess.Popen(
                [sys.executable, "-m", "podgate.linux.forker", *self.modules],
                stdin=conn.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=log_out,
                start_new_session=True,
                close_fds=True,
                env=helper_env(),
            )

    @property
    def pid(self) -> int | None:
        """The running forker's pid, if one runs."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Stop the forker (helpers it forked keep running): its socket closes, it exits."""
        stream, self._stream = self._stream, None
        sock, self._sock = self._sock, None
        if sock is not None:  # EOF for the forker now, not when the transport gets to it
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if stream is not None:
            stream[1].close()
        elif sock is not None:
            sock.close()
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.wait(REQUEST_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
