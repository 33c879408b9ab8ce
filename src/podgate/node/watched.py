"""A configuration file re-read when it changes (tokens, policy).

A change is seen through (inode, size, mtime), so a replace-by-rename is noticed too. A file
that fails to parse keeps the previous contents in force and is reported once per bad version,
not once per request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Stamp = tuple[int, int, int]
MISSING: Stamp = (-1, -1, -1)  # the stamp of a file that is gone


def stamp(path: Path) -> Stamp:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def safe_stamp(path: Path) -> Stamp:
    try:
        return stamp(path)
    except OSError:
        return MISSING


class WatchedFile(Generic[T]):
    """`parse(text, source)` of a file, re-done when the file changes."""

    def __init__(
        self,
        path: Path,
        parse: Callable[[str, str], T],
        error: type[ValueError],
        what: str,
    ) -> None:
        self.path = path
        self._parse = parse
        self._error = error
        self._what = what
        self._stamp: Stamp | None = None
        self._failed_stamp: Stamp | None = None

    def reload(self, *, raise_errors: bool) -> T | None:
        """The new contents if the file changed and parses; None if unchanged or bad (then
        logged, or raised as the configured error with `raise_errors`)."""
        try:
            before = stamp(self.path)
            if before in (self._stamp, self._failed_stamp):
                return None
            with open(self.path, "rb") as f:
                text = f.read().decode("utf-8")
            value = self._parse(text, str(self.path))
            after = stamp(self.path)
        except (OSError, UnicodeDecodeError, self._error) as exc:
            if raise_errors:
                if isinstance(exc, self._error):
                    raise
                raise self._error(f"{self.path}: {exc}") from exc
            current = safe_stamp(self.path)
            if current != self._failed_stamp:
                log.error("%s not reloaded, keeping the previous one: %s", self._what, exc)
            self._failed_stamp = current
            return None
        # Written while we read it: leave the stamp stale so the next call reads it again.
        self._stamp = after if after == before else None
        self._failed_stamp = None
        return value
