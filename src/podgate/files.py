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

__all__ = ["DEFAULT_FILE_MODE", "atomic_write", "fsync_directory"]

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
