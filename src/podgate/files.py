"""Writing a file so that it is never seen half-written and survives a crash: the one helper
every part of podgate uses for its state, credentials and configuration files.

The data goes to a temporary file in the same directory, which is fsynced and then renamed
over (or, without `replace`, hard-linked to) the final name; the directory is fsynced last so
the new name itself is durable. A crash at any point leaves the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = [
    "DEFAULT_FILE_MODE",
    "atomic_write",
    "atomic_write_sole",
    "fsync_directory",
    "rename_durably",
    "rotate",
]

DEFAULT_FILE_MODE = 0o600  # owner only: most of what podgate writes is state or a secret


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a link, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = DEFAULT_FILE_MODE,
    replace: bool = True,
) -> None:
    """Put `data` at `path` atomically and durably, with permissions `mode` from the start.

    With `replace=False` an existing file is kept and FileExistsError raised (a create-once
    file, such as an address lease or a first token).
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # before any secret byte is written
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_directory(directory)


def atomic_write_sole(path: str, data: bytes, *, mode: int = DEFAULT_FILE_MODE) -> None:
    """atomic_write for a file that only one process ever writes, with os calls alone: the
    temporary name is fixed (`path` + ".tmp") and no tempfile or pathlib code runs, which a
    process forked from a warm interpreter (a container shim) would otherwise copy the pages
    of."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # an older temporary file keeps its mode through O_CREAT
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(path) or ".")


def rename_durably(
    source: str | os.PathLike[str], target: str | os.PathLike[str], *, replace: bool = True
) -> None:
    """Move a file or directory that is already complete and synced to `target`, and make the
    move durable (both directories fsynced). With `replace=False` an existing target is an
    OSError (a directory rename onto a non-empty directory fails by itself)."""
    if replace:
        os.replace(source, target)
    else:
        os.rename(source, target)
    fsync_directory(Path(target).parent)
    if Path(source).parent != Path(target).parent:
        fsync_directory(Path(source).parent)


def rotate(path: str | os.PathLike[str], keep: int) -> None:
    """Move a log aside by size rotation: `path` → `path.1` → … → `path.<keep>`, dropping
    the oldest; with `keep` 0 the log is simply removed. The caller then opens a new one."""
    base = os.fspath(path)
    numbered = [f"{base}.{n}" for n in range(1, keep + 1)]
    with contextlib.suppress(FileNotFoundError):
        if keep == 0:
            os.unlink(base)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(numbered[-1])
            for older, newer in zip(reversed(numbered[1:]), reversed(numbered[:-1]), strict=True):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(newer, older)
            os.rename(base, numbered[0])
    fsync_directory(os.path.dirname(os.path.abspath(base)))
