"""A configuration file re-read when it changes (tokens, policy).

A change is seen through the sha256 of the contents, so an in-place edit that keeps the size
and lands within the filesystem's timestamp granularity is noticed as surely as a replace by
rename. The whole file is read and parsed before anything changes: a version that fails to
parse (or was still being written while it was read) never takes effect, the previous contents
stay in force and the failure is reported once per bad version, not once per request.

A deleted file fails closed: the value becomes what an empty file means (no tokens, a policy
without rules that denies everything), logged at CRITICAL once, until the file comes back.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
# The digest remembered for a deleted file (no sha256 is empty).
_GONE = b""


def read_whole(path: Path) -> bytes | None:
    """The file's bytes, or None when it changed size while being read (a writer at work)."""
    with open(path, "rb") as f:
        data = f.read()
        if os.fstat(f.fileno()).st_size != len(data):
            return None
    return data


class WatchedFile(Generic[T]):
    """`parse(text, source)` of a file, re-done when the file's contents change."""

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
        self._digest: bytes | None = None
        self._failed_digest: bytes | None = None

    def reload(self, *, raise_errors: bool) -> T | None:
        """The new contents if the file changed and parses (what an empty file parses to if
        it was deleted); None if unchanged or bad (then logged, or raised as the configured
        error with `raise_errors`)."""
        try:
            data = read_whole(self.path)
        except FileNotFoundError as exc:
            if raise_errors:
                raise self._error(f"{self.path}: {exc.strerror}") from exc
            return self._gone()
        except OSError as exc:
            self._failed(exc, None, raise_errors)
            return None
        if data is None:
            return None  # being written: read again on the next call
        digest = hashlib.sha256(data).digest()
        if digest in (self._digest, self._failed_digest):
            return None
        try:
            value = self._parse(data.decode("utf-8"), str(self.path))
        except (UnicodeDecodeError, self._error) as exc:
            self._failed(exc, digest, raise_errors)
            return None
        if self._digest == _GONE:
            log.warning("%s %s is back", self._what, self.path)
        self._digest = digest
        self._failed_digest = None
        return value

    def _gone(self) -> T | None:
        if self._digest == _GONE:
            return None
        log.critical(
            "%s %s was deleted: failing closed (%s) until it is back",
            self._what,
            self.path,
            "no tokens are accepted" if "token" in self._what else "every request is denied",
        )
        self._digest = _GONE
        self._failed_digest = None
        return self._parse("", str(self.path))

    def _failed(self, exc: Exception, digest: bytes | None, raise_errors: bool) -> None:
        if raise_errors:
            if isinstance(exc, self._error):
                raise exc
            raise self._error(f"{self.path}: {exc}") from exc
        if digest is None or digest != self._failed_digest:
            log.error("%s not reloaded, keeping the previous one: %s", self._what, exc)
        self._failed_digest = digest
