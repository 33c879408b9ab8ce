"""The pod holder: real namespaces, a detached process, clean stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from podgate.linux import ns
from podgate.linux.holder import HolderError, start_holder, stop_holder
from podgate.linux.proc import is_alive, read_json, wait_gone
from podgate.model import ProcessRef

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates namespaces"),
]

Starter = Callable[..., Awaitable[tuple[ProcessRef, ProcessRef]]]


def _nsenter(pid: int, *args: str) -> str:
    return subprocess.run(
        ["nsenter", "-t", str(pid), *args], check=True, capture_output=True, text=True, timeout=10
    ).stdout


@pytest.fixture
async def holders(tmp_path: Path) -> AsyncIterator[Starter]:
    """start_holder with files in tmp_path; every holder started is stopped afterwards."""
    started: list[ProcessRef] = []

    async def start(hostname: str, pid_ns: bool, **kw: float) -> tuple[ProcessRef, ProcessRef]:
        index = len(started)
        refs = await start_holder(
            hostname,
            pid_ns,
            str(tmp_path / f"holder{index}.json"),
            str(tmp_path / f"holder{index}.log"),
            **kw,
        )
        started.append(refs[0])
        return refs

    yield start
    for ref in started:
        await stop_holder(ref)


async def test_holder_owns_new_net_uts_ipc_namespaces(holders: Starter, tmp_path: Path) -> None:
    holder, ns_proc = await holders("pod-one", False)
    assert holder == ns_proc
    assert is_alive(holder)
    assert read_json(str(tmp_path / "holder0.json")) == {
        "holder_pid": holder.pid,
        "ns_pid": holder.pid,
    }
    for kind in ("net", "uts", "ipc"):
        assert ns.ns_inode(ns.ns_path(holder.pid, kind)) != ns.ns_inode(f"/proc/self/ns/{kind}")
    for kind in ("pid", "mnt"):
        assert ns.ns_inode(ns.ns_path(holder.pid, kind)) == ns.ns_inode(f"/proc/self/ns/{kind}")
    assert _nsenter(holder.pid, "-u", "hostname") == "pod-one\n"
    assert os.uname().nodename != "pod-one"
    # lo is up: seen with the kernel's ioctl, and by iproute2.
    result: list[int] = []

    def flags() -> None:
        with ns.in_netns(ns.ns_path(holder.pid, "net")):
            result.append(ns.link_flags("lo"))

    thread = threading.Thread(target=flags)
    thread.start()
    thread.join()
    assert result[0] & ns.IFF_UP
    assert "<LOOPBACK,UP,LOWER_UP>" in _nsenter(holder.pid, "-n", "ip", "-o", "link", "show", "lo")
    # Detached: its own session, not our child.
    assert os.getsid(holder.pid) != os.getsid(0)
    assert os.getpgid(holder.pid) != os.getpgid(0)
    stat = Path(f"/proc/{holder.pid}/stat").read_text()
    assert int(stat[stat.rindex(")") + 2 :].split()[1]) != os.getpid()


async def test_stop_holder(holders: Starter, tmp_path: Path) -> None:
    holder, _ = await holders("pod-stop", False)
    await stop_holder(holder)
    assert not is_alive(holder)
    await stop_holder(holder)  # already gone: fine


async def test_pid_ns_holder(holders: Starter) -> None:
    holder, ns_proc = await holders("pod-pid", True)
    assert holder.pid != ns_proc.pid
    assert is_alive(holder) and is_alive(ns_proc)
    pod_pid_ns = ns.ns_inode(ns.ns_path(ns_proc.pid, "pid"))
    assert pod_pid_ns != ns.ns_inode("/proc/self/ns/pid")
    assert ns.ns_inode(f"/proc/{holder.pid}/ns/pid_for_children") == pod_pid_ns
    # The namespace process is PID 1 inside.
    status = Path(f"/proc/{ns_proc.pid}/status").read_text()
    assert f"NSpid:\t{ns_proc.pid}\t1\n" in status
    for kind in ("net", "uts", "ipc"):
        assert ns.ns_inode(ns.ns_path(ns_proc.pid, kind)) == ns.ns_inode(
            ns.ns_path(holder.pid, kind)
        )
    # A process joining the pod's PID namespace (with its own /proc) sees only PID 1 and
    # itself: nsenter's child is PID 2 and execs unshare, which execs sh.
    out = _nsenter(
        ns_proc.pid, "-p", "--", "unshare", "-m", "--mount-proc", "sh", "-c", "echo /proc/[0-9]*"
    )
    assert out.split() == ["/proc/1", "/proc/2"]
    assert _nsenter(ns_proc.pid, "-u", "hostname") == "pod-pid\n"
    await stop_holder(holder)
    assert not is_alive(holder)
    assert not is_alive(ns_proc)


async def test_pid_ns_holder_exits_with_its_init(holders: Starter) -> None:
    holder, ns_proc = await holders("pod-init", True)
    os.kill(ns_proc.pid, signal.SIGKILL)
    assert await wait_gone(holder, 5)


_PARENT = """
import asyncio, json, sys
from podgate.linux.holder import start_holder

async def main():
    holder, ns_proc = await start_holder("orphan", False, sys.argv[1], sys.argv[2])
    print(json.dumps([holder.pid, holder.start_time]), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_holder_survives_its_parent_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "h.json"), str(tmp_path / "h.log")],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    holder: ProcessRef | None = None
    try:
        line = parent.stdout.readline()
        holder = ProcessRef(*json.loads(line))
        assert is_alive(holder)
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(10) == -signal.SIGKILL
        assert not await wait_gone(holder, 0.3)
        assert is_alive(holder)
        assert _nsenter(holder.pid, "-u", "hostname") == "orphan\n"
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait()
        parent.stdout.close()
        if holder is not None:
            await stop_holder(holder)
    assert not is_alive(holder)


async def test_holder_failure_is_reported(tmp_path: Path) -> None:
    with pytest.raises(HolderError, match=r"(?s)no ready file .*\nFileNotFoundError: "):
        await start_holder(
            "x", False, str(tmp_path / "missing" / "h.json"), str(tmp_path / "h.log"), timeout=2
        )
