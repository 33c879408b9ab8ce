"""A pod's network, IPC and UTS namespaces pinned by bind mounts, with no process holding them.

A fresh thread of the calling process unshares the three namespaces (they are per thread in
Linux), sets the hostname, brings `lo` up and writes the namespaced sysctls inside them, then
bind-mounts `/proc/thread-self/ns/{net,ipc,uts}` onto files of a directory (what `ip netns add`
does for one namespace) and exits. The namespaces live as long as the mounts: a pod that does
not share a PID namespace needs no holder process, and a restarted daemon finds them again in
the files. `unpin` unmounts them (lazily: a process still inside keeps its namespace).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Mapping
from typing import Final

from podgate.linux import ns

__all__ = ["KINDS", "is_pinned", "pin", "unpin"]

KINDS: Final = ("net", "ipc", "uts")
_FLAGS: Final = ns.CLONE_NEWNET | ns.CLONE_NEWIPC | ns.CLONE_NEWUTS


def _write_sysctl(key: str, value: str) -> None:
    # /proc/sys/net and the IPC keys resolve to the opening thread's namespaces.
    path = "/proc/sys/" + key.replace(".", "/")
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(value)
    except OSError as exc:
        raise OSError(exc.errno, f"sysctl {key}={value}: {exc.strerror}") from exc


def _pin_here(directory: str, hostname: str, sysctls: Mapping[str, str]) -> dict[str, str]:
    """On a thread that exits afterwards: new namespaces, set up, bind-mounted."""
    ns.unshare(_FLAGS)
    if hostname:
        socket.sethostname(hostname)
    ns.set_link_up("lo")
    for key, value in sysctls.items():
        _write_sysctl(key, value)
    files: dict[str, str] = {}
    try:
        for kind in KINDS:
            target = os.path.join(directory, kind)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
            files[kind] = target
            ns.mount(f"/proc/thread-self/ns/{kind}", target, None, ns.MS_BIND)
    except BaseException:
        unpin(files)
        raise
    return files


def pin(
    directory: str, hostname: str = "", sysctls: Mapping[str, str] | None = None
) -> dict[str, str]:
    """New net, ipc and uts namespaces pinned on files in `directory` ({"net": path, ...}).

    Blocking (a thread is started and joined): call it off the event loop. Raises OSError
    with what failed; nothing stays mounted then.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    result: list[dict[str, str]] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(_pin_here(directory, hostname, dict(sysctls or {})))
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    # A thread of its own: its namespaces go away with it, no pool thread is changed.
    thread = threading.Thread(target=run, name="pod namespaces", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def is_pinned(path: str) -> bool:
    """Whether `path` is still a namespace file (a mount of nsfs), not the empty file below."""
    try:
        return os.stat(path).st_dev != os.stat(os.path.dirname(path) or ".").st_dev
    except OSError:
        return False


def unpin(files: Mapping[str, str]) -> None:
    """Unmount and remove the files of `pin`; files already gone are fine."""
    for path in files.values():
        try:
            ns.umount(path, ns.MNT_DETACH)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                raise
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
