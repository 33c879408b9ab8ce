"""A container's root: an overlayfs of the image's lower directories plus a per-container
upper and work directory, mounted in the host's mount namespace under the bundle."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Final

__all__ = ["MAX_MOUNT_DATA", "OverlayError", "disk_usage", "is_mounted", "mount_overlay", "unmount"]

# The kernel copies at most one page of mount options.
MAX_MOUNT_DATA: Final = 4095
_MNT_DETACH: Final = 2
_libc = ctypes.CDLL(None, use_errno=True)


class OverlayError(OSError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OverlayError(err, f"{what}: {os.strerror(err)}")


def mount_overlay(lowers: Sequence[str], upper: str, work: str, target: str) -> None:
    """Mount lowers (topmost first) + upper/work on `target`; the directories are created."""
    if not lowers:
        raise OverlayError(errno.EINVAL, "an overlay needs at least one lower directory")
    for path in (*lowers, upper, work, target):
        if "," in path or ":" in path:
            raise OverlayError(errno.EINVAL, f"overlay path {path!r} holds ',' or ':'")
    for path in (upper, work, target):
        os.makedirs(path, mode=0o755, exist_ok=True)
    data = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    if len(data) > MAX_MOUNT_DATA:
        raise OverlayError(errno.E2BIG, f"overlay options are {len(data)} bytes")
    _check(
        _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, os.fsencode(data)),
        f"mount overlay on {target}",
    )


def is_mounted(target: str) -> bool:
    target = os.path.realpath(target)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            mountpoint = fields[4].encode().decode("unicode_escape")
            if mountpoint == target:
                return True
    return False


def unmount(target: str) -> None:
    """Lazily unmount `target` (every stacked mount); nothing mounted is fine."""
    while is_mounted(target):
        result = _libc.umount2(os.fsencode(target), _MNT_DETACH)
        if result != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return
            raise OverlayError(err, f"unmount {target}: {os.strerror(err)}")


def disk_usage(path: str) -> tuple[int, int]:
    """(bytes in allocated blocks, inodes) of a directory tree, hard links counted once; a
    tree changing underneath is measured as far as it can be."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total, len(seen)
