"""New network, UTS, IPC and PID namespaces held by one small process, the namespaces' PID 1.

A PID namespace that containers share needs a PID 1 for as long as they may join it (once its
PID 1 is gone the kernel lets no process in), so it cannot be pinned by a bind mount as the
other namespaces can (podgate.linux.nspin). That PID 1 does not have to be an interpreter:
`start` forks a child that unshares the namespaces, sets the hostname and brings `lo` up, then
forks PID 1 and exits. PID 1 ignores SIGCHLD, so the kernel reaps the orphans it inherits, and
execs podgate.linux.pause's program from a memfd, in a mount namespace of its own whose root is
an empty tmpfs: the pod's processes see it as /proc/1, and its root must not be the node's. An
ignored signal stays ignored across exec. It costs 16 KiB PSS (`sleep` in the node's root, the
fallback on machines without the program, ~0.2 MiB; an interpreter ~5.5 MiB).

PID 1 is in a new session, no child of the caller, and outlives it. The kernel drops signals
without a handler sent to a namespace's PID 1, from outside too, SIGKILL excepted: SIGKILL
stops it, and every process of the namespace with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from typing import Final

from podgate.linux import ns, pause
from podgate.linux.proc import process_ref
from podgate.model import ProcessRef

__all__ = ["PidOneError", "start"]

_FLAGS: Final = ns.CLONE_NEWNET | ns.CLONE_NEWUTS | ns.CLONE_NEWIPC | ns.CLONE_NEWPID
# `sleep infinity` is GNU's; every sleep takes a count of seconds (about 68 years here).
_SLEEP_SECONDS: Final = str(2**31 - 1)
_MAX_REPORT: Final = 4096


class PidOneError(OSError):
    """The namespaces or their PID 1 could not be made; the message says why."""


def _sleep_binary() -> str:
    found = shutil.which("sleep", path=os.defpath + ":/usr/local/bin")
    if found is None:
        raise PidOneError("no sleep binary on the node")
    return found


def _pid_one(report: int, sleep: str, empty_root: str) -> None:
    """PID 1: reaped orphans, default signals, no descriptors of ours; exec the pause program
    from a memfd in an empty root of its own (`sleep` in the node's root where this machine has
    no pause program or no empty root was asked for)."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores the first two; exec keeps that
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        program = pause.pause_elf() if empty_root else None
        keep = report
        if program is not None:
            keep = os.memfd_create("pause", os.MFD_CLOEXEC)
            os.write(keep, program)
            # The pod's processes see this one as /proc/1: nothing of the node behind its root.
            ns.unshare(ns.CLONE_NEWNS)
            ns.make_mounts_private()
            ns.enter_empty_root(empty_root)
        low, high = sorted((report, keep))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
        if program is not None:
            os.execve(keep, ["pause"], {})  # the report pipe closes on exec: success
        os.execv(sleep, [sleep, _SLEEP_SECONDS])
    except BaseException as exc:
        os.write(report, f"error: PID 1 did not start: {exc}".encode()[:_MAX_REPORT])
    os._exit(127)


def _setup_child(report: int, hostname: str, sleep: str, empty_root: str) -> int:
    """The first child: new namespaces, set up; fork PID 1, report its pid, exit."""
    try:
        os.setsid()
        ns.unshare(_FLAGS)
        if hostname:
            socket.sethostname(hostname)
        ns.set_link_up("lo")
        pid = os.fork()
        if pid == 0:
            _pid_one(report, sleep, empty_root)
        os.write(report, b"pid %d" % pid)
        return 0
    except BaseException as exc:
        os.write(report, f"error: {exc}".encode()[:_MAX_REPORT])
        return 1


def start(hostname: str = "", empty_root: str = "") -> ProcessRef:
    """Make the namespaces and their PID 1; its ref once it runs (the namespace files are
    /proc/PID/ns/*). With `empty_root` (a directory) PID 1 is podgate.linux.pause's program
    with a tmpfs on that directory as its root, in a mount namespace of its own; without it, or
    on a machine without that program, `sleep` in the node's root. Raises PidOneError with what
    failed; nothing is left running then.

    Blocking for the milliseconds of two forks and an exec. The caller's threads are not
    copied, so it may run an event loop.
    """
    sleep = "" if empty_root and pause.pause_elf() else _sleep_binary()
    read_end, report = os.pipe2(os.O_CLOEXEC)
    try:
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            os.close(read_end)
            os._exit(_setup_child(report, hostname, sleep, empty_root))
        os.close(report)
        report = -1
        os.waitpid(child, 0)
        # EOF once PID 1 has exec'd (or died): the first child's copy closed on its exit.
        text = b""
        while chunk := os.read(read_end, _MAX_REPORT):
            text += chunk
    finally:
        os.close(read_end)
        if report >= 0:
            os.close(report)
    words = text.decode(errors="replace").split("error: ", 1)
    pid = int(words[0].split()[1]) if words[0].startswith("pid ") else 0
    if len(words) > 1:
        if pid:
            os.kill(pid, signal.SIGKILL)
        raise PidOneError(words[1] or "failed")
    if not pid:
        raise PidOneError(f"no report from the namespaces' first process: {text!r}")
    try:
        return process_ref(pid)
    except ProcessLookupError:
        raise PidOneError(f"PID 1 ({pid}) exited at once") from None
