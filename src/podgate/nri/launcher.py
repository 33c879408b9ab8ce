"""Pre-installed NRI plugins: discovery in the plugin directory, their drop-in configuration,
and launching one with its end of a socketpair as fd 3 (reference §6.1).

A launched plugin's environment is exactly `NRI_PLUGIN_NAME`, `NRI_PLUGIN_IDX` and
`NRI_PLUGIN_SOCKET=3` — no PATH, so argv[0] must be an absolute path. The process is started
with posix_spawn (its file actions place the socket on fd 3 and the output on fds 1 and 2; every
other descriptor of ours is close-on-exec) and watched through a pidfd, so its exit is noticed,
and it is reaped, without a SIGCHLD watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import stat
from dataclasses import dataclass
from typing import Any

from podgate.nri.merge import NriError

__all__ = [
    "ENV_PLUGIN_IDX",
    "ENV_PLUGIN_NAME",
    "ENV_PLUGIN_SOCKET",
    "PLUGIN_SOCKET_FD",
    "LaunchedProcess",
    "PluginSpec",
    "discover",
    "plugin_config",
    "plugin_environment",
]

log = logging.getLogger(__name__)
output_log = logging.getLogger("podgate.nri.plugins")

ENV_PLUGIN_NAME = "NRI_PLUGIN_NAME"
ENV_PLUGIN_IDX = "NRI_PLUGIN_IDX"
ENV_PLUGIN_SOCKET = "NRI_PLUGIN_SOCKET"
PLUGIN_SOCKET_FD = 3  # where a launched plugin finds its connection to the runtime
# Bytes read from a plugin's output pipe at once; lines longer than this are split.
OUTPUT_READ_BYTES = 64 * 1024
# Bytes of an unterminated output line kept before it is logged anyway.
MAX_OUTPUT_LINE = 16 * 1024
CONFIG_SUFFIX = ".conf"
# Seconds a killed plugin's output pipe may stay open (held by a child it forked) before we stop
# reading it; the process itself is gone by then.
OUTPUT_GRACE = 1.0

# "NN-name": exactly two digits, split at the first "-".
_FILE_NAME = re.compile(r"(?P<idx>[0-9]{2})-(?P<name>.+)")
_EXECUTABLE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """A plugin to launch: its index, name, command line and drop-in configuration."""

    idx: str
    name: str
    argv: tuple[str, ...]
    config: str = ""

    @property
    def full_name(self) -> str:
        return f"{self.idx}-{self.name}"


def plugin_config(config_dir: str, idx: str, name: str) -> str:
    """`<config_dir>/NN-name.conf`, else `<config_dir>/name.conf`, else ""."""
    for candidate in (f"{idx}-{name}{CONFIG_SUFFIX}", f"{name}{CONFIG_SUFFIX}"):
        try:
            with open(os.path.join(config_dir, candidate), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise NriError(
                f"failed to read configuration for plugin {idx}-{name!r}: {exc}"
            ) from exc
    return ""


def discover(plugin_dir: str, config_dir: str) -> list[PluginSpec]:
    """Every executable non-directory entry of `plugin_dir`, sorted by index then name.

    One entry not named `NN-name` fails the whole directory, as upstream's discovery does. A
    missing directory holds no plugins.
    """
    try:
        entries = sorted(os.scandir(plugin_dir), key=lambda entry: entry.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NriError(f"failed to discover plugins in {plugin_dir}: {exc}") from exc
    specs: list[PluginSpec] = []
    for entry in entries:
        try:
            info = entry.stat()
        except OSError as exc:
            raise NriError(f"failed to discover plugins in {plugin_dir}: {exc}") from exc
        if stat.S_ISDIR(info.st_mode) or not info.st_mode & _EXECUTABLE:
            continue
        match = _FILE_NAME.fullmatch(entry.name)
        if match is None:
            raise NriError(
                f"invalid plugin name {entry.name!r} in {plugin_dir}: "
                "want NN-name, NN being a two-digit index"
            )
        idx, name = match["idx"], match["name"]
        specs.append(
            PluginSpec(
                idx=idx,
                name=name,
                argv=(os.path.abspath(entry.path),),
                config=plugin_config(config_dir, idx, name),
            )
        )
    specs.sort(key=lambda spec: (spec.idx, spec.name))
    return specs


def plugin_environment(spec: PluginSpec) -> dict[str, str]:
    """The whole environment of a launched plugin."""
    return {
        ENV_PLUGIN_NAME: spec.name,
        ENV_PLUGIN_IDX: spec.idx,
        ENV_PLUGIN_SOCKET: str(PLUGIN_SOCKET_FD),
    }


def _inheritable_fds() -> list[int]:
    """Our descriptors a child would inherit: ones we were started with, typically (ours are
    close-on-exec). The plugin gets none of them, as a Go runtime's plugins get none."""
    fds: list[int] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.get_inheritable(int(name)):
                fds.append(int(name))
        except OSError:  # the directory's own descriptor, closed by now
            continue
    return fds


class LaunchedProcess:
    """A running pre-installed plugin: its pid, its exit, and its output going to our log (or
    to `<log_dir>/<NN-name>.log`)."""

    def __init__(self, spec: PluginSpec, pid: int, pidfd: int, output_fd: int | None) -> None:
        self.spec = spec
        self.pid = pid
        self._pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = self._loop.create_future()
        self._loop.add_reader(pidfd, self._on_exit)
        self._output_fd = output_fd
        self._output_done: asyncio.Future[None] = self._loop.create_future()
        self._partial = b""
        if output_fd is None:
            self._output_done.set_result(None)
        else:
            os.set_blocking(output_fd, False)
            self._loop.add_reader(output_fd, self._on_output)

    @classmethod
    def spawn(cls, spec: PluginSpec, socket_fd: int, *, log_dir: str = "") -> LaunchedProcess:
        """Start `spec.argv` with `socket_fd` as its fd 3 and only the three NRI variables."""
        executable = spec.argv[0] if spec.argv else ""
        if not os.path.isabs(executable):
            raise NriError(f"plugin {spec.full_name}: {executable!r} is not an absolute path")
        read_fd: int | None = None
        if log_dir:
            os.makedirs(log_dir, mode=0o700, exist_ok=True)
            write_fd = os.open(
                os.path.join(log_dir, f"{spec.full_name}.log"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                0o600,
            )
        else:
            read_fd, write_fd = os.pipe()
        # dup2 onto itself would keep close-on-exec set: never hand fd 3 in as fd 3.
        source_fd = os.dup(socket_fd) if socket_fd == PLUGIN_SOCKET_FD else socket_fd
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds() if fd > 2
        ]
        actions += [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, write_fd, 1),
            (os.POSIX_SPAWN_DUP2, write_fd, 2),
            (os.POSIX_SPAWN_DUP2, source_fd, PLUGIN_SOCKET_FD),
        ]
        try:
            pid = os.posix_spawn(
                executable, list(spec.argv), plugin_environment(spec), file_actions=actions
            )
        except OSError as exc:
            if read_fd is not None:
                os.close(read_fd)
            raise NriError(f"failed to launch plugin {spec.full_name}: {exc}") from exc
        finally:
            os.close(write_fd)
            if source_fd != socket_fd:
                os.close(source_fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            # Cannot watch it: do not leave it running unwatched.
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if read_fd is not None:
                os.close(read_fd)
            raise
        return cls(spec, pid, pidfd, read_fd)

    def kill(self) -> None:
        """SIGKILL (upstream gives plugins no graceful shutdown). A no-op once it has exited."""
        if self.exited.done():
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def aclose(self) -> int:
        """Kill, reap, and release everything; returns the exit code (128+N for signal N)."""
        self.kill()
        code = await asyncio.shield(self.exited)
        try:
            async with asyncio.timeout(OUTPUT_GRACE):
                await asyncio.shield(self._output_done)
        except TimeoutError:
            self._close_output()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return code

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # somebody else reaped it
            code = -1
        else:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
        log.info("nri: plugin %s (pid %d) exited with %d", self.spec.full_name, self.pid, code)
        if not self.exited.done():
            self.exited.set_result(code)

    def _on_output(self) -> None:
        assert self._output_fd is not None
        try:
            data = os.read(self._output_fd, OUTPUT_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            if len(self._partial) > MAX_OUTPUT_LINE:
                lines.append(self._partial)
                self._partial = b""
            for line in lines:
                self._log_line(line)
            return
        self._close_output()

    def _close_output(self) -> None:
        if self._partial:
            self._log_line(self._partial)
            self._partial = b""
        if self._output_fd is not None:
            self._loop.remove_reader(self._output_fd)
            os.close(self._output_fd)
            self._output_fd = None
        if not self._output_done.done():
            self._output_done.set_result(None)

    def _log_line(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        if text:
            output_log.info("%s: %s", self.spec.full_name, text)
