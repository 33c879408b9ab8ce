"""Pod and container lifecycle, ExecSync and container logs, over gRPC against `podgate runtime`.

CRI semantics checked here come from the cri-api (runtime.v1) contract: StopPodSandbox and
RemovePodSandbox/RemoveContainer are idempotent, a removed object is NOT_FOUND, list filters are
ANDed; exit codes of signalled processes are 128 + the signal number; log lines follow the CRI
logging format `<RFC3339Nano> <stream> <F|P> <content>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from runtime_e2e_support import (
    POLL_SECONDS,
    Pods,
    parse_cri_log,
    rpc_error,
    unknown_id,
    wait_for_log,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.linux.proc import is_alive, process_ref

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

MIB = 1024 * 1024
# The ExecSync output cap per stream (the kubelet's CRI message limit, 16 MiB).
EXEC_SYNC_CAP = 16 * MIB
SIGTERM_EXIT = 128 + 15
SIGKILL_EXIT = 128 + 9


async def pod_ids(rt: pb_grpc.RuntimeServiceStub, **fields: Any) -> list[str]:
    request = pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(**fields))
    return [p.id for p in (await rt.ListPodSandbox(request)).items]


async def container_ids(rt: pb_grpc.RuntimeServiceStub, **fields: Any) -> list[str]:
    request = pb.ListContainersRequest(filter=pb.ContainerFilter(**fields))
    return [c.id for c in (await rt.ListContainers(request)).containers]


async def test_version_and_status(cri: pb_grpc.RuntimeServiceStub) -> None:
    version = await cri.Version(pb.VersionRequest())
    assert (version.runtime_name, version.runtime_api_version) == ("podgate", "v1")
    status = (await cri.Status(pb.StatusRequest())).status
    conditions = {c.type: c.status for c in status.conditions}
    assert conditions == {"RuntimeReady": True, "NetworkReady": True}


async def test_pod_lifecycle_list_filters_and_idempotence(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    tier = uuid.uuid4().hex  # a label value no other pod carries
    before = time.time_ns()
    a = await pods.run("lc-a", labels={"app": "a", "tier": tier})
    b = await pods.run("lc-b", labels={"app": "b", "tier": tier})
    after = time.time_ns()
    assert a.id != b.id

    response = await cri.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=a.id, verbose=True)
    )
    status = response.status
    assert status.id == a.id
    assert status.state == pb.SANDBOX_READY
    assert status.metadata == a.config.metadata
    assert dict(status.labels) == {"app": "a", "tier": tier}
    assert before <= status.created_at <= after
    holder = process_ref(json.loads(response.info["info"])["holderPid"])
    assert is_alive(holder)

    # Filters: by id, by id prefix, by labels (ANDed), by state.
    assert await pod_ids(cri, id=a.id) == [a.id]
    assert await pod_ids(cri, id=a.id[:12]) == [a.id]
    assert await pod_ids(cri, id=unknown_id()) == []
    assert sorted(await pod_ids(cri, label_selector={"tier": tier})) == sorted([a.id, b.id])
    assert await pod_ids(cri, label_selector={"tier": tier, "app": "b"}) == [b.id]
    ready = pb.PodSandboxStateValue(state=pb.SANDBOX_READY)
    assert sorted(await pod_ids(cri, label_selector={"tier": tier}, state=ready)) == sorted(
        [a.id, b.id]
    )

    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=a.id))
    status = (await cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=a.id))).status
    assert status.state == pb.SANDBOX_NOTREADY
    assert not is_alive(holder)
    notready = pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)
    assert await pod_ids(cri, label_selector={"tier": tier}, state=notready) == [a.id]
    assert await pod_ids(cri, label_selector={"tier": tier}, state=ready) == [b.id]

    # Stopping a stopped pod succeeds and changes nothing.
    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=a.id))
    status = (await cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=a.id))).status
    assert status.state == pb.SANDBOX_NOTREADY

    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=a.id))
    error = await rpc_error(cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=a.id)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert await pod_ids(cri, label_selector={"tier": tier}) == [b.id]
    # Removing (or stopping) what is already gone, or never was, succeeds.
    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=a.id))
    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=a.id))
    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=unknown_id()))
    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=unknown_id()))

    # Removing a running pod stops it first.
    b_holder = process_ref(
        json.loads(
            (
                await cri.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=b.id, verbose=True)
                )
            ).info["info"]
        )["holderPid"]
    )
    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=b.id))
    assert not is_alive(b_holder)
    assert await pod_ids(cri, label_selector={"tier": tier}) == []


async def test_container_lifecycle_stop_escalation_and_idempotence(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("lc-containers")
    web = await pods.create(pod, "web", ["sleep", "1000"], start=False, labels={"role": "web"})
    status = await pods.status(web)
    assert status.state == pb.CONTAINER_CREATED
    assert status.metadata.name == "web"
    assert status.created_at > 0 and status.started_at == 0
    assert await container_ids(cri, pod_sandbox_id=pod.id) == [web]

    await cri.StartContainer(pb.StartContainerRequest(container_id=web))
    response = await cri.ContainerStatus(pb.ContainerStatusRequest(container_id=web, verbose=True))
    assert response.status.state == pb.CONTAINER_RUNNING
    assert response.status.started_at >= response.status.created_at
    main = process_ref(json.loads(response.info["info"])["pid"])
    assert is_alive(main)
    with open(f"/proc/{main.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[:2] == [b"sleep", b"1000"]

    # A container that ignores SIGTERM: StopContainer must escalate to SIGKILL after `timeout`.
    stubborn = await pods.create(
        pod, "stubborn", ["sh", "-c", "trap '' TERM; echo armed; while :; do sleep 0.1; done"]
    )
    await wait_for_log(cri, stubborn, b"armed")

    running = pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)
    exited = pb.ContainerStateValue(state=pb.CONTAINER_EXITED)
    assert await container_ids(cri, pod_sandbox_id=pod.id, state=running) == [web, stubborn]
    assert await container_ids(cri, pod_sandbox_id=pod.id, label_selector={"role": "web"}) == [web]
    assert await container_ids(cri, id=web[:12]) == [web]
    assert await container_ids(cri, id=web, pod_sandbox_id=unknown_id()) == []

    started = time.monotonic()
    await cri.StopContainer(pb.StopContainerRequest(container_id=web, timeout=10))
    # Below the 10 s grace: sleep dies of SIGTERM, no wait for SIGKILL.
    assert time.monotonic() - started < 9, "sleep dies of SIGTERM; no need to wait for SIGKILL"
    status = await pods.status(web)
    assert status.state == pb.CONTAINER_EXITED
    assert status.exit_code == SIGTERM_EXIT
    assert status.finished_at >= status.started_at
    assert not is_alive(main)

    started = time.monotonic()
    await cri.StopContainer(pb.StopContainerRequest(container_id=stubborn, timeout=1))
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 30, elapsed  # SIGKILL after the 1 s grace; generous under load
    status = await pods.status(stubborn)
    assert (status.state, status.exit_code) == (pb.CONTAINER_EXITED, SIGKILL_EXIT)

    # Stopping a stopped container succeeds and changes nothing.
    await cri.StopContainer(pb.StopContainerRequest(container_id=web, timeout=10))
    assert (await pods.status(web)).exit_code == SIGTERM_EXIT
    assert await container_ids(cri, pod_sandbox_id=pod.id, state=exited) == [web, stubborn]

    await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=web))
    error = await rpc_error(cri.ContainerStatus(pb.ContainerStatusRequest(container_id=web)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert await container_ids(cri, pod_sandbox_id=pod.id) == [stubborn]
    await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=web))
    await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=unknown_id()))


async def test_exec_sync_stdout_stderr_and_exit_code(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("execsync", hostname="execsync-host")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    response = await cri.ExecSync(
        pb.ExecSyncRequest(
            container_id=container,
            cmd=["sh", "-c", "printf 'out %s' \"$(hostname)\"; printf 'err\\n' >&2; exit 5"],
            timeout=10,
        )
    )
    assert (response.stdout, response.stderr, response.exit_code) == (
        b"out execsync-host",
        b"err\n",
        5,
    )
    response = await cri.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=["true"]))
    assert (response.stdout, response.stderr, response.exit_code) == (b"", b"", 0)
    response = await cri.ExecSync(
        pb.ExecSyncRequest(container_id=container, cmd=["sh", "-c", "kill -9 $$"], timeout=10)
    )
    assert response.exit_code == SIGKILL_EXIT


def processes_with_argv(argv: list[bytes]) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().split(b"\0")[: len(argv)] == argv:
                    found.append(int(entry))
        except OSError:
            continue
    return found


async def test_exec_sync_timeout_is_deadline_exceeded_and_kills_the_command(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("execsync-timeout")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    marker = [b"sleep", f"{900 + os.getpid() % 97}.25".encode()]  # a command no one else runs
    started = time.monotonic()
    error = await rpc_error(
        cri.ExecSync(
            pb.ExecSyncRequest(container_id=container, cmd=[m.decode() for m in marker], timeout=1),
            timeout=30,  # far longer: the deadline must be the runtime's, not the client's
        )
    )
    elapsed = time.monotonic() - started
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.9 <= elapsed < 25, elapsed  # the runtime's 1 s deadline, not the client's 30 s
    # The runtime kills the command's process group before answering; allow the kernel a
    # moment to tear the processes down.
    for _ in range(100):
        if not processes_with_argv(marker):
            break
        await asyncio.sleep(POLL_SECONDS)
    assert processes_with_argv(marker) == [], "the timed-out command is still running"


async def test_exec_sync_output_is_capped_at_16_mib(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("execsync-cap")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    line = b"0123456789abcde\n"  # 16 bytes: 20 MiB is a whole number of lines
    response = await cri.ExecSync(
        pb.ExecSyncRequest(
            container_id=container,
            cmd=["sh", "-c", f"yes {line.strip().decode()} | head -c {20 * MIB}"],
            timeout=30,
        )
    )
    assert response.exit_code == 0
    assert response.stderr == b""
    assert len(response.stdout) == EXEC_SYNC_CAP
    assert response.stdout == line * (EXEC_SYNC_CAP // len(line))


async def test_container_log_file_has_cri_format_lines(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, tmp_path: Path
) -> None:
    log_directory = tmp_path / "pod-logs"
    pod = await pods.run("logs", log_directory=str(log_directory))
    script = "echo out1; echo err1 >&2; echo out2; printf 'c\\r\\n'; printf tail; exit 4"
    container = await pods.create(pod, "writer", ["sh", "-c", script], log_path="writer/0.log")
    status = await pods.wait_state(container, pb.CONTAINER_EXITED)
    assert (status.exit_code, status.reason) == (4, "Error")
    expected_path = log_directory / "writer" / "0.log"
    assert status.log_path == str(expected_path)

    data = expected_path.read_bytes()
    entries = parse_cri_log(data)
    by_stream: dict[str, list[tuple[str, bytes]]] = {"stdout": [], "stderr": []}
    for timestamp, stream, tag, content in entries:
        assert status.created_at <= timestamp <= status.finished_at
        by_stream[stream].append((tag, content))
    # "\r\n" ends a line like "\n"; output left without a newline at EOF is a partial line.
    assert by_stream["stdout"] == [("F", b"out1"), ("F", b"out2"), ("F", b"c"), ("P", b"tail")]
    assert by_stream["stderr"] == [("F", b"err1")]
    assert [e[0] for e in entries] == sorted(e[0] for e in entries)

    # The pod's log directory is where the kubelet looks; the file is the caller's to delete
    # (the kubelet removes logs itself before RemoveContainer, as with containerd).
    await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=container))
    assert expected_path.read_bytes() == data
