"""The container shim, one per container (conmon's job): run as `python -m podgate.linux.shim`.

`python -m podgate.linux.shim --spec FILE` daemonizes, creates the attach socket, starts the
container process in the pod's namespaces, writes the ready file, then relays the container's
output into the CRI log file and to every attached client until the container exits. It then
writes the exit file, sends EXIT to the clients, removes the socket and exits.

The shim runs in the host's namespaces. Only the PID namespace is changed in the shim itself,
since that applies to children; the child joins the pod's net, uts and ipc namespaces, makes a
private mount namespace and (optionally) chroots before exec.

The runtime signals the container process directly by its host pid from the ready file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import termios
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from podgate.aio.errors import map_os_errors
from podgate.files import atomic_write_sole
from podgate.linux import ns
from podgate.linux.proc import (
    Spawn,
    SpawnError,
    atomic_write_json,
    process_ref,
    read_json,
    spawn_detached,
    wait_ready_file,
)
from podgate.model import NamespaceMode, ProcessRef
from podgate.oci import cgroups
from podgate.oci.runc import Runc, RuncError
from podgate.proto.attach import (
    AttachCodec,
    AttachProtocolError,
    Event,
    Exit,
    Resize,
    Role,
    Stderr,
    Stdin,
    StdinClose,
    Stdout,
)

if TYPE_CHECKING:  # the client side's; a shim runs no event loop (imported where used)
    import asyncio

__all__ = [
    "DEFAULT_PATH",
    "MAX_LOG_LINE",
    "SHIM_START_TIMEOUT",
    "AttachConnection",
    "AttachStdin",
    "CriLogWriter",
    "ShimError",
    "ShimExit",
    "ShimReady",
    "ShimSpec",
    "attach",
    "main",
    "read_exit_file",
    "rfc3339nano",
    "start_shim",
    "warm",
]

# containerd's default max_container_log_line_size, bytes: longer lines become P entries.
MAX_LOG_LINE: Final = 16 * 1024
# How long a shim may take to start the container and write its ready file, seconds.
SHIM_START_TIMEOUT: Final = 10.0
# How long output may keep flowing after the container exited (grandchildren holding the
# pipe), seconds.
OUTPUT_DRAIN_SECONDS: Final = 2.0
# How long closing attached clients may take once the container exited, seconds.
CLIENT_CLOSE_SECONDS: Final = 2.0
# Bytes queued for one attached client before it is dropped: a stalled client must not grow
# the shim without bound (the log file still gets everything).
CLIENT_OUTPUT_LIMIT: Final = 8 * 1024 * 1024
# Bytes of client input queued for the container's stdin before clients wait.
STDIN_HIGH_WATER: Final = 1024 * 1024
# One read from a container pipe or pty, bytes.
READ_BYTES: Final = 64 * 1024
# PATH a container gets when its env has none (containerd's default).
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Unix socket paths are limited by sockaddr_un.sun_path, bytes including the NUL.
_MAX_SOCKET_PATH: Final = 107
_USAGE: Final = "usage: python -m podgate.linux.shim --spec FILE [--foreground]"
# Exit status of the child when it could not exec (as shells report it).
_EXEC_FAILED: Final = 127
_NS_KINDS: Final = (("net", ns.CLONE_NEWNET), ("uts", ns.CLONE_NEWUTS), ("ipc", ns.CLONE_NEWIPC))


# -- the spec and what the shim reports


@dataclass(slots=True)
class ShimSpec:
    """What one shim runs. `ns_paths` are the pod's namespace files ("net", "uts", "ipc", and
    "pid" when shared); `ns_pid`, the pod's namespace process, stands for them when they are
    not given (neither: the host's)."""

    container_id: str
    command: list[str]
    exit_file: str
    attach_socket: str
    ready_file: str
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str = ""
    root_dir: str = ""
    uid: int | None = None
    gid: int | None = None
    tty: bool = False
    stdin: bool = False
    stdin_once: bool = False
    ns_pid: int | None = None
    ns_paths: dict[str, str] = field(default_factory=dict)
    pid_mode: NamespaceMode = NamespaceMode.CONTAINER
    log_file: str = ""  # CRI log file; "" = no log
    shim_log: str = ""  # the shim's own stderr; "" = `<ready_file>.log`
    # Bind mounts {"host_path", "container_path", "readonly"} (CRI Mount and NRI adjustments).
    mounts: list[dict[str, Any]] = field(default_factory=list)
    # Run through an OCI runtime: {"binary", "root", "log", "bundle", "cgroup"} (empty: the
    # shim forks and execs the command itself, on the node's filesystem).
    oci: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "container_id": self.container_id,
            "command": list(self.command),
            "exit_file": self.exit_file,
            "attach_socket": self.attach_socket,
            "ready_file": self.ready_file,
            "env": dict(self.env),
            "working_dir": self.working_dir,
            "root_dir": self.root_dir,
            "uid": self.uid,
            "gid": self.gid,
            "tty": self.tty,
            "stdin": self.stdin,
            "stdin_once": self.stdin_once,
            "ns_pid": self.ns_pid,
            "ns_paths": dict(self.ns_paths),
            "pid_mode": int(self.pid_mode),
            "log_file": self.log_file,
            "shim_log": self.shim_log,
            "mounts": [dict(m) for m in self.mounts],
            "oci": dict(self.oci),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShimSpec:
        values = dict(data)
        values["pid_mode"] = NamespaceMode(values.get("pid_mode", NamespaceMode.CONTAINER))
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ShimReady:
    shim: ProcessRef
    process: ProcessRef  # the container's main process, host pid
    started_at: int  # ns since the epoch


@dataclass(frozen=True, slots=True)
class ShimExit:
    exit_code: int
    finished_at: int  # ns since the epoch
    reason: str


def read_exit_file(path: str) -> ShimExit | None:
    """The container's exit record, or None while the shim has not written it."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    return ShimExit(int(data["exit_code"]), int(data["finished_at"]), str(data["reason"]))


# -- CRI log format


def rfc3339nano(ns_since_epoch: int) -> str:
    """Go's `time.RFC3339Nano` in UTC: trailing zeros of the fraction are dropped."""
    seconds, fraction = divmod(ns_since_epoch, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if fraction:
        text += "." + f"{fraction:09d}".rstrip("0")
    return text + "Z"


class CriLogWriter:
    """Turns output chunks into CRI log entries: `<time> <stream> <F|P> <line>\\n`.

    Like containerd: a line ends at "\\n" (a "\\r" before it is dropped); a line longer than
    `max_line` is cut into P entries; what is left at EOF without a newline is a P entry.
    """

    def __init__(self, write: Callable[[bytes], None], max_line: int = MAX_LOG_LINE) -> None:
        self._write = write
        self._max_line = max_line
        self._pending: dict[str, bytearray] = {}

    def feed(self, stream: str, data: bytes, now_ns: int) -> None:
        buf = self._pending.setdefault(stream, bytearray())
        buf += data
        while True:
            newline = buf.find(b"\n")
            if newline < 0:
                break
            line = bytes(buf[:newline])
            del buf[: newline + 1]
            if line.endswith(b"\r"):
                line = line[:-1]
            while len(line) > self._max_line:
                self._entry(stream, b"P", line[: self._max_line], now_ns)
                line = line[self._max_line :]
            self._entry(stream, b"F", line, now_ns)
        while len(buf) > self._max_line:
            self._entry(stream, b"P", bytes(buf[: self._max_line]), now_ns)
            del buf[: self._max_line]

    def finish(self, stream: str, now_ns: int) -> None:
        """The stream ended: whatever is left without a newline is one P entry."""
        buf = self._pending.pop(stream, None)
        if buf:
            self._entry(stream, b"P", bytes(buf), now_ns)

    def _entry(self, stream: str, tag: bytes, line: bytes, now_ns: int) -> None:
        head = f"{rfc3339nano(now_ns)} {stream} ".encode("ascii")
        self._write(head + tag + b" " + line + b"\n")


class ShimError(SpawnError):
    """The shim could not start the container; the message says why (runc-like wording)."""


# -- starting the container (synchronous, before the loop runs)


class _StartError(Exception):
    """The container could not be started; the message goes to the ready file."""


def _go_strerror(err: int) -> str:
    text = os.strerror(err)
    return text[:1].lower() + text[1:]


def _exec_error(arg0: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        if "/" not in arg0:
            return f'exec: "{arg0}": executable file not found in $PATH'
        return f'exec: "{arg0}": stat {arg0}: no such file or directory'
    return f'exec: "{arg0}": {_go_strerror(exc.errno or errno.EINVAL)}'


@dataclass(slots=True)
class _Stdio:
    """The shim's ends of the container's stdio, and the fds the child dups to 0, 1, 2."""

    child: tuple[int, int, int]
    to_close_after_fork: list[int]
    stdin: int | None  # write end (a dup of the pty master in tty mode)
    outputs: dict[str, int]  # "stdout"/"stderr" -> read end
    master: int | None = None  # pty master, for resizes


def _open_stdio(spec: ShimSpec) -> _Stdio:
    if spec.tty:
        master, slave = os.openpty()  # both non-inheritable until dup2'ed in the child
        stdin = os.dup(master) if spec.stdin else None
        return _Stdio((slave, slave, slave), [slave], stdin, {"stdout": master}, master)
    if spec.stdin:
        in_r, in_w = os.pipe()
    else:
        in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return _Stdio(
        (in_r, out_w, err_w),
        [in_r, out_w, err_w],
        in_w if in_w >= 0 else None,
        {"stdout": out_r, "stderr": err_r},
    )


def _open_namespaces(spec: ShimSpec) -> list[tuple[int, int]]:
    """Join the pod's PID namespace (for our children) and open the others for the child."""
    if spec.pid_mode is NamespaceMode.TARGET:
        raise _StartError("pid namespace mode TARGET is not supported")
    paths = dict(spec.ns_paths)
    if not paths and spec.ns_pid is not None:
        paths = {kind: ns.ns_path(spec.ns_pid, kind) for kind in ("net", "uts", "ipc", "pid")}
    if spec.pid_mode is NamespaceMode.POD and "pid" not in paths:
        raise _StartError("pid namespace mode POD needs the pod's PID namespace")
    fds: list[tuple[int, int]] = []
    try:
        for kind, nstype in _NS_KINDS:
            if kind in paths:
                fds.append((os.open(paths[kind], os.O_RDONLY | os.O_CLOEXEC), nstype))
        if spec.pid_mode is NamespaceMode.POD:
            pid_fd = os.open(paths["pid"], os.O_RDONLY | os.O_CLOEXEC)
            try:
                ns.setns(pid_fd, ns.CLONE_NEWPID)
            finally:
                os.close(pid_fd)
        elif spec.pid_mode is NamespaceMode.CONTAINER:
            ns.unshare(ns.CLONE_NEWPID)
    except OSError as exc:
        for fd, _ in fds:
            os.close(fd)
        raise _StartError(f"joining the pod's namespaces failed: {exc}") from exc
    return fds


def _bind_mount(root_dir: str, bind: dict[str, Any]) -> None:
    """One bind mount in the container's mount namespace. Under a root directory a missing
    destination is created (like containerd in a rootfs); on the host's filesystem it must
    exist, so a container never adds paths to the host."""
    source, target = str(bind["host_path"]), str(bind["container_path"])
    if not os.path.isabs(target):
        raise OSError(errno.EINVAL, f"mount destination {target!r} is not absolute")
    if root_dir:
        target = os.path.join(root_dir, target.lstrip("/"))
        if not os.path.lexists(target):
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
    ns.mount(source, target, None, ns.MS_BIND | ns.MS_REC)
    if bind.get("readonly"):
        ns.mount(None, target, None, ns.MS_BIND | ns.MS_REMOUNT | ns.MS_RDONLY | ns.MS_REC)


def _child(spec: ShimSpec, stdio: _Stdio, ns_fds: list[tuple[int, int]], report: int) -> None:
    """Runs in the forked child; never returns. Failures are written to `report`."""
    step = "setsid"
    try:
        os.setsid()
        if spec.tty:
            step = "set controlling terminal"
            fcntl.ioctl(stdio.child[0], termios.TIOCSCTTY, 0)
        step = "set up stdio"
        for target, fd in enumerate(stdio.child):
            os.dup2(fd, target)
        for fd, nstype in ns_fds:
            step = "join pod namespace"
            ns.setns(fd, nstype)
        step = "create mount namespace"
        ns.unshare(ns.CLONE_NEWNS)
        ns.make_mounts_private()
        ns.drop_namespace_mounts()
        for bind in spec.mounts:
            step = f"mount {bind.get('host_path')!r} on {bind.get('container_path')!r}"
            _bind_mount(spec.root_dir, bind)
        if spec.root_dir:
            step = f"chroot to {spec.root_dir!r}"
            os.chroot(spec.root_dir)
            os.chdir("/")
            if spec.pid_mode is not NamespaceMode.NODE and os.path.isdir("/proc"):
                step = "mount /proc"
                ns.mount("proc", "/proc", "proc", ns.MS_NOSUID | ns.MS_NODEV | ns.MS_NOEXEC)
        env = dict(spec.env)
        env.setdefault("PATH", DEFAULT_PATH)
        env.setdefault("HOSTNAME", socket.gethostname())
        cwd = spec.working_dir or "/"
        step = f'chdir to cwd ("{cwd}")'
        os.chdir(cwd)
        if spec.uid is not None or spec.gid is not None:
            step = "set user"
            os.setgroups([])
            if spec.gid is not None:
                os.setgid(spec.gid)
            if spec.uid is not None:
                os.setuid(spec.uid)
        step = "reset signals"
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.closerange(3, report)
        os.closerange(report + 1, os.sysconf("SC_OPEN_MAX"))
        step = "exec"
        try:
            os.execvpe(spec.command[0], spec.command, env)
        except OSError as exc:
            message = _exec_error(spec.command[0], exc)
    except OSError as exc:
        message = f"{step} failed: {_go_strerror(exc.errno or errno.EINVAL)}"
    except BaseException as exc:
        message = f"{step} failed: {exc}"
    try:
        os.write(report, message.encode("utf-8", "replace"))
    finally:
        os._exit(_EXEC_FAILED)


def _start_container(spec: ShimSpec) -> tuple[int, _Stdio]:
    """Fork and exec the container process; (host pid, the shim's stdio ends)."""
    if not spec.command:
        raise _StartError("no command specified")
    ns_fds = _open_namespaces(spec)
    stdio = _open_stdio(spec)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
        if pid == 0:
            _child(spec, stdio, ns_fds, report_w)
    finally:
        os.close(report_w)
        for fd in stdio.to_close_after_fork:
            os.close(fd)
        for fd, _ in ns_fds:
            os.close(fd)
    chunks = []
    while chunk := os.read(report_r, 4096):
        chunks.append(chunk)
    os.close(report_r)
    if chunks:
        os.waitpid(pid, 0)
        raise _StartError(b"".join(chunks).decode("utf-8", "replace"))
    return pid, stdio


_PR_SET_CHILD_SUBREAPER: Final = 36
# runc sends the pty master over the console socket with SCM_RIGHTS: one fd, a short name.
_CONSOLE_MSG_BYTES: Final = 4096


# libc, opened once: in the forker, so a forked shim shares it.
_LIBC: Final = ctypes.CDLL(None, use_errno=True)


def _set_subreaper() -> None:
    if _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"PR_SET_CHILD_SUBREAPER: {os.strerror(err)}")


def _runc(spec: ShimSpec) -> Runc:
    return Runc(spec.oci["binary"], spec.oci["root"], spec.oci["log"])


def _receive_console(listener: socket.socket) -> int:
    conn, _ = listener.accept()
    with conn:
        fds: list[int] = []
        _, fds, _, _ = socket.recv_fds(conn, _CONSOLE_MSG_BYTES, 1)
    if not fds:
        raise _StartError("the OCI runtime sent no console")
    os.set_inheritable(fds[0], False)
    return fds[0]


def _start_oci(spec: ShimSpec) -> tuple[int, _Stdio]:
    """`runc create` with our pipes as the container's stdio (or a console socket for a tty),
    `runc start`; the container's init is re-parented to us (a subreaper) once create exits.
    Returns (init's host pid, our stdio ends)."""
    runc = _runc(spec)
    bundle = spec.oci["bundle"]
    pid_file = os.path.join(bundle, "init.pid")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pid_file)
    _set_subreaper()
    console: socket.socket | None = None
    console_path = ""
    try:
        if spec.tty:
            console_path = os.path.join(os.path.dirname(spec.attach_socket), "console.sock")
            console = _listen(console_path)
            stdio_fds: tuple[int, int, int] | None = None
        else:
            stdio = _open_stdio(spec)
            stdio_fds = stdio.child
        try:
            if stdio_fds is None:
                runc.run_sync(
                    runc.create_args(spec.container_id, bundle, pid_file, console_path),
                    stderr=sys.stderr.fileno(),
                )
            else:
                runc.run_sync(
                    runc.create_args(spec.container_id, bundle, pid_file),
                    stdin=stdio_fds[0],
                    stdout=stdio_fds[1],
                    stderr=stdio_fds[2],
                )
        finally:
            if stdio_fds is not None:
                for fd in stdio.to_close_after_fork:
                    os.close(fd)
        if console is not None:
            master = _receive_console(console)
            stdin = os.dup(master) if spec.stdin else None
            stdio = _Stdio((-1, -1, -1), [], stdin, {"stdout": master}, master)
        runc.run_sync(["start", spec.container_id], stderr=sys.stderr.fileno())
        with open(pid_file, "rb") as f:  # bytes: no codec module for a forked shim to import
            pid = int(f.read().strip())
    except RuncError as exc:
        with contextlib.suppress(RuncError):
            runc.run_sync(["delete", "--force", spec.container_id])
        raise _StartError(str(exc)) from exc
    finally:
        if console is not None:
            console.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(console_path)
    return pid, stdio


def _finish_oci(spec: ShimSpec) -> bool:
    """After the init exited: whether the OOM killer struck, then `runc delete --force`
    (kills what is left in the container's cgroup and removes it)."""
    oom = cgroups.oom_kills(spec.oci.get("cgroup", "")) > 0 if spec.oci.get("cgroup") else False
    try:
        _runc(spec).run_sync(["delete", "--force", spec.container_id])
    except RuncError as exc:
        print(f"shim: runc delete failed: {exc}", file=sys.stderr)
    return oom


def _listen(path: str) -> socket.socket:
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise _StartError(f"attach socket path too long: {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # born 0600: no window where others may connect
    try:
        sock.bind(path)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen()
    return sock


# -- the running shim
#
# One poll loop, no asyncio: an event loop's objects and the code it runs cost every shim
# about 1 MiB of pages it would otherwise share with the forker (see bench/README.md).

_IN: Final = select.POLLIN
_OUT: Final = select.POLLOUT
_HANGUP: Final = select.POLLHUP | select.POLLERR | select.POLLNVAL


class _Client:
    """One attached client: its socket, codec and the output it has not taken yet."""

    __slots__ = ("codec", "out", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.codec = AttachCodec(Role.SHIM)
        self.out = bytearray()


class _Shim:
    def __init__(
        self,
        spec: ShimSpec,
        pid: int,
        stdio: _Stdio,
        listener: socket.socket,
        log: BinaryIO | None,
    ) -> None:
        self.spec = spec
        self.pid = pid
        self.stdio = stdio
        self.listener: socket.socket | None = listener
        self.log = log
        self.poll = select.poll()
        self.clients: dict[int, _Client] = {}  # by fd
        self.outputs = {fd: stream for stream, fd in stdio.outputs.items()}
        self.stdin = stdio.stdin
        self.stdin_buffer = bytearray()
        self.stdin_closing = False
        self.cri = CriLogWriter(self._write_log)
        self.reopen = False
        self.wakeup = -1

    # -- the log

    def _reopen_log(self) -> None:
        """The kubelet's rotation renamed the log: continue in a new file at its path."""
        if not self.spec.log_file:
            return
        try:
            new = open(self.spec.log_file, "ab", buffering=0)  # noqa: SIM115 - kept open
        except OSError as exc:
            print(f"shim: reopening the log failed: {exc}", file=sys.stderr)
            return
        old, self.log = self.log, new
        if old is not None:
            old.close()

    def _write_log(self, entry: bytes) -> None:
        if self.log is None:
            return
        try:
            self.log.write(entry)
        except OSError as exc:  # keep draining the container even if the disk is full
            print(f"shim: log write failed: {exc}", file=sys.stderr)

    def _flush_log(self) -> None:
        if self.log is not None:
            try:
                self.log.flush()
                os.fsync(self.log.fileno())
            except OSError as exc:
                print(f"shim: log flush failed: {exc}", file=sys.stderr)

    def _on_sigusr1(self, signum: int, frame: object) -> None:
        self.reopen = True  # handled by the loop, never in the middle of a log write

    # -- the loop

    def run(self) -> int:
        wake_r, self.wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        pidfd = os.pidfd_open(self.pid)
        try:
            for fd in self.outputs:
                os.set_blocking(fd, False)
                self.poll.register(fd, _IN)
            if self.stdin is not None:
                os.set_blocking(self.stdin, False)
            assert self.listener is not None
            self.listener.setblocking(False)
            self.poll.register(self.listener, _IN)
            self.poll.register(pidfd, _IN)
            self.poll.register(wake_r, _IN)
            signal.set_wakeup_fd(self.wakeup, warn_on_full_buffer=False)
            signal.signal(signal.SIGUSR1, self._on_sigusr1)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
            exited = False
            while not exited:
                exited = self._step(pidfd, wake_r, None)
            self.poll.unregister(pidfd)
            exit_code = _reap(self.pid)
            reason = "Completed" if exit_code == 0 else "Error"
            if self.spec.oci and _finish_oci(self.spec):
                reason = "OOMKilled"
            self._drain_output(wake_r)
            self._flush_log()
            _publish_json(
                self.spec.exit_file,
                {"exit_code": exit_code, "finished_at": time.time_ns(), "reason": reason},
            )
            self._close_listener()
            self._close_clients(exit_code, wake_r)
        finally:
            os.close(pidfd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spec.attach_socket)
            self._close_stdin()
            if self.stdio.master is not None:
                os.close(self.stdio.master)
        return 0

    def _step(self, pidfd: int, wake_r: int, deadline: float | None) -> bool:
        """One wait and what it brought; True once the container exited."""
        timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        exited = False
        for fd, mask in self.poll.poll(timeout):
            if fd == pidfd:
                exited = True
            elif fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 64)
            elif fd in self.outputs:
                self._on_output(fd)
            elif fd == self.stdin:
                self._flush_stdin()
            elif self.listener is not None and fd == self.listener.fileno():
                self._accept()
            elif fd in self.clients:
                self._on_client(self.clients[fd], mask)
        if self.reopen:
            self.reopen = False
            self._reopen_log()
        return exited

    def _drain_output(self, wake_r: int) -> None:
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        while self.outputs and time.monotonic() < deadline:
            self._step(-1, wake_r, deadline)
        # Something else in the container still holds the pipe: stop listening.
        for fd in list(self.outputs):
            self._end_output(fd)

    # -- the container's output

    def _on_output(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:  # EIO from a pty master once the last slave fd is closed
            data = b""
        if not data:
            self._end_output(fd)
            return
        stream = self.outputs[fd]
        self.cri.feed(stream, data, time.time_ns())
        event: Event = Stderr(data) if stream == "stderr" else Stdout(data)
        for client in list(self.clients.values()):
            self._send(client, client.codec.send(event))
            if len(client.out) > CLIENT_OUTPUT_LIMIT:
                print("shim: dropping an attached client that stopped reading", file=sys.stderr)
                self._drop(client)

    def _end_output(self, fd: int) -> None:
        stream = self.outputs.pop(fd)
        self.poll.unregister(fd)
        if fd != self.stdio.master:
            os.close(fd)
        self.cri.finish(stream, time.time_ns())

    # -- the container's stdin

    def _write_stdin(self, data: bytes) -> None:
        if self.stdin is None or self.stdin_closing:
            return
        self.stdin_buffer += data
        self._flush_stdin()

    def _flush_stdin(self) -> None:
        if self.stdin is None:
            return
        try:
            written = os.write(self.stdin, self.stdin_buffer) if self.stdin_buffer else 0
        except BlockingIOError:
            written = 0
        except OSError:  # EPIPE/EIO: the container stopped reading; drop its input
            self.stdin_buffer.clear()
            self._close_stdin()
            return
        del self.stdin_buffer[:written]
        if not self.stdin_buffer and self.stdin_closing:
            self._close_stdin()
            return
        self._set_mask(self.stdin, _OUT if self.stdin_buffer else 0)
        # Clients wait (are not read) while the container has a full buffer of their input.
        paused = len(self.stdin_buffer) > STDIN_HIGH_WATER
        for client in self.clients.values():
            self._client_mask(client, paused)

    def _end_stdin(self) -> None:
        self.stdin_closing = True
        if not self.stdin_buffer:
            self._close_stdin()

    def _close_stdin(self) -> None:
        fd, self.stdin = self.stdin, None
        if fd is None:
            return
        self.stdin_buffer.clear()
        self._set_mask(fd, 0)
        os.close(fd)
        for client in self.clients.values():
            self._client_mask(client, False)

    # -- attached clients

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        sock.setblocking(False)
        client = _Client(sock)
        self.clients[sock.fileno()] = client
        self._client_mask(client, len(self.stdin_buffer) > STDIN_HIGH_WATER)

    def _on_client(self, client: _Client, mask: int) -> None:
        if mask & _OUT:
            self._send(client, b"")
        if mask & (_IN | _HANGUP) and client.sock.fileno() in self.clients:
            self._read_client(client)

    def _read_client(self, client: _Client) -> None:
        try:
            try:
                data = client.sock.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                client.codec.receive_eof()
                self._detach(client)
                return
            for event in client.codec.receive_data(data):
                if not self._handle(event):
                    self._detach(client)
                    return
        except AttachProtocolError as exc:
            print(f"shim: dropping attach client: {exc}", file=sys.stderr)
            self._drop(client)
        except ConnectionError:
            self._drop(client)

    def _handle(self, event: Event) -> bool:
        """Apply one client event; False when that client detaches."""
        if isinstance(event, Stdin):
            self._write_stdin(event.data)
        elif isinstance(event, StdinClose):
            # containerd: with stdinOnce (and no tty) the container's stdin closes and the
            # client keeps its output; otherwise the client's session just ends.
            if not (self.spec.stdin_once and not self.spec.tty):
                return False
            self._end_stdin()
        elif isinstance(event, Resize) and self.stdio.master is not None:
            winsize = struct.pack("HHHH", event.height, event.width, 0, 0)
            with contextlib.suppress(OSError):
                fcntl.ioctl(self.stdio.master, termios.TIOCSWINSZ, winsize)
        return True

    def _send(self, client: _Client, data: bytes) -> None:
        """Queue `data` for the client and write what its socket takes now."""
        client.out += data
        if client.out:
            try:
                sent = client.sock.send(client.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(client)
                return
            del client.out[:sent]
        self._client_mask(client, len(self.stdin_buffer) > STDIN_HIGH_WATER)

    def _client_mask(self, client: _Client, paused: bool) -> None:
        fd = client.sock.fileno()
        if fd in self.clients:
            self._set_mask(fd, (0 if paused else _IN) | (_OUT if client.out else 0))

    def _set_mask(self, fd: int, mask: int) -> None:
        if mask:
            self.poll.register(fd, mask)  # registers or modifies
        else:
            with contextlib.suppress(KeyError):
                self.poll.unregister(fd)

    def _detach(self, client: _Client) -> None:
        """The client's session ended: what it was owed is sent as far as it goes, then it
        is closed."""
        if client.out:
            with contextlib.suppress(OSError):
                client.sock.send(client.out)
        self._drop(client)

    def _drop(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if self.clients.pop(fd, None) is not None:
            self._set_mask(fd, 0)
            client.sock.close()

    def _close_listener(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            self._set_mask(listener.fileno(), 0)
            listener.close()

    def _close_clients(self, exit_code: int, wake_r: int) -> None:
        """Send EXIT to every client, give them CLIENT_CLOSE_SECONDS to take what they are
        owed, then close them."""
        self._close_stdin()
        for client in list(self.clients.values()):
            self._send(client, client.codec.send(Exit(exit_code)))
        deadline = time.monotonic() + CLIENT_CLOSE_SECONDS
        while any(c.out for c in self.clients.values()) and time.monotonic() < deadline:
            self._step(-1, wake_r, deadline)
        for client in list(self.clients.values()):
            self._drop(client)


# Calls before a function's code is quickened (CPython 3.11 specializes a code object after a
# few calls and then stops writing to it on every call).
_WARM_ROUNDS: Final = 10


def warm(directory: str) -> None:
    """Run the steps of a shim's life that need no container, in `directory` (left empty).

    A forker calls this before it forks shims: the code they run is then already quickened
    and what it creates lazily (caches, name generators) exists, so a forked shim writes fewer
    of the pages it shares with the forker and the other shims.
    """
    for _ in range(_WARM_ROUNDS):
        _warm_round(directory)
        _trim_heap()


def _warm_round(directory: str) -> None:
    spec = ShimSpec(
        container_id="warm",
        command=["true"],
        exit_file=os.path.join(directory, "exit"),
        attach_socket=os.path.join(directory, "attach.sock"),
        ready_file=os.path.join(directory, "ready"),
    )
    spec_file = os.path.join(directory, "spec")
    atomic_write_json(spec_file, spec.to_json())
    spec = ShimSpec.from_json(read_json(spec_file))
    _parse_args(["--spec", spec_file, "--foreground"])
    me = process_ref(os.getpid())
    # The OCI path short of running the runtime: a subreaper flag of 0 changes nothing.
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    runc = Runc(os.devnull, directory, os.path.join(directory, "runc.log"))
    runc.argv(*runc.create_args(spec.container_id, directory, os.path.join(directory, "pid")))
    runc.error_since(0)
    _publish_json(spec.ready_file, {"shim_pid": me.pid, "started_at": time.time_ns()})
    listener = _listen(spec.attach_socket)
    stdio = _open_stdio(spec)
    for fd in stdio.to_close_after_fork:
        os.close(fd)
    shim = _Shim(spec, os.getpid(), stdio, listener, None)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(spec.attach_socket)
        shim._accept()
        codec = AttachCodec(Role.CLIENT)
        client.sendall(codec.send(Resize(80, 24)) + codec.send(Stdin(b"x")))
        fd = stdio.outputs["stdout"]
        os.set_blocking(fd, False)
        shim.poll.register(fd, _IN)
        for attached in list(shim.clients.values()):
            shim._read_client(attached)
            shim._on_output(fd)  # nothing to read yet
            shim.cri.feed("stdout", b"warm\n", time.time_ns())
            shim._send(attached, attached.codec.send(Stdout(b"warm\n")))
            shim._send(attached, attached.codec.send(Exit(0)))
            codec.receive_data(client.recv(READ_BYTES))
            shim._drop(attached)
        for out in list(shim.outputs):
            shim.poll.register(out, _IN)
            shim._end_output(out)
        shim._close_listener()
    finally:
        client.close()
        for path in (spec_file, spec.ready_file, spec.attach_socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _trim_heap() -> None:
    """Give back the free pages of the C heap that starting the container left."""
    with contextlib.suppress(AttributeError):  # not glibc
        _LIBC.malloc_trim(0)


def _publish_json(path: str, obj: dict[str, Any]) -> None:
    """Replace `path` with `obj` as JSON, atomically and durably (only this shim writes its
    ready and exit files)."""
    atomic_write_sole(path, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def _reap(pid: int) -> int:
    """Exit code of an exited child (its pidfd turned readable), 128+N for signal N."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _daemonize() -> None:
    if os.fork() != 0:
        os._exit(0)


def _parse_args(argv: Sequence[str]) -> tuple[str, bool]:
    """(spec file, foreground) of `--spec FILE [--foreground]`. Not argparse: a parser's
    objects would cost each forked shim about 1 MiB of pages it now shares with the forker."""
    spec_file, foreground, rest = "", False, list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--foreground":
            foreground = True
        elif arg == "--spec" and rest:
            spec_file = rest.pop(0)
        elif arg.startswith("--spec="):
            spec_file = arg.removeprefix("--spec=")
        else:
            raise ValueError(f"unexpected argument {arg!r}")
    if not spec_file:
        raise ValueError("--spec FILE is required")
    return spec_file, foreground


def main(argv: Sequence[str] | None = None) -> int:
    try:
        spec_file, foreground = _parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"{_USAGE}\nerror: {exc}", file=sys.stderr)
        return 2
    spec = ShimSpec.from_json(read_json(spec_file))
    if not foreground:
        _daemonize()
    log: BinaryIO | None = None
    listener: socket.socket | None = None
    try:
        if spec.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(spec.log_file)), exist_ok=True)
            log = open(spec.log_file, "ab", buffering=0)  # noqa: SIM115 - lives until exit
        listener = _listen(spec.attach_socket)
        pid, stdio = _start_oci(spec) if spec.oci else _start_container(spec)
    except (_StartError, OSError) as exc:
        message = str(exc) if isinstance(exc, _StartError) else f"shim setup failed: {exc}"
        print(f"shim: {message}", file=sys.stderr)
        if listener is not None:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.attach_socket)
        _publish_json(spec.ready_file, {"error": message})
        return 1
    # SIGUSR1 (reopen the log) stays pending until the loop handles it; blocked only
    # now, so the container never inherits the mask. The runtime learns our pid below.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    shim = process_ref(os.getpid())
    container = process_ref(pid)
    _publish_json(
        spec.ready_file,
        {
            "shim_pid": shim.pid,
            "shim_start_time": shim.start_time,
            "container_pid": container.pid,
            "container_start_time": container.start_time,
            "started_at": time.time_ns(),
        },
    )
    running = _Shim(spec, pid, stdio, listener, log)
    _trim_heap()
    return running.run()


async def start_shim(
    spec: ShimSpec,
    *,
    spec_file: str | None = None,
    timeout: float = SHIM_START_TIMEOUT,
    spawn: Spawn | None = None,
) -> ShimReady:
    """Start a detached shim for `spec` and wait until its container runs.

    The spec is written to `spec_file` (default `<ready_file>.spec`), the shim's own stderr
    goes to `spec.shim_log` (default `<ready_file>.log`). Raises ShimError with the shim's
    message (e.g. the executable was not found) on failure. `spawn(module, args,
    log_file)` starts the shim another way (podgate.linux.forker) than a new interpreter.
    """
    spec_file = spec_file or f"{spec.ready_file}.spec"
    log_file = spec.shim_log or f"{spec.ready_file}.log"
    for stale in (spec.ready_file, spec.exit_file):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    atomic_write_json(spec_file, spec.to_json())
    try:
        if spawn is not None:
            await spawn("podgate.linux.shim", ["--spec", spec_file], log_file)
        else:
            await spawn_detached(
                [sys.executable, "-m", "podgate.linux.shim", "--spec", spec_file], log_file
            )
        data = await wait_ready_file(spec.ready_file, timeout, log_file)
    except SpawnError as exc:
        raise ShimError(str(exc)) from exc
    return ShimReady(
        shim=ProcessRef(int(data["shim_pid"]), int(data["shim_start_time"])),
        process=ProcessRef(int(data["container_pid"]), int(data["container_start_time"])),
        started_at=int(data["started_at"]),
    )


# -- the client side of the attach socket


class AttachStdin:
    """The container's stdin as seen by one attached client: send, then send_eof."""

    def __init__(self, conn: AttachConnection) -> None:
        self._conn = conn

    async def send(self, data: bytes) -> None:
        await self._conn.send(data)

    async def send_eof(self) -> None:
        await self._conn.close_stdin()


class AttachConnection:
    """One client connection to a shim's attach socket.

    Iterate it for Stdout/Stderr events; iteration ends when the container exited
    (`exit_code` is then set) or the shim closed the connection (`exit_code` stays None).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = AttachCodec(Role.CLIENT)
        self._events: list[Event] = []
        self.exit_code: int | None = None
        self.stdin = AttachStdin(self)

    async def _write(self, event: Event) -> None:
        self._writer.write(self._codec.send(event))
        await self._writer.drain()

    async def send(self, data: bytes) -> None:
        if data:
            await self._write(Stdin(bytes(data)))

    async def close_stdin(self) -> None:
        await self._write(StdinClose())

    async def resize(self, width: int, height: int) -> None:
        await self._write(Resize(width, height))

    async def receive(self) -> Stdout | Stderr | None:
        """The next output event; None at the end."""
        while not self._events:
            if self.exit_code is not None:
                return None
            data = await self._reader.read(READ_BYTES)
            if not data:
                self._codec.receive_eof()
                return None
            self._events = self._codec.receive_data(data)
        event = self._events.pop(0)
        if isinstance(event, Exit):
            self.exit_code = event.code
            return None
        assert isinstance(event, Stdout | Stderr)
        return event

    def __aiter__(self) -> AsyncIterator[Stdout | Stderr]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Stdout | Stderr]:
        while (event := await self.receive()) is not None:
            yield event

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AttachConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def attach(socket_path: str) -> AttachConnection:
    """Connect to a shim's attach socket (ConnectError if the shim is gone)."""
    import asyncio

    with map_os_errors():
        reader, writer = await asyncio.open_unix_connection(socket_path)
    return AttachConnection(reader, writer)


if __name__ == "__main__":
    sys.exit(main())
