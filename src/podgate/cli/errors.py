"""One line, not a traceback, for the mistakes a person starting podgate makes."""

from __future__ import annotations

import errno
import os

import click

_LISTEN_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}


def listen_failure(exc: BaseException, host: str, port: int) -> click.ClickException | None:
    """A clear error when `exc` (or what caused it) is a failed bind of host:port, else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _LISTEN_ERRNOS:
            # asyncio words it "error while attempting to bind on address ...": say it plainly.
            reason = os.strerror(seen.errno).lower()
            return click.ClickException(
                f"cannot listen on {host}:{port}: {reason}; choose another with --port"
            )
        if isinstance(seen, BaseExceptionGroup) and len(seen.exceptions) == 1:
            seen = seen.exceptions[0]
        else:
            seen = seen.__cause__ or seen.__context__
    return None
