"""A warm parent for the per-pod helpers (container shims, pod holders): each is forked from an
interpreter that has already imported it, instead of being a new interpreter.

Most of a spawned helper's start is the interpreter and its imports, and all of that memory is
its own. Forked from this process it starts in milliseconds and shares the pages neither
touches with the forker and with every other helper forked from it (PSS divides shared pages).

`python -m podgate.linux.forker --socket PATH` listens on PATH; a request is one JSON line
{"module": M, "args": [...], "log": FILE} for a module of HELPERS, the answer the exit status
of the first fork as a line (0: the helper is on its way; it reports through its ready file, as
a spawned one does). A helper is forked twice and starts a new session: it is no child of the
forker or the daemon and outlives both, and runs as `python -m M ARGS --foreground` would.
The forker itself lives as long as the daemon: its stdin is a pipe from the daemon, whose end
(EOF) ends the forker, a `kill -9` of the daemon included.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import selectors
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Final

from podgate.linux import holder as holder_mod
from podgate.linux import shim as shim_mod
from podgate.linux.proc import SpawnError, helper_env, log_tail, spawn_detached

__all__ = ["HELPERS", "Forker", "main"]

# What may be forked: module name -> its main(argv).
HELPERS: Final[dict[str, Callable[[Sequence[str] | None], int]]] = {
    "podgate.linux.shim": shim_mod.main,
    "podgate.linux.holder": holder_mod.main,
}

log = logging.getLogger(__name__)

# Starting the forker (an interpreter importing the shim) on a loaded machine, seconds.
FORKER_START_TIMEOUT: Final = 30.0
# One request: a fork and the first child's exit, seconds.
REQUEST_TIMEOUT: Final = 10.0
_READY: Final = b"ready\n"
_MAX_REQUEST: Final = 64 * 1024


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
    return HELPERS[module]([*args, "--foreground"])


def _fork_helper(module: str, args: list[str], log_file: str) -> int:
    """Fork, setsid, fork again; the first child's exit status (0 once the helper is forked)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            if os.fork() == 0:
                try:
                    code = _grandchild(module, args, log_file)
                finally:
                    with contextlib.suppress(Exception):
                        sys.stderr.flush()
                    os._exit(code)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk or len(data) > _MAX_REQUEST:
            raise ValueError("incomplete request")
        data += chunk
    return data


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            request = json.loads(_read_line(conn))
            module, args = str(request["module"]), [str(a) for a in request["args"]]
            if module not in HELPERS:
                raise ValueError(f"no helper {module!r}")
            code = _fork_helper(module, args, str(request["log"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"forker: bad request: {exc}", file=sys.stderr)
            return
        with contextlib.suppress(OSError):
            conn.sendall(b"%d\n" % code)


def serve(listener: socket.socket, stdin: int = 0) -> None:
    """Answer requests until `stdin` ends (the daemon is gone)."""
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == stdin:
                    if not os.read(stdin, 4096):
                        return
                    continue
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                _handle(conn)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--socket":
        print("usage: python -m podgate.linux.forker --socket PATH", file=sys.stderr)
        return 2
    path = args[1]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # only root (the daemon) may ask for helpers
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen()
    # What the helpers will use, imported (an event loop run once: its lazy imports and
    # singletons) and frozen out of the collector's way, so their pages stay shared after a
    # fork. No thread is left running: the forker only forks.
    asyncio.run(asyncio.sleep(0))
    gc.collect()
    gc.freeze()
    os.write(1, _READY)
    try:
        serve(listener)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return 0


class Forker:
    """The daemon's side: starts the forker on first use (again if it died) and asks it for
    helpers."""

    def __init__(self, socket_path: str, log_file: str) -> None:
        self.socket_path = socket_path
        self.log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = asyncio.Lock()

    async def spawn(self, module: str, args: list[str], log_file: str) -> None:
        """Fork `python -m module args` (which daemonizes itself when spawned); a spawned one
        if the forker cannot be had. SpawnError if the helper could not be started."""
        if module not in HELPERS:
            raise SpawnError(f"no helper {module!r}")
        try:
            code = await self._request(module, args, log_file)
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("helper forker unavailable (%s); spawning %s", exc, module)
            await spawn_detached([sys.executable, "-m", module, *args], log_file)
            return
        if code != 0:
            raise SpawnError(f"{module} fork exited with {code}: {log_tail(log_file)}")

    async def _request(self, module: str, args: list[str], log_file: str) -> int:
        request = json.dumps({"module": module, "args": args, "log": log_file}).encode()
        async with self._lock:  # the forker serves one request at a time anyway
            await self._ensure_running()
            async with asyncio.timeout(REQUEST_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
                try:
                    writer.write(request + b"\n")
                    line = await reader.readline()
                finally:
                    writer.close()
            return int(line)

    async def _ensure_running(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self.close()
        process = self._process = await asyncio.to_thread(self._popen)
        assert process.stdout is not None
        try:
            async with asyncio.timeout(FORKER_START_TIMEOUT):
                ready = await asyncio.to_thread(process.stdout.readline)
        except BaseException:
            self.close()
            raise
        if ready != _READY:
            self.close()
            raise OSError(f"the helper forker did not start: {log_tail(self.log_file)}")

    def _popen(self) -> subprocess.Popen[bytes]:
        # The pipe on its stdin is its lifeline: no other process holds its write end.
        with open(self.log_file, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "podgate.linux.forker", "--socket", self.socket_path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                close_fds=True,
                env=helper_env(),
            )

    def close(self) -> None:
        """Stop the forker (helpers it forked keep running)."""
        process, self._process = self._process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            process.wait(REQUEST_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
