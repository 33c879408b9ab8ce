"""Paths from CRI resolved inside a root directory: `openat2(RESOLVE_IN_ROOT)` semantics.

Every path component is looked up as if `root` were `/`: `..` at the root stays at the root,
and a symlink (absolute or relative) is followed inside the root. So a log path, a mount
destination or a file read from an image can never name anything outside its directory.

`open_in_root` uses the kernel's openat2 (Linux 5.6+) through ctypes when it exists, and
otherwise falls back to `secure_join` (a userspace walk with filepath-securejoin's rules)
followed by an open that refuses a final symlink.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from typing import Final

__all__ = [
    "MAX_SYMLINKS",
    "RESOLVE_IN_ROOT",
    "RESOLVE_NO_MAGICLINKS",
    "has_openat2",
    "open_in_root",
    "read_in_root",
    "secure_join",
]

# Symlinks followed in one resolution before ELOOP (filepath-securejoin's limit).
MAX_SYMLINKS: Final = 255
# <linux/openat2.h>
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_IN_ROOT: Final = 0x10
# openat2 has number 437 on every architecture (it postdates the syscall table split).
_SYS_OPENAT2: Final = 437
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_state: list[bool] = []


def has_openat2() -> bool:
    """Whether this kernel has openat2 (probed once, with a harmless open of `/`)."""
    if not _openat2_state:
        try:
            fd = _openat2(-100, "/", os.O_PATH | os.O_CLOEXEC, 0)
        except OSError as exc:
            _openat2_state.append(exc.errno not in (errno.ENOSYS, errno.EPERM))
        else:
            os.close(fd)
            _openat2_state.append(True)
    return _openat2_state[0]


def _openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    how = struct.pack("QQQ", flags, mode, resolve)
    buf = ctypes.create_string_buffer(how, len(how))
    fd = _libc.syscall(
        _SYS_OPENAT2,
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        buf,
        ctypes.c_size_t(len(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _clean_components(path: str) -> list[str]:
    return [part for part in path.split("/") if part and part != "."]


def secure_join(root: str, unsafe: str) -> str:
    """`root` joined with `unsafe`, every symlink resolved inside `root` (filepath-securejoin's
    SecureJoin): the result is `root` or below it. Components that do not exist are appended
    lexically (with `..` clamped at the root). ELOOP after MAX_SYMLINKS links."""
    root = os.path.abspath(root)
    pending = _clean_components(unsafe)
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            resolved.append(part)
            continue
        if not stat.S_ISLNK(st.st_mode):
            resolved.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), unsafe)
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending = _clean_components(target) + pending
    return os.path.join(root, *resolved) if resolved else root


def open_in_root(root: str, unsafe: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """An fd for `unsafe` looked up inside `root` (O_CLOEXEC always added)."""
    flags |= os.O_CLOEXEC
    if has_openat2():
        rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return _openat2(
                rootfd,
                unsafe.lstrip("/") or ".",
                flags,
                RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
                mode if flags & os.O_CREAT else 0,
            )
        finally:
            os.close(rootfd)
    return os.open(secure_join(root, unsafe), flags | os.O_NOFOLLOW, mode)


def read_in_root(root: str, unsafe: str, limit: int) -> bytes:
    """At most `limit` bytes of a regular file inside `root`."""
    fd = open_in_root(root, unsafe)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", unsafe)
        chunks = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
