"""Wait for a process started by `runc exec --detach` and exit with its status (what
containerd's shim does for an exec): `python -m podgate.linux.execwait PIDFILE ERRFILE -- RUNC...`.

In the foreground runc copies the process's output through pipes of its own and exits only
when they reach EOF, so a background child that inherited them keeps it (and ExecSync) waiting
forever. Detached, runc hands our stdio to the process itself and exits at once; as a child
subreaper this helper then inherits the process, reaps it and exits with its code. SIGTERM
kills the process (an ExecSync deadline). If runc fails, the process never ran: ERRFILE says so
(runc's own message went to stderr).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Final

__all__ = ["main"]

_PR_SET_CHILD_SUBREAPER: Final = 36
# Exit code when runc itself failed before the process ran (its message is on stderr).
RUNC_FAILED: Final = 126


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[2] != "--":
        print("usage: python -m podgate.linux.execwait PIDFILE ERRFILE -- RUNC...", file=sys.stderr)
        return 2
    pid_file, error_file, runc = args[0], args[1], args[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(
            f"execwait: PR_SET_CHILD_SUBREAPER: {os.strerror(ctypes.get_errno())}", file=sys.stderr
        )
        return RUNC_FAILED
    target: list[int] = []

    def on_term(signum: int, frame: object) -> None:
        del signum, frame
        for pid in target:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not target:
            os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    code = subprocess.run(runc, close_fds=True, check=False).returncode
    if code != 0:
        with open(error_file, "w", encoding="utf-8") as f:
            f.write(f"the OCI runtime exited with {code}")
        return RUNC_FAILED
    with open(pid_file, encoding="ascii") as f:
        pid = int(f.read().strip())
    os.unlink(pid_file)
    target.append(pid)
    # Our copies of the pipes are not needed; only the process (and its children) keep them.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return RUNC_FAILED  # the process was never ours: nothing to report
        except InterruptedError:
            continue
        if reaped == pid:
            return _exit_code(status)


if __name__ == "__main__":
    sys.exit(main())
