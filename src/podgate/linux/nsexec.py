"""Exec into a container that has no root of its own (it runs on the node's filesystem):
`python -m podgate.linux.nsexec SPEC` where SPEC is a JSON file {"argv", "env"}, removed once
read. When nsenter cannot be started the reason is written to `SPEC.error` (and stderr), so
the caller can tell "never ran" from an exit code of the command.

The environment comes from the file, never from a command line, and every descriptor above
stderr is closed before nsenter runs, so nothing of the daemon reaches the command.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Final

__all__ = ["main"]

# Exit code when the spec cannot be read (the command never ran).
SPEC_FAILED: Final = 126


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m podgate.linux.nsexec SPEC", file=sys.stderr)
        return 2
    try:
        with open(args[0], encoding="utf-8") as f:
            spec = json.load(f)
        os.unlink(args[0])  # read once: callers that cannot clean up leave nothing behind
        command = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
    except (OSError, ValueError, KeyError) as exc:
        print(f"nsexec: {exc}", file=sys.stderr)
        return SPEC_FAILED
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    # Python ignores these; an ignored signal stays ignored across exec (`yes | head`).
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execve(command[0], command, env)
    except OSError as exc:
        message = f"exec {command[-1][:64]!r}...: {exc.strerror}"
        print(f"nsexec: {message}", file=sys.stderr)
        with open(f"{args[0]}.error", "w", encoding="utf-8") as f:
            f.write(message)
        return SPEC_FAILED
    return SPEC_FAILED  # not reached


if __name__ == "__main__":
    sys.exit(main())
