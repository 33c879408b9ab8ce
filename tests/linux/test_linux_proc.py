"""Process identity (pid + start time) and crash-safe JSON files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from podgate.linux.proc import (
    atomic_write_json,
    is_alive,
    is_exiting,
    process_ref,
    read_json,
    read_stat,
    signal_process,
    wait_gone,
)
from podgate.model import ProcessRef


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _naive_start_time(pid: int) -> int:
    # Only right while comm has no spaces: field 22, counting from 1.
    return int(Path(f"/proc/{pid}/stat").read_text().split()[21])


def test_start_time_survives_a_hostile_comm() -> None:
    # A process may only rename itself: the child renames on request, then sleeps.
    script = (
        "import sys, time\n"
        "sys.stdin.readline()\n"
        "open('/proc/self/comm', 'w').write('a) R (b c) ')\n"
        "print('renamed', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen(
        ["python3", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        expected = _naive_start_time(child.pid)
        assert process_ref(child.pid) == ProcessRef(child.pid, expected)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"renamed\n"
        # comm may hold spaces and parentheses; the fields after the last ')' still parse.
        assert f"{child.pid} (a) R (b c) ) " in Path(f"/proc/{child.pid}/stat").read_text()
        assert process_ref(child.pid) == ProcessRef(child.pid, expected)
        assert read_stat(child.pid)[0] in {"R", "S"}
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()


def test_is_alive_checks_identity_and_zombies(sleeper: subprocess.Popen[bytes]) -> None:
    ref = process_ref(sleeper.pid)
    assert is_alive(ref)
    assert not is_alive(ProcessRef(sleeper.pid, ref.start_time + 1))  # a reused pid
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while read_stat(sleeper.pid)[0] != "Z":  # not reaped yet: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not is_alive(ref)
    sleeper.wait()
    assert not is_alive(ref)
    with pytest.raises(ProcessLookupError):
        process_ref(sleeper.pid)


def test_is_exiting_from_the_kill_on(sleeper: subprocess.Popen[bytes]) -> None:
    # The moment between the kill and the zombie (PF_EXITING: files being closed) is too short
    # to catch here; tests/sandbox/test_sandbox_faults.py meets it through a killed agent.
    ref = process_ref(sleeper.pid)
    assert not is_exiting(ref)
    assert is_exiting(ProcessRef(sleeper.pid, ref.start_time + 1))  # a reused pid
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while read_stat(sleeper.pid)[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert is_exiting(ref)
    sleeper.wait()
    assert is_exiting(ref)


def test_signal_process_spares_a_different_process(sleeper: subprocess.Popen[bytes]) -> None:
    ref = process_ref(sleeper.pid)
    assert not signal_process(ProcessRef(sleeper.pid, ref.start_time - 1), signal.SIGKILL)
    assert sleeper.poll() is None
    assert signal_process(ref, signal.SIGTERM)
    assert sleeper.wait(5) == -signal.SIGTERM
    assert not signal_process(ref, signal.SIGTERM)


async def test_wait_gone(sleeper: subprocess.Popen[bytes]) -> None:
    ref = process_ref(sleeper.pid)
    started = time.monotonic()
    assert not await wait_gone(ref, 0.2)
    assert time.monotonic() - started >= 0.2
    os.kill(sleeper.pid, signal.SIGTERM)
    assert await wait_gone(ref, 5)  # a zombie counts as gone
    assert await wait_gone(ProcessRef(sleeper.pid, ref.start_time + 1), 0)


def test_atomic_write_json_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(str(target), {"a": 1, "b": [1, 2]})
    assert json.loads(target.read_text()) == {"a": 1, "b": [1, 2]}
    atomic_write_json(str(target), {"a": 2})
    assert read_json(str(target)) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_atomic_write_json_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(str(target), {"ok": True})
    with pytest.raises(TypeError):
        atomic_write_json(str(target), {"bad": object()})
    assert read_json(str(target)) == {"ok": True}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left
