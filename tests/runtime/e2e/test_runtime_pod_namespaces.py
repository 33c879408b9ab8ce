"""A pod that does not share a PID namespace has no holder process: its net, IPC and UTS
namespaces are pinned by bind mounts in its run directory, which its removal takes away, and a
restarted daemon finds them again."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from runtime_e2e_support import Pods, RuntimeDaemon, mounts_under, running_daemon, state_root

from podgate.cri import api_pb2 as pb
from podgate.linux.proc import is_alive, process_ref
from podgate.runtime.store import RUN_NAME_CHARS

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

KINDS = ("net", "ipc", "uts")


def _pinned(root: Path) -> list[str]:
    """The namespace files mounted below `root` (the pods' run directories' `ns/`)."""
    return [p for p in mounts_under(root) if os.path.basename(os.path.dirname(p)) == "ns"]


def _inode(path: str) -> int:
    return os.stat(path).st_ino


async def _container_pid(rt: object, container_id: str) -> int:
    request = pb.ContainerStatusRequest(container_id=container_id, verbose=True)
    response = await rt.ContainerStatus(request)  # type: ignore[attr-defined]
    return int(json.loads(response.info["info"])["pid"])


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _nsfs_mounts(pid: int) -> list[str]:
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        return [line for line in f if line.partition(" - ")[2].startswith("nsfs ")]


async def test_pinned_namespaces_are_the_pods_and_go_with_it() -> None:
    with state_root() as root, running_daemon(root) as daemon:
        async with daemon.connect() as rt:
            pods = Pods(rt)
            pod = await pods.run("pinned", hostname="pinned", pid_mode=pb.CONTAINER)
            status = await rt.PodSandboxStatus(
                pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id, verbose=True)
            )
            assert status.status.state == pb.SANDBOX_READY
            info = json.loads(status.info["info"])
            assert (info["pid"], info["holderPid"]) == (0, 0), "no process holds the pod"
            files = {os.path.basename(p): p for p in _pinned(root) if pod.id[:RUN_NAME_CHARS] in p}
            assert sorted(files) == sorted(KINDS)

            container = await pods.create(pod, "main", ["sleep", "1000"])
            pid = await _container_pid(rt, container)
            for kind in KINDS:
                inside = _inode(f"/proc/{pid}/ns/{kind}")
                assert inside == _inode(files[kind]), kind
                assert inside != _inode(f"/proc/self/ns/{kind}"), kind
            response = await rt.ExecSync(
                pb.ExecSyncRequest(container_id=container, cmd=["hostname"], timeout=10)
            )
            assert (response.stdout, response.exit_code) == (b"pinned\n", 0)
            # Its shim (the container's parent) was forked from the daemon's shim forker.
            with open(f"/proc/{_ppid(pid)}/cmdline", "rb") as f:
                assert b"podgate.linux.forker" in f.read()

            # A second pod's container does not keep copies of the first pod's namespace
            # files in its mount namespace (they would outlive the first pod).
            other = await pods.run("other", pid_mode=pb.CONTAINER)
            assert len(_pinned(root)) == 2 * len(KINDS)
            other_pid = await _container_pid(
                rt, await pods.create(other, "main", ["sleep", "1000"])
            )
            assert _nsfs_mounts(other_pid) == []

            main = process_ref(pid)
            await pods.remove_all()
            assert not is_alive(main)
            assert mounts_under(root) == [], "a removed pod left its namespaces mounted"
            for path in files.values():
                assert not os.path.exists(path)


async def test_a_pod_whose_namespace_files_are_gone_is_not_ready() -> None:
    with state_root() as root, running_daemon(root) as daemon:
        async with daemon.connect() as rt:
            pods = Pods(rt)
            pod = await pods.run("unpinned", pid_mode=pb.CONTAINER)
            net = next(
                p for p in _pinned(root) if pod.id[:RUN_NAME_CHARS] in p and p.endswith("/net")
            )
            subprocess.run(["umount", "-l", net], check=True)
            status = await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id))
            assert status.status.state == pb.SANDBOX_NOTREADY
            await pods.remove_all()
            assert mounts_under(root) == []


async def test_pinned_namespaces_survive_a_killed_daemon() -> None:
    with state_root() as root:
        first = RuntimeDaemon.start(root / "s", root / "daemon.log")
        try:
            async with first.connect() as rt:
                pod = await Pods(rt).run("adopted", hostname="adopted", pid_mode=pb.CONTAINER)
                container = await Pods(rt).create(pod, "main", ["sleep", "1000"])
                pid = await _container_pid(rt, container)
        finally:
            first.kill()
        assert len(_pinned(root)) == len(KINDS)
        with running_daemon(root) as second:
            async with second.connect() as rt:
                request = pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id)
                assert (await rt.PodSandboxStatus(request)).status.state == pb.SANDBOX_READY
                response = await rt.ExecSync(
                    pb.ExecSyncRequest(container_id=container, cmd=["hostname"], timeout=10)
                )
                assert (response.stdout, response.exit_code) == (b"adopted\n", 0)
                # A new container joins the same namespaces.
                pods = Pods(rt)
                later = await _container_pid(rt, await pods.create(pod, "later", ["sleep", "1000"]))
                for kind in KINDS:
                    assert _inode(f"/proc/{later}/ns/{kind}") == _inode(f"/proc/{pid}/ns/{kind}")
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
                assert mounts_under(root) == []
