"""Processes the daemon did not start in its own lifetime, and crash-safe JSON state files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from podgate.files import atomic_write
from podgate.model import ProcessRef

if TYPE_CHECKING:  # imported where used: see podgate.linux.forker
    import asyncio

__all__ = [
    "Spawn",
    "SpawnError",
    "atomic_write_json",
    "fork_call",
    "helper_env",
    "is_alive",
    "log_tail",
    "process_ref",
    "read_json",
    "read_stat",
    "signal_process",
    "spawn_detached",
    "wait_gone",
    "wait_ready_file",
]

# Polling interval when a pidfd is not available, seconds.
_POLL_SECONDS: Final = 0.02
# How often a starting helper's ready file is looked for, seconds.
_READY_POLL_SECONDS: Final = 0.01
# Bytes of a helper's log quoted in a start failure: enough for a traceback's last lines.
_LOG_TAIL_BYTES: Final = 2048
# /proc/<pid>/stat: fields after "(comm)" start at field 3 (state); start time is field 22.
_FIRST_FIELD_AFTER_COMM: Final = 3
_FLAGS_FIELD: Final = 9
_STARTTIME_FIELD: Final = 22
# task->flags bit set as soon as a process starts to exit, before the kernel closes its files:
# a peer that sees one of its sockets end can tell a dying process from a live one.
_PF_EXITING: Final = 0x4
# States of a process that has exited (zombie) or is being torn down (dead).
_GONE_STATES: Final = frozenset({"Z", "X", "x"})


def fork_call(child: Callable[[], int], what: str) -> int:
    """Fork; the child runs `child()` and exits with what it returns, never returning into the
    caller's code (1, with `what` and the error on stderr, if it raises). The child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()  # what the parent buffered must not be written twice
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = child()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            print(f"{what}: {exc!r}", file=sys.stderr)
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/<pid>/stat's fields from field 3 (state) on; ProcessLookupError if none.

    comm is in parentheses and may itself hold spaces and parentheses, so the fields are
    taken after the LAST ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    return raw[raw.rindex(b")") + 2 :].split()


def read_stat(pid: int) -> tuple[str, int]:
    """(state letter, start time in clock ticks) of `pid`; ProcessLookupError if none."""
    rest = _stat_fields(pid)
    return rest[0].decode("ascii"), int(rest[_STARTTIME_FIELD - _FIRST_FIELD_AFTER_COMM])


def is_exiting(ref: ProcessRef) -> bool:
    """True if `ref` is gone, a zombie, or on its way out (killed, its files being closed)."""
    try:
        rest = _stat_fields(ref.pid)
    except ProcessLookupError:
        return True
    flags = int(rest[_FLAGS_FIELD - _FIRST_FIELD_AFTER_COMM])
    return (
        int(rest[_STARTTIME_FIELD - _FIRST_FIELD_AFTER_COMM]) != ref.start_time
        or rest[0].decode("ascii") in _GONE_STATES
        or bool(flags & _PF_EXITING)
    )


def process_ref(pid: int) -> ProcessRef:
    _, start_time = read_stat(pid)
    return ProcessRef(pid=pid, start_time=start_time)


def is_alive(ref: ProcessRef) -> bool:
    """True if `ref.pid` is still the same process and it has not exited."""
    try:
        state, start_time = read_stat(ref.pid)
    except ProcessLookupError:
        return False
    return start_time == ref.start_time and state not in _GONE_STATES


async def wait_gone(ref: ProcessRef, timeout: float) -> bool:
    """Wait up to `timeout` seconds for the process to exit; True once it has."""
    import asyncio

    if not is_alive(ref):
        return True
    try:
        pidfd = os.pidfd_open(ref.pid)
    except OSError:
        return await _poll_gone(ref, timeout)
    try:
        # The pid may have been reused between the check and the open.
        if not is_alive(ref):
            return True
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _resolve, readable)
        try:
            async with asyncio.timeout(timeout):
                await readable
        except TimeoutError:
            return not is_alive(ref)
        finally:
            loop.remove_reader(pidfd)
        return True
    finally:
        os.close(pidfd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _poll_gone(ref: ProcessRef, timeout: float) -> bool:
    import asyncio

    deadline = time.monotonic() + timeout
    while is_alive(ref):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_SECONDS)
    return True


def atomic_write_json(path: str, obj: Any) -> None:
    """Replace `path` with `obj` as JSON so readers see the old or the new file, never half."""
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8")
    atomic_write(path, data)


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class SpawnError(Exception):
    """A detached helper (pod holder, container shim) failed to start; the message says why."""


def signal_process(ref: ProcessRef, sig: int) -> bool:
    """Send `sig` to the process if it is still `ref`; False if it is gone.

    A pidfd pins the process between the identity check and the signal, so a reused pid is
    never hit.
    """
    try:
        pidfd = os.pidfd_open(ref.pid)
    except ProcessLookupError:
        return False
    try:
        if not is_alive(ref):
            return False
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(pidfd)


def _source_root() -> str:
    # The directory holding the podgate package, so `python -m podgate...` works uninstalled.
    import podgate

    return os.path.dirname(os.path.dirname(os.path.abspath(podgate.__file__)))


def helper_env() -> dict[str, str]:
    """The environment of a helper interpreter: ours, with podgate's sources importable."""
    env = dict(os.environ)
    root = _source_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _spawn_and_reap(argv: list[str], log_file: str) -> int:
    env = helper_env()
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    # The helper forks itself away and this first process exits at once; reap it so no
    # zombie is left behind, and so the helper is re-parented away from us.
    return proc.wait()


# Starts `python -m MODULE ARGS` some other way than a new interpreter (podgate.linux.forker):
# (module, args, log_file).
Spawn: TypeAlias = Callable[[str, list[str], str], Awaitable[None]]


async def spawn_detached(argv: list[str], log_file: str) -> None:
    """Start a helper that daemonizes itself (new session, stdio to /dev/null and `log_file`)."""
    import asyncio

    code = await asyncio.to_thread(_spawn_and_reap, argv, log_file)
    if code != 0:
        raise SpawnError(f"{' '.join(argv[:3])} exited with {code}: {log_tail(log_file)}")


def log_tail(path: str, limit: int = _LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


async def wait_ready_file(path: str, timeout: float, log_file: str) -> dict[str, Any]:
    """Poll for a helper's ready file; SpawnError with its message (or log tail) on failure."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        try:
            data = read_json(path)
        except FileNotFoundError:
            data = None
        if isinstance(data, dict):
            if "error" in data:
                raise SpawnError(str(data["error"]))
            return data
        if time.monotonic() >= deadline:
            tail = log_tail(log_file)
            raise SpawnError(
                f"no ready file {path} after {timeout:g}s" + (f": {tail}" if tail else "")
            )
        await asyncio.sleep(_READY_POLL_SECONDS)
