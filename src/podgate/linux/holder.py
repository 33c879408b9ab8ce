"""The pod holder: a tiny process that owns a pod's namespaces (the pause container's job).

Run as `python -m podgate.linux.holder --ready-file PATH [--hostname H] [--pid-ns]`. It
daemonizes (the first process exits at once), unshares NET, UTS and IPC (and PID with
`--pid-ns`), sets the hostname, brings `lo` up, writes the ready file and waits for SIGTERM.

With `--pid-ns` it forks: the child is PID 1 of the pod's PID namespace and reaps the pod's
orphans; the parent forwards SIGTERM/SIGINT to it and exits with its status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Final

from podgate.linux import ns
from podgate.linux.proc import (
    Spawn,
    SpawnError,
    atomic_write_json,
    process_ref,
    signal_process,
    spawn_detached,
    wait_gone,
    wait_ready_file,
)
from podgate.model import ProcessRef

__all__ = [
    "HOLDER_START_TIMEOUT",
    "HOLDER_STOP_TIMEOUT",
    "HolderError",
    "main",
    "start_holder",
    "stop_holder",
]

# How long a holder may take to write its ready file, seconds (an interpreter start).
HOLDER_START_TIMEOUT: Final = 10.0
# How long a holder gets to exit after SIGTERM before SIGKILL, seconds.
HOLDER_STOP_TIMEOUT: Final = 5.0

_STOP_SIGNALS: Final = frozenset({signal.SIGTERM, signal.SIGINT})
_WAITED_SIGNALS: Final = _STOP_SIGNALS | {signal.SIGCHLD}


class HolderError(SpawnError):
    """The pod holder could not set up the pod's namespaces; the message says why."""


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _sleep_until_stopped() -> int:
    """Wait for SIGTERM/SIGINT, reaping children meanwhile (the signals are blocked)."""
    while True:
        sig = signal.sigwait(_WAITED_SIGNALS)
        _reap_all()
        if sig in _STOP_SIGNALS:
            return 0


def _run_pid_ns(ready_file: str, empty_root: str = "") -> int:
    sync_r, sync_w = os.pipe()
    child = os.fork()
    if child == 0:
        # PID 1 of the pod: the kernel drops signals to PID 1 that have no handler, but
        # blocked ones stay pending for sigwait.
        os.close(sync_r)
        os.close(sync_w)
        try:
            code = _sleep_until_stopped()
        finally:
            sys.stderr.flush()
        os._exit(code)
    os.close(sync_w)
    os.read(sync_r, 1)  # EOF once the child runs with signals blocked
    os.close(sync_r)
    atomic_write_json(ready_file, {"holder_pid": os.getpid(), "ns_pid": child})
    if empty_root:
        _leave_node_filesystem(empty_root)  # the child shares the namespace and root: both
    while True:
        sig = signal.sigwait(_WAITED_SIGNALS)
        if sig in _STOP_SIGNALS:
            os.kill(child, signal.SIGTERM)
            continue
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            return _exit_code(status)


def _set_sysctl(key: str, value: str) -> None:
    """Write a sysctl of our own (new) namespaces: /proc/sys/net and the IPC keys follow the
    writer's namespaces."""
    path = "/proc/sys/" + key.replace(".", "/")
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(value)
    except OSError as exc:
        raise OSError(exc.errno, f"sysctl {key}={value}: {exc.strerror}") from exc


def _noop_handler(signum: int, frame: object) -> None:
    del signum, frame


def _daemonize() -> None:
    if os.fork() != 0:
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podgate.linux.holder")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--hostname", default="")
    parser.add_argument("--pid-ns", action="store_true", help="also a new PID namespace")
    parser.add_argument("--foreground", action="store_true", help="do not fork away")
    parser.add_argument(
        "--empty-root",
        metavar="DIR",
        default="",
        help="once ready, live in a private mount namespace whose root is an empty tmpfs on DIR",
    )
    parser.add_argument(
        "--sysctl", action="append", default=[], metavar="KEY=VALUE", help="namespaced sysctl"
    )
    args = parser.parse_args(argv)

    # Handlers keep the signals from being ignored; blocking routes them to sigwait.
    for sig in _WAITED_SIGNALS:
        signal.signal(sig, _noop_handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED_SIGNALS)
    if not args.foreground:
        _daemonize()
    flags = ns.CLONE_NEWNET | ns.CLONE_NEWUTS | ns.CLONE_NEWIPC
    if args.pid_ns:
        flags |= ns.CLONE_NEWPID
    if args.empty_root:
        flags |= ns.CLONE_NEWNS
    try:
        ns.unshare(flags)
        if args.hostname:
            socket.sethostname(args.hostname)
        ns.set_link_up("lo")
        for item in args.sysctl:
            _set_sysctl(*item.split("=", 1))
        if args.empty_root:
            ns.make_mounts_private()
    except OSError as exc:
        message = f"pod holder setup failed: {exc}"
        print(message, file=sys.stderr)
        atomic_write_json(args.ready_file, {"error": message})
        return 1
    if args.pid_ns:
        return _run_pid_ns(args.ready_file, args.empty_root)
    atomic_write_json(args.ready_file, {"holder_pid": os.getpid(), "ns_pid": os.getpid()})
    if args.empty_root:
        _leave_node_filesystem(args.empty_root)
    return _sleep_until_stopped()


def _leave_node_filesystem(directory: str) -> None:
    """A pod's processes see the holder as /proc/1: its root must not be the node's."""
    try:
        ns.enter_empty_root(directory)
    except OSError as exc:
        print(f"pod holder: cannot leave the node's filesystem: {exc}", file=sys.stderr)
        os._exit(1)


async def start_holder(
    hostname: str,
    pid_ns: bool,
    ready_file: str,
    log_file: str,
    *,
    sysctls: dict[str, str] | None = None,
    empty_root: str = "",
    timeout: float = HOLDER_START_TIMEOUT,
    spawn: Spawn | None = None,
) -> tuple[ProcessRef, ProcessRef]:
    """Start a detached holder and wait for it; returns (holder, namespace process) refs.

    Raises HolderError with the holder's message if it failed. `spawn` starts it another way
    (podgate.linux.forker) than a new interpreter.
    """
    try:
        os.unlink(ready_file)
    except FileNotFoundError:
        pass
    args = ["--ready-file", ready_file]
    if hostname:
        args += ["--hostname", hostname]
    if pid_ns:
        args.append("--pid-ns")
    for key, value in (sysctls or {}).items():
        args += ["--sysctl", f"{key}={value}"]
    if empty_root:
        os.makedirs(empty_root, mode=0o755, exist_ok=True)
        args += ["--empty-root", empty_root]
    try:
        if spawn is not None:
            await spawn("podgate.linux.holder", args, log_file)
        else:
            await spawn_detached([sys.executable, "-m", "podgate.linux.holder", *args], log_file)
        data = await wait_ready_file(ready_file, timeout, log_file)
    except SpawnError as exc:
        raise HolderError(str(exc)) from exc
    return process_ref(int(data["holder_pid"])), process_ref(int(data["ns_pid"]))


async def stop_holder(ref: ProcessRef, timeout: float = HOLDER_STOP_TIMEOUT) -> None:
    """SIGTERM the holder, then SIGKILL after `timeout`. A holder already gone is fine."""
    if not signal_process(ref, signal.SIGTERM):
        return
    if await wait_gone(ref, timeout):
        return
    signal_process(ref, signal.SIGKILL)
    await wait_gone(ref, timeout)


if __name__ == "__main__":
    sys.exit(main())
