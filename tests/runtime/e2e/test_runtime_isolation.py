"""Pods are isolated from the host and from each other: UTS and network namespaces.

Each pod gets its own hostname and its own network namespace with only a loopback (what the
pause container gives a runc pod), so two pods may bind the same port on 127.0.0.1 and neither
can reach the other's.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
from runtime_e2e_support import POD_CLIENT, Pod, Pods, read_all, stream_target

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.streaming.client import PortForwardSession

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

SHARED_PORT = 7101
ONLY_B_PORT = 7102


async def exec_sync(rt: pb_grpc.RuntimeServiceStub, container: str, cmd: list[str]) -> bytes:
    response = await rt.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=cmd, timeout=10))
    assert (response.exit_code, response.stderr) == (0, b""), response
    return response.stdout


async def main_pid(rt: pb_grpc.RuntimeServiceStub, container: str) -> int:
    request = pb.ContainerStatusRequest(container_id=container, verbose=True)
    pid = json.loads((await rt.ContainerStatus(request)).info["info"])["pid"]
    assert isinstance(pid, int) and pid > 0
    return pid


async def pod_pid(rt: pb_grpc.RuntimeServiceStub, pod: Pod) -> int:
    request = pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id, verbose=True)
    pid = json.loads((await rt.PodSandboxStatus(request)).info["info"])["pid"]
    assert isinstance(pid, int) and pid > 0
    return pid


def ns_inode(pid: int | str, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


async def test_hostname_and_namespaces_differ_from_the_host(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    host_name = socket.gethostname()
    wanted = "iso-pod-host"
    assert wanted != host_name
    pod = await pods.run("iso-name", hostname=wanted)
    container = await pods.create(pod, "main", ["sleep", "1000"])

    assert await exec_sync(cri, container, ["hostname"]) == f"{wanted}\n".encode()
    assert socket.gethostname() == host_name  # setting the pod's name left the host's alone

    # The container's processes live in the pod's net and uts namespaces, not the host's.
    pid = await main_pid(cri, container)
    sandbox = await pod_pid(cri, pod)
    for kind in ("net", "uts", "ipc"):
        assert ns_inode(pid, kind) == ns_inode(sandbox, kind), kind
        assert ns_inode(pid, kind) != ns_inode("self", kind), kind
    # Seen from inside, too: an exec'd process is in the same namespace as the main process.
    inside = await exec_sync(cri, container, ["readlink", "/proc/self/ns/net"])
    assert inside == f"net:[{ns_inode(pid, 'net')}]\n".encode()
    # Only a loopback interface, and it is up (/proc/net is the reader's namespace; /sys is
    # not, since the container keeps the host's sysfs mount).
    dev = (await exec_sync(cri, container, ["cat", "/proc/net/dev"])).decode()
    assert [line.split(":")[0].strip() for line in dev.splitlines()[2:]] == ["lo"]
    link = (await exec_sync(cri, container, ["ip", "-o", "link", "show", "lo"])).decode()
    assert "UP" in link.split("<")[1].split(">")[0].split(","), link


async def forward_reply(rt: pb_grpc.RuntimeServiceStub, pod: Pod, port: int) -> bytes:
    url = (await rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[port]))).url
    endpoint, path = stream_target(url)
    session = await PortForwardSession.connect(endpoint, path)
    try:
        forwarded = await session.open(port)
        await forwarded.data.send_eof()
        return await read_all(forwarded.data)
    finally:
        await session.aclose()


async def test_pods_cannot_reach_each_others_loopback(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    a = await pods.run("iso-a")
    b = await pods.run("iso-b")
    # Both pods bind the same address and port: separate namespaces, no conflict.
    in_a = await pods.server(a, "srv", "reply", "127.0.0.1", SHARED_PORT, reply="from-a")
    await pods.server(b, "srv", "reply", "127.0.0.1", SHARED_PORT, reply="from-b")
    await pods.server(b, "only-b", "reply", "127.0.0.1", ONLY_B_PORT, reply="b-only")
    assert ns_inode(await pod_pid(cri, a), "net") != ns_inode(await pod_pid(cri, b), "net")

    client = [sys.executable, "-c", POD_CLIENT]
    assert await exec_sync(cri, in_a, [*client, str(SHARED_PORT)]) == b"from-a\n"
    assert await exec_sync(cri, in_a, [*client, str(ONLY_B_PORT)]) == b"refused\n"

    # Port-forward reaches each pod's own listener.
    assert await forward_reply(cri, a, SHARED_PORT) == b"from-a"
    assert await forward_reply(cri, b, SHARED_PORT) == b"from-b"
    assert await forward_reply(cri, b, ONLY_B_PORT) == b"b-only"
