"""Sandboxed pods through CRI: a second ("guest") set of namespaces where the containers run,
separate from the pod netns the runtime reports, and a shim that outlives the daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pods, RuntimeDaemon, read_all, wait_for_log
from sandbox_support import (
    pod_info,
    port_forward,
    run_pod,
    sandbox_daemon,
    shim_stats,
    start_daemon,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.linux.proc import is_alive
from podgate.model import ProcessRef

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

ECHO_PORT = 7101


def ns_inode(pid: int, kind: str = "net") -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state in the netns of `pid` (from its /proc/net/tcp and tcp6)."""
    ports = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def refs(info: dict[str, object]) -> dict[str, ProcessRef]:
    extra = info["extra"]
    assert isinstance(extra, dict)
    return {
        key: ProcessRef(**extra[key])
        for key in ("sandbox_shim", "guest_holder", "guest_ns_process")
    }


async def exec_sync(cri: pb_grpc.RuntimeServiceStub, container: str, cmd: list[str]) -> str:
    reply = await cri.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=cmd, timeout=10))
    assert reply.exit_code == 0, reply.stderr
    return reply.stdout.decode()


async def test_containers_run_in_the_guest_not_in_the_reported_netns(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await run_pod(pods, "sb-guest")
    container = await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    info = await pod_info(cri, pod)
    assert info["runtimeHandler"] == "sandboxed"
    reported, guest = int(info["pid"]), int(info["extra"]["guest_ns_pid"])
    assert ns_inode(reported) != ns_inode(guest)
    assert ns_inode(os.getpid()) not in {ns_inode(reported), ns_inode(guest)}
    # The container (seen from inside) is in the guest's network, UTS and IPC namespaces.
    for kind in ("net", "uts", "ipc"):
        link = (await exec_sync(cri, container, ["readlink", f"/proc/self/ns/{kind}"])).strip()
        assert link == f"{kind}:[{ns_inode(guest, kind)}]"
    assert (await exec_sync(cri, container, ["hostname"])).strip() == "sb-guest"
    # The reported netns is the host side of the VM: loopback only, nothing listening.
    assert ECHO_PORT in listening_ports(guest)
    assert listening_ports(reported) == set()
    # The shim, the guest holder and the guest's PID 1 run and are recorded.
    for ref in refs(info).values():
        assert is_alive(ref)
    assert ns_inode(refs(info)["guest_ns_process"].pid, "pid") != ns_inode(os.getpid(), "pid")


def _status(pid: int, key: str) -> list[str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(line for line in f if line.startswith(key + ":")).split()[1:]


def _children(parent: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_status(int(entry), "PPid")[0]) == parent:
                    found.add(int(entry))
            except (OSError, StopIteration):
                continue
    return found


async def test_a_sandbox_is_a_forked_shim_its_forked_agent_and_a_pausing_pid_one(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    # Per sandboxed pod: the shim (forked from the helper forker's second stage, the muxer in
    # it), the agent (the shim's only child, in the guest's network namespace) and the guest's
    # PID 1 (holder and namespace process at once: no interpreter, podgate's pause program in
    # an empty root, so the pod's processes reach nothing of the node through /proc/1/root).
    pod = await run_pod(pods, "sb-procs")
    await pods.create(pod, "sleep", ["sleep", "1000"])
    found = refs(await pod_info(cri, pod))
    shim, guest = found["sandbox_shim"], found["guest_ns_process"]
    assert found["guest_holder"] == guest
    assert _status(guest.pid, "NSpid")[-1] == "1"
    with open(f"/proc/{guest.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0] == b"pause"
    assert os.listdir(f"/proc/{guest.pid}/root") == []
    with open(f"/proc/{shim.pid}/cmdline", "rb") as f:
        assert b"podgate.linux.forker" in f.read()
    agent = (await shim_stats(sandbox_runtime, pod)).agent_pid
    assert _children(shim.pid) == {agent}
    assert ns_inode(agent) == ns_inode(guest.pid) != ns_inode(shim.pid)
    assert ns_inode(agent, "pid") == ns_inode(shim.pid, "pid")  # not a process of the pod's


async def test_removing_the_pod_stops_the_shim_and_the_guest(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: object
) -> None:
    pod = await run_pod(pods, "sb-remove")
    await pods.create(pod, "sleep", ["sleep", "1000"])
    recorded = refs(await pod_info(cri, pod))
    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
    for name, ref in recorded.items():
        assert not is_alive(ref), f"{name} still runs after StopPodSandbox"
    status = await cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id))
    assert status.status.state == pb.SANDBOX_NOTREADY
    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
    pods.created.remove(pod.id)


async def test_sandbox_survives_a_daemon_restart() -> None:
    with sandbox_daemon() as daemon:
        async with daemon.connect() as rt:
            pods = Pods(rt)
            pod = await run_pod(pods, "sb-restart")
            await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
            shim = refs(await pod_info(rt, pod))["sandbox_shim"]
        daemon.kill()  # a crash: nothing is cleaned up
        assert is_alive(shim)
        restarted = start_daemon(daemon.state_dir, daemon.output)
        daemon.process = restarted.process
        daemon.cri_socket, daemon.streaming_base = restarted.cri_socket, restarted.streaming_base
        async with daemon.connect() as rt:
            info = await pod_info(rt, pod)
            assert refs(info)["sandbox_shim"] == shim  # adopted, not restarted
            session = await port_forward(rt, pod, [ECHO_PORT])
            try:
                async with asyncio.timeout(WAIT_SECONDS):
                    forwarded = await session.open(ECHO_PORT)
                    await forwarded.data.send(b"after restart")
                    await forwarded.data.send_eof()
                    assert await read_all(forwarded.data) == b"after restart"
                    assert await forwarded.error() == ""
            finally:
                await session.aclose()
            assert (await shim_stats(daemon, pod)).agent_port_forwards == 1


async def test_exec_and_attach_work_unchanged_in_the_guest(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await run_pod(pods, "sb-exec")
    container = await pods.create(pod, "sh", ["sh", "-c", "echo started; sleep 1000"])
    await wait_for_log(cri, container, b"started")
    out = await exec_sync(cri, container, ["sh", "-c", "cat /proc/net/tcp | wc -l; hostname"])
    assert out.split() == ["1", "sb-exec"]  # the header line only: nothing listens in the guest


def test_a_shim_refuses_to_adopt_a_guest_that_is_gone(tmp_path: Path) -> None:
    # PID 1 with a start time it never had: not the recorded guest.
    ready = tmp_path / "sandbox.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "podgate.runtime.sandbox.shim",
            "--dir",
            str(tmp_path),
            "--ready-file",
            str(ready),
            "--foreground",
            "--adopt-guest",
            "1:999999999:1:999999999",
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert json.loads(ready.read_text()) == {
        "error": "sandbox shim: the sandbox's guest is gone; nothing to adopt"
    }
