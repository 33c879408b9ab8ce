"""Linux namespaces through libc: setns, unshare, mount, and sockets made inside a netns.

`setns` changes only the calling thread, and a socket keeps the network namespace it was
created in. So a dedicated worker thread enters the pod's netns, creates the socket, returns to
its own netns in `finally`, and hands the socket to the event loop, which connects it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from podgate.aio.errors import ConnectError

# asyncio and concurrent.futures are imported where used: the helper forker imports this
# module, and the shims and holders it forks run neither (see podgate.linux.forker).
if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

_T = TypeVar("_T")

__all__ = [
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUSER",
    "CLONE_NEWUTS",
    "IFF_UP",
    "MNT_DETACH",
    "MS_BIND",
    "MS_NODEV",
    "MS_NOEXEC",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_REC",
    "NamespaceError",
    "NamespaceRestoreError",
    "NetnsWorker",
    "connect_in_netns",
    "drop_namespace_mounts",
    "enter_empty_root",
    "in_netns",
    "link_flags",
    "make_mounts_private",
    "mount",
    "ns_inode",
    "ns_path",
    "set_link_up",
    "setns",
    "socket_in_netns",
    "umount",
    "unshare",
]

# <linux/sched.h>
CLONE_NEWNS: Final = 0x00020000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
CLONE_NEWNET: Final = 0x40000000

# <linux/mount.h>
MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MS_PRIVATE: Final = 0x40000

# <linux/sockios.h>, <net/if.h>
SIOCGIFFLAGS: Final = 0x8913
SIOCSIFFLAGS: Final = 0x8914
IFF_UP: Final = 0x1
_IFNAMSIZ: Final = 16
# struct ifreq: the name, then a union whose first member here is `short ifr_flags`.
_IFREQ_FLAGS: Final = struct.Struct(f"{_IFNAMSIZ}sh22x")

# Threads in the netns worker pool: socket creation is fast, two keep one slow call from
# stalling the next.
NETNS_WORKERS: Final = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]


class NamespaceError(OSError):
    """A namespace could not be opened or entered."""


class NamespaceRestoreError(RuntimeError):
    """A thread could not return to its own namespace; it must never run other work."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """Move the calling thread into the namespace `fd` refers to (0 = any type)."""
    _check(_libc.setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    """Give the calling thread (or, for PID namespaces, its future children) new namespaces."""
    _check(_libc.unshare(flags), "unshare")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
        f"mount {target}",
    )


_SYS_PIVOT_ROOT: Final = {"x86_64": 155, "aarch64": 41}
MNT_DETACH: Final = 2


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(os.fsencode(target), flags), f"umount {target}")


def enter_empty_root(directory: str) -> None:
    """Make a private tmpfs on `directory` the root of the calling process's (new, private)
    mount namespace and drop the old root: nothing of the node's filesystem stays reachable,
    not even through /proc/<pid>/root. runc's pivot_root(".", ".") sequence."""
    mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    os.chdir(directory)
    _libc.syscall.restype = ctypes.c_long
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown architecture {platform.machine()}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def make_mounts_private() -> None:
    """Stop mount events propagating out of (or into) the current mount namespace."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def drop_namespace_mounts() -> None:
    """Detach every namespace file mounted in the current (private) mount namespace: a copy
    of another pod's pinned namespace would keep that namespace alive after its pod is gone."""
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields, _, rest = line.partition(b" - ")
        if rest.split(b" ", 1)[0] != b"nsfs":
            continue
        target = fields.split(b" ")[4].decode("unicode_escape")  # octal escapes: \040
        with suppress(OSError):
            umount(target, MNT_DETACH)


def ns_path(pid: int, kind: str) -> str:
    return f"/proc/{pid}/ns/{kind}"


def ns_inode(path: str) -> int:
    """The namespace's inode number: equal inodes (on nsfs) mean the same namespace."""
    return os.stat(path).st_ino


def link_flags(name: str = "lo") -> int:
    """Interface flags of `name` in the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = _IFREQ_FLAGS.pack(name.encode(), 0)
        reply = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request)
    return int(_IFREQ_FLAGS.unpack(reply)[1])


def set_link_up(name: str = "lo") -> None:
    """Bring `name` up in the calling thread's network namespace (no external tools)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        reply = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, _IFREQ_FLAGS.pack(name.encode(), 0))
        flags = _IFREQ_FLAGS.unpack(reply)[1]
        if not flags & IFF_UP:
            fcntl.ioctl(
                sock.fileno(), SIOCSIFFLAGS, _IFREQ_FLAGS.pack(name.encode(), flags | IFF_UP)
            )


@contextmanager
def in_netns(path: str) -> Iterator[None]:
    """Run the body with the CURRENT THREAD in the network namespace at `path`.

    On exit the thread returns to its own netns; if that fails NamespaceRestoreError is raised
    and the thread must not be used for anything else.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise NamespaceError(exc.errno, f"open {path}: {exc.strerror}") from exc
        try:
            setns(target, CLONE_NEWNET)
        except OSError as exc:
            raise NamespaceError(exc.errno, f"enter {path}: {exc.strerror}") from exc
        finally:
            os.close(target)
        try:
            yield
        finally:
            try:
                setns(home, CLONE_NEWNET)
            except OSError as exc:
                raise NamespaceRestoreError(
                    f"thread {threading.get_ident()} could not leave network namespace "
                    f"{path}: {exc}"
                ) from exc
    finally:
        os.close(home)


def socket_in_netns(path: str, family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
    """A new socket that lives in the netns at `path`; made on (and blocking) this thread."""
    with in_netns(path):
        return socket.socket(family, type)


class SocketMaker(Protocol):
    """Makes a socket of `family`/`type` in the netns at `path` (NetnsWorker, or a pod's pool
    of sockets made ahead of time: podgate.linux.netns_pool)."""

    async def socket(
        self, path: str, family: int, type: int = socket.SOCK_STREAM
    ) -> socket.socket: ...


class NetnsWorker:
    """A small thread pool that creates sockets inside network namespaces, off the loop.

    Each job first checks that its thread is still in the pool's own netns, so a thread that
    failed to return from a pod's netns refuses all later work instead of leaking it.
    """

    def __init__(self, max_workers: int = NETNS_WORKERS) -> None:
        self._home = ns_inode("/proc/thread-self/ns/net")
        self._max_workers = max_workers
        self._executor = self._new_executor()
        self._lock = threading.Lock()

    def _new_executor(self) -> ThreadPoolExecutor:
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="netns")

    def _job(self, fn: Callable[..., _T], *args: Any) -> _T:
        current = ns_inode("/proc/thread-self/ns/net")
        if current != self._home:
            raise NamespaceRestoreError(
                f"netns worker thread is stuck in netns inode {current}, not {self._home}"
            )
        return fn(*args)

    async def socket(self, path: str, family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
        return await self.call(socket_in_netns, path, family, type)

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on a pool thread that is in the pool's own netns (fn enters another
        with in_netns and must leave it)."""
        import asyncio

        loop = asyncio.get_running_loop()
        with self._lock:
            executor = self._executor
        try:
            return await loop.run_in_executor(executor, self._job, fn, *args)
        except NamespaceRestoreError:
            # Retire the pool that owns the stuck thread; later jobs get fresh threads.
            with self._lock:
                if self._executor is executor:
                    self._executor = self._new_executor()
            executor.shutdown(wait=False)
            raise

    def close(self) -> None:
        with self._lock:
            self._executor.shutdown(wait=True)


def _go_strerror(err: int) -> str:
    # Go spells errno texts in lower case ("connection refused").
    text = os.strerror(err)
    return text[:1].lower() + text[1:]


async def connect_in_netns(
    worker: SocketMaker, path: str, port: int, *, label: str | None = None
) -> socket.socket:
    """Connect to localhost:`port` inside the netns at `path` as containerd does.

    IPv4 127.0.0.1 first, then IPv6 ::1, one after the other. Returns the connected,
    non-blocking socket. `label` names the sandbox in the error (default: the path).
    """
    import asyncio

    loop = asyncio.get_running_loop()
    failures: list[str] = []
    errnos: list[int] = []
    for family, network, host, shown in (
        (socket.AF_INET, "tcp4", "127.0.0.1", f"127.0.0.1:{port}"),
        (socket.AF_INET6, "tcp6", "::1", f"[::1]:{port}"),
    ):
        try:
            sock = await worker.socket(path, family, socket.SOCK_STREAM)
        except NamespaceError as exc:
            raise ConnectError(
                f"failed to enter network namespace {path!r}: {exc.strerror}", exc.errno
            ) from exc
        except OSError as exc:
            errnos.append(exc.errno or 0)
            failures.append(f"dial {network} {shown}: socket: {_go_strerror(exc.errno or 0)}")
            continue
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            err = exc.errno or errno.ECONNREFUSED
            errnos.append(err)
            failures.append(f"dial {network} {shown}: connect: {_go_strerror(err)}")
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    where = label if label is not None else path
    raise ConnectError(
        f'failed to connect to localhost:{port} inside namespace "{where}", '
        f"IPv4: {failures[0]} IPv6 {failures[1]} ",
        errnos[0],
    )
