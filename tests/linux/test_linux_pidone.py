"""The sandbox guest's namespaces held by one PID 1 (podgate.linux.pidone): the pause program in
an empty root (or `sleep` in the node's), new namespaces set up, orphans reaped by the kernel,
SIGTERM ignored and SIGKILL final."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from podgate.linux import ns, pidone
from podgate.linux.proc import is_alive, read_stat, signal_process, wait_gone
from podgate.model import ProcessRef

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it unshares namespaces"),
]

WAIT = 15.0
# The child an orphan-making shell leaves behind lives this long, seconds.
ORPHAN_SECONDS = 0.5


def _status(pid: int, key: str) -> list[str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(line for line in f if line.startswith(key + ":")).split()[1:]


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_status(int(entry), "PPid")[0]) == parent:
                    found.append(int(entry))
            except (OSError, StopIteration):
                continue
    return found


@pytest.fixture(params=["pause", "sleep"])
def guest(request: pytest.FixtureRequest, tmp_path: Path) -> object:
    """PID 1 in an empty root (the pause program), or `sleep` in the node's root."""
    empty_root = str(tmp_path / "root") if request.param == "pause" else ""
    if empty_root:
        os.mkdir(empty_root)
    ref = pidone.start("pidone-test", empty_root)
    yield ref
    signal_process(ref, signal.SIGKILL)


async def test_pid_one_of_new_namespaces_runs_with_nothing_of_ours(
    guest: ProcessRef, request: pytest.FixtureRequest
) -> None:
    pid = guest.pid
    assert _status(pid, "NSpid")[-1] == "1"
    for kind in ("pid", "net", "uts", "ipc"):
        assert os.stat(f"/proc/{pid}/ns/{kind}").st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        program = os.path.basename(f.read().split(b"\0")[0]).decode()
    assert program == request.node.callspec.params["guest"]
    if program == "pause":
        # What the pod's processes reach through /proc/1/root: an empty tmpfs, not the node.
        assert os.listdir(f"/proc/{pid}/root") == []
        assert os.stat(f"/proc/{pid}/root").st_dev != os.stat("/").st_dev
        assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            pss_kib = next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
        assert pss_kib < 100, f"PID 1 maps {pss_kib} KiB"
    # Only stdio (sleep opens its locale files for a moment as it starts; a descriptor it
    # inherited would stay).
    for _ in range(int(WAIT / 0.05)):
        if sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"PID 1 keeps descriptors: {os.listdir(f'/proc/{pid}/fd')}")
    hostname = subprocess.run(
        ["nsenter", "-t", str(pid), "--uts", "hostname"], capture_output=True, check=True
    )
    assert hostname.stdout == b"pidone-test\n"
    with ns.in_netns(f"/proc/{pid}/ns/net"):
        assert ns.link_flags("lo") & ns.IFF_UP
    # Not our child, and in a session of its own.
    assert int(_status(pid, "PPid")[0]) != os.getpid()
    assert os.getsid(pid) != os.getsid(0)


async def test_orphans_in_the_namespace_are_reaped(guest: ProcessRef) -> None:
    # A shell in the PID namespace starts a background sleep and exits: the sleep is
    # re-parented to PID 1, and when it exits nothing may stay behind as a zombie.
    subprocess.run(
        ["nsenter", "-t", str(guest.pid), "--pid", "--", "sh", "-c", f"sleep {ORPHAN_SECONDS} &"],
        check=True,
    )
    orphans = _children(guest.pid)
    assert orphans, "the background sleep was not re-parented to the namespace's PID 1"
    deadline = time.monotonic() + WAIT
    while any(os.path.exists(f"/proc/{pid}") for pid in orphans):
        states = {pid: read_stat(pid)[0] for pid in orphans if os.path.exists(f"/proc/{pid}")}
        if time.monotonic() > deadline:
            pytest.fail(f"orphans not reaped: {states}")
        await asyncio.sleep(0.05)
    assert is_alive(guest)


async def test_sigterm_is_ignored_and_sigkill_ends_it(guest: ProcessRef) -> None:
    assert signal_process(guest, signal.SIGTERM)
    assert not await wait_gone(guest, 0.5)
    assert signal_process(guest, signal.SIGKILL)
    assert await wait_gone(guest, WAIT)


def test_a_failed_setup_says_why_and_leaves_nothing_running() -> None:
    before = set(_children(os.getpid()))
    with pytest.raises(pidone.PidOneError, match="Invalid argument"):
        pidone.start("x" * 100)  # longer than a hostname may be
    assert set(_children(os.getpid())) == before
