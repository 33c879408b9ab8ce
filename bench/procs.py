"""Processes the benchmark starts: start, wait until ready, account CPU, stop by PID.

Every child writes stdout/stderr to files in one temporary directory (a pipe nobody reads
would block a chatty child such as kubectl), gets SIGTERM if this process dies (prctl
PDEATHSIG), and is stopped by its own PID when the `ProcessSet` closes, on errors and
Ctrl-C too. The directory is removed afterwards.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# How long a child may take to print its ready line.
READY_TIMEOUT_SECONDS = 30.0
# After SIGTERM, how long a child gets before SIGKILL.
STOP_GRACE_SECONDS = 5.0
# Ready-line polling period.
POLL_SECONDS = 0.02
# Bytes of a child's stderr quoted in an error.
ERROR_TAIL_BYTES = 2000
_PR_SET_PDEATHSIG = 1


class ChildError(RuntimeError):
    """A child failed to start, exited early, or printed something unexpected."""


def _stat_ticks(pid: int) -> int:
    """utime+stime+cutime+cstime of one process, in clock ticks (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime..cstime are fields 14..17.
    return sum(int(f) for f in fields[11:15])


def _live_children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        children += [int(c) for c in text.split()]
    return children


def _task_run_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every thread of one process (the scheduler's count, finer than
    clock ticks); 0 if it is gone."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total


def _reaped_ticks(pid: int) -> int:
    """cutime+cstime of one process: its children that it has reaped, in clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return sum(int(f) for f in stat.rsplit(")", 1)[1].split()[13:15])


def run_seconds(pid: int) -> float:
    """Time on a CPU of a process's threads and (recursively) its live children's, to the
    nanosecond: for short spans, where cpu_seconds' clock ticks (10 ms) are too coarse; plus,
    in clock ticks, the children `pid` has reaped (socat's per-connection forks that ended)."""
    ns = _reaped_ticks(pid) * 1_000_000_000 // CLOCK_TICKS_PER_SECOND
    todo = [pid]
    seen: set[int] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        ns += _task_run_ns(p)
        todo += _live_children(p)
    return ns / 1e9


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process, all its threads, its reaped children and (recursively)
    its live children, such as socat's per-connection forks."""
    ticks = 0
    todo = [pid]
    seen: set[int] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        ticks += _stat_ticks(p)
        todo += _live_children(p)
    return ticks / CLOCK_TICKS_PER_SECOND


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the benchmark is killed, so is the child.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Child:
    """One started process, its output files, and how to stop it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - the bench driver has no threads
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stderr_tail(self) -> str:
        try:
            data = self.err_path.read_bytes()[-ERROR_TAIL_BYTES:]
        except OSError:
            return ""
        return data.decode(errors="replace").strip()

    def wait_for(
        self, pattern: str, count: int = 1, timeout: float = READY_TIMEOUT_SECONDS
    ) -> list[re.Match[str]]:
        """Wait until stdout holds `count` lines matching `pattern`; returns the matches."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            text = self.out_path.read_text(errors="replace")
            matches = list(regex.finditer(text))
            if len(matches) >= count:
                return matches
            if self.proc.poll() is not None:
                raise ChildError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready: "
                    f"{self.stderr_tail() or text[-ERROR_TAIL_BYTES:]}"
                )
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} not ready after {timeout:.0f} s")
            time.sleep(POLL_SECONDS)

    def wait_for_json(self, timeout: float = READY_TIMEOUT_SECONDS) -> dict[str, Any]:
        """The first JSON line on stdout (how the bench's own processes say they are ready)."""
        match = self.wait_for(r"^\{.*\}$", timeout=timeout)[0]
        value = json.loads(match.group(0))
        if not isinstance(value, dict):
            raise ChildError(f"{self.name}: unexpected ready line {match.group(0)!r}")
        return value

    def stop(self) -> None:
        """SIGTERM, a grace period, then SIGKILL; always reaps the process."""
        if self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ProcessSet:
    """Owns the temporary directory and every Child; closing stops them (newest first)."""

    def __init__(self, cwd: Path | None = None, prefix: str = "podgate-bench-") -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.cwd = cwd
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        child = Child(name, argv, self.workdir, env, self.cwd)
        self.children.append(child)
        return child

    def run(
        self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a short-lived child to completion (killed by PID on timeout)."""
        return subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            cwd=self.cwd,
            preexec_fn=_die_with_parent,
            check=False,
        )

    def run_json(self, argv: Sequence[str], timeout: float, row: dict[str, Any]) -> dict[str, Any]:
        """Run a bench client; `row` plus the last JSON line it printed, or plus an error."""
        try:
            done = self.run(argv, timeout)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"client did not finish within {timeout:.0f} s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            tail = done.stderr.strip().splitlines()[-3:]
            return {**row, "error": f"client exited {done.returncode}: {' / '.join(tail)}"}
        result: dict[str, Any] = json.loads(lines[-1])
        return {**row, **result}

    def close(self) -> None:
        # A second Ctrl-C must not leave children behind half-way through the cleanup.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for child in reversed(self.children):
                child.stop()
        finally:
            self.children.clear()
            shutil.rmtree(self.workdir, ignore_errors=True)
            signal.signal(signal.SIGINT, previous)

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
