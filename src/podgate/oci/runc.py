"""The OCI runtime binary (runc, or crun with the same command line), driven as a subprocess.

Every call runs `<binary> --root <root> --log <log> --log-format json <command> ...`. A
failure raises RuncError carrying runc's own error text: the `error`-level entries it wrote to
its log file during that call (else its stderr), verbatim.

Environment values never go on a command line: exec takes a process JSON file (`--process`),
update a resources JSON file (`-r`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["DEFAULT_RUNTIME", "Runc", "RuncError", "RuncResult"]

DEFAULT_RUNTIME: Final = "runc"
# Signals Python ignores that a child must not inherit ignored (subprocess restores them too).
_RESTORED_SIGNALS: Final = (signal.SIGPIPE, signal.SIGXFSZ)
# Bytes of a log file read back for an error message.
MAX_LOG_READ: Final = 64 * 1024


class RuncError(Exception):
    """The OCI runtime failed; the message is its own."""


@dataclass(frozen=True, slots=True)
class RuncResult:
    code: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True, slots=True)
class Runc:
    binary: str
    root: str  # runc's state directory (--root)
    log: str  # runc's log file (JSON lines), per container

    def argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", self.root, "--log", self.log, "--log-format", "json", *args]

    # -- errors

    def _log_size(self) -> int:
        try:
            return os.path.getsize(self.log)
        except OSError:
            return 0

    def error_since(self, offset: int, stderr: bytes = b"") -> str:
        """runc's error entries written after `offset`, else its stderr."""
        messages: list[str] = []
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read(MAX_LOG_READ)
        except OSError:
            data = b""
        for line in data.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
                messages.append(str(entry.get("msg", "")))
        if messages:
            return "; ".join(messages)
        return stderr.decode("utf-8", "replace").strip() or "the OCI runtime failed"

    # -- synchronous (the shim, at start)

    def run_sync(
        self,
        args: Sequence[str],
        *,
        stdin: int = subprocess.DEVNULL,
        stdout: int = subprocess.DEVNULL,
        stderr: int = subprocess.DEVNULL,
    ) -> None:
        """Run and wait; `subprocess.DEVNULL` or an fd for each of the child's stdio.

        One posix_spawn, not subprocess: the shim calls this at start, and each page of
        Python it runs there is a page it no longer shares with the forker (subprocess cost
        a forked shim about 0.2 MiB). Our other fds are close-on-exec (Python's default)."""
        offset = self._log_size()
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            actions = [
                (os.POSIX_SPAWN_DUP2, devnull if fd == subprocess.DEVNULL else fd, target)
                for target, fd in enumerate((stdin, stdout, stderr))
            ]
            pid = os.posix_spawnp(
                self.binary,
                self.argv(*args),
                os.environ,
                file_actions=actions,
                setsigdef=_RESTORED_SIGNALS,  # as subprocess's restore_signals
            )
        finally:
            os.close(devnull)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuncError(self.error_since(offset))

    # -- asynchronous (the runtime)

    async def run(self, args: Sequence[str], *, input: bytes | None = None) -> bytes:
        import asyncio  # here: the shims forked by podgate.linux.forker run no event loop

        offset = self._log_size()
        proc = await asyncio.create_subprocess_exec(
            *self.argv(*args),
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
        )
        out, err = await proc.communicate(input)
        if proc.returncode != 0:
            raise RuncError(self.error_since(offset, err))
        return out

    async def state(self, container_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(await self.run(["state", container_id]))
        return data

    async def start(self, container_id: str) -> None:
        await self.run(["start", container_id])

    async def kill(self, container_id: str, signal: int, *, all_processes: bool = False) -> None:
        await self.run(["kill", *(["--all"] if all_processes else []), container_id, str(signal)])

    async def delete(self, container_id: str, *, force: bool = True) -> None:
        await self.run(["delete", *(["--force"] if force else []), container_id])

    async def update(self, container_id: str, resources_file: str) -> None:
        await self.run(["update", "--resources", resources_file, container_id])

    async def stats(self, container_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(await self.run(["events", "--stats", container_id]))
        return data

    def create_args(
        self, container_id: str, bundle: str, pid_file: str, console_socket: str = ""
    ) -> list[str]:
        args = ["create", "--bundle", bundle, "--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        return [*args, container_id]

    def exec_argv(
        self, container_id: str, process_file: str, *, detach_pid_file: str = ""
    ) -> list[str]:
        """`exec --process FILE`: in the foreground (a tty in the file is relayed by runc), or
        detached with the process's pid written to `detach_pid_file`."""
        args = ["exec", "--process", process_file]
        if detach_pid_file:
            args += ["--detach", "--pid-file", detach_pid_file]
        return self.argv(*args, container_id)
