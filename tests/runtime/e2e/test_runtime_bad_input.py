"""What the runtime answers to requests it cannot honour, and what a crash leaves on disk.

Status codes follow the cri-api contract as containerd implements it: an id that names nothing
is NOT_FOUND, a malformed request INVALID_ARGUMENT (the streaming server's GetExec rules: tty
with stderr, or no stream at all, are refused), and an operation that needs a running container
or a ready pod fails with FAILED_PRECONDITION.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from runtime_e2e_support import (
    Pods,
    RuntimeDaemon,
    Sink,
    rpc_error,
    running_daemon,
    state_root,
    stream_target,
    unknown_id,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.model import PodMetadata, PodRecord, PodState
from podgate.runtime.store import Store
from podgate.streaming.client import exec_spdy, exec_websocket
from process_support import processes_mentioning
from udp_support import wait_until

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

# How long a failed pod's processes may take to be gone (generous under load), seconds.
PROCESS_EXIT_SECONDS = 10.0
# Linux's MAX_ARG_STRLEN (32 pages): one longer argument makes execve fail with E2BIG.
TOO_LONG_ARGUMENT = 200_000


async def test_unknown_ids_are_not_found(cri: pb_grpc.RuntimeServiceStub, pods: Pods) -> None:
    pod = await pods.run("bad-ids")
    nobody, nothing = unknown_id(), unknown_id()
    calls: list[Awaitable[object]] = [
        cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=nobody)),
        cri.PortForward(pb.PortForwardRequest(pod_sandbox_id=nobody, port=[80])),
        cri.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=nobody,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="c"), command=["true"]
                ),
                sandbox_config=pod.config,
            )
        ),
        cri.ContainerStatus(pb.ContainerStatusRequest(container_id=nothing)),
        cri.StartContainer(pb.StartContainerRequest(container_id=nothing)),
        cri.StopContainer(pb.StopContainerRequest(container_id=nothing, timeout=1)),
        cri.ExecSync(pb.ExecSyncRequest(container_id=nothing, cmd=["true"])),
        cri.Exec(pb.ExecRequest(container_id=nothing, cmd=["true"], stdout=True)),
        cri.Attach(pb.AttachRequest(container_id=nothing, stdout=True)),
    ]
    for call in calls:
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
    # The pod that does exist is untouched.
    status = (await cri.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id))).status
    assert status.state == pb.SANDBOX_READY


async def test_malformed_requests_are_invalid_argument(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("bad-requests")
    container = await pods.create(pod, "main", ["sleep", "1000"])

    def create(config: pb.ContainerConfig) -> Awaitable[object]:
        return cri.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            )
        )

    calls: dict[str, Awaitable[object]] = {
        "no pod config": cri.RunPodSandbox(pb.RunPodSandboxRequest()),
        "no pod metadata": cri.RunPodSandbox(
            pb.RunPodSandboxRequest(config=pb.PodSandboxConfig(hostname="x"))
        ),
        "no pod name": cri.RunPodSandbox(
            pb.RunPodSandboxRequest(
                config=pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(namespace="e2e"))
            )
        ),
        "empty pod id": cri.StopPodSandbox(pb.StopPodSandboxRequest()),
        "no container metadata": create(pb.ContainerConfig(command=["true"])),
        "empty command": create(pb.ContainerConfig(metadata=pb.ContainerMetadata(name="c"))),
        "empty container id": cri.ContainerStatus(pb.ContainerStatusRequest()),
        "empty exec-sync command": cri.ExecSync(pb.ExecSyncRequest(container_id=container)),
        "negative timeout": cri.ExecSync(
            pb.ExecSyncRequest(container_id=container, cmd=["true"], timeout=-1)
        ),
        "empty exec command": cri.Exec(pb.ExecRequest(container_id=container, stdout=True)),
        "exec tty and stderr": cri.Exec(
            pb.ExecRequest(container_id=container, cmd=["sh"], tty=True, stdout=True, stderr=True)
        ),
        "exec without streams": cri.Exec(pb.ExecRequest(container_id=container, cmd=["true"])),
        "attach tty and stderr": cri.Attach(
            pb.AttachRequest(container_id=container, tty=True, stdout=True, stderr=True)
        ),
        "port 0": cri.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[0])),
        "port 65536": cri.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[65536])),
    }
    codes = {}
    for name, call in calls.items():
        codes[name] = (await rpc_error(call)).code()
    assert codes == dict.fromkeys(calls, grpc.StatusCode.INVALID_ARGUMENT)
    # None of it created anything.
    listed = await cri.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod.id))
    )
    assert [c.id for c in listed.containers] == [container]


async def test_stopped_container_and_pod_are_failed_precondition(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("bad-stopped")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    await cri.StopContainer(pb.StopContainerRequest(container_id=container, timeout=5))
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "exec-sync": lambda: cri.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=["true"])),
        "exec": lambda: cri.Exec(pb.ExecRequest(container_id=container, cmd=["true"], stdout=True)),
        "attach": lambda: cri.Attach(pb.AttachRequest(container_id=container, stdout=True)),
        "start again": lambda: cri.StartContainer(pb.StartContainerRequest(container_id=container)),
    }
    for name, call in calls.items():
        assert (await rpc_error(call())).code() == grpc.StatusCode.FAILED_PRECONDITION, name

    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
    error = await rpc_error(cri.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=[1])))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="late"), command=["true"])
    error = await rpc_error(
        cri.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            )
        )
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_exec_url_of_a_container_stopped_since_reports_an_error(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("bad-stopped-later")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    # The client opens stdout and stderr streams, so the request asks for both.
    request = pb.ExecRequest(container_id=container, cmd=["true"], stdout=True, stderr=True)
    url = (await cri.Exec(request)).url
    await cri.StopContainer(pb.StopContainerRequest(container_id=container, timeout=5))
    endpoint, path = stream_target(url)
    result = await exec_spdy(endpoint, path, stdout=Sink(), stderr=Sink())
    assert result.exit_code != 0
    assert result.error is not None and "not running" in result.error, result


@pytest.mark.parametrize("transport", ["spdy", "websocket"])
async def test_streaming_exec_that_cannot_start_is_not_reported_as_success(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, transport: str
) -> None:
    pod = await pods.run(f"bad-exec-{transport}")
    container = await pods.create(pod, "main", ["sleep", "1000"])
    cmd = ["echo", "x" * TOO_LONG_ARGUMENT]
    # ExecSync of the same command fails (execve says E2BIG)...
    error = await rpc_error(cri.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=cmd)))
    assert error.code() == grpc.StatusCode.INTERNAL
    # ...so the streaming exec must report a failure too, not a clean exit 0.
    request = pb.ExecRequest(container_id=container, cmd=cmd, stdout=True, stderr=True)
    endpoint, path = stream_target((await cri.Exec(request)).url)
    run = exec_spdy if transport == "spdy" else exec_websocket
    stdout = Sink()
    result = await run(endpoint, path, stdout=stdout, stderr=Sink())
    assert stdout.data == b""
    assert result.exit_code != 0 and result.error, result


# A state write that dies between writing its temporary file and renaming it into place.
CRASHING_WRITER = r"""
import os, signal, sys
from podgate.model import PodMetadata, PodRecord, PodState
from podgate.runtime.store import Store

store = Store(sys.argv[1])
record = PodRecord(
    id=sys.argv[2], metadata=PodMetadata("crash", "e2e", "uid-1"), state=PodState.READY,
    created_at=1, hostname="old",
)
store.save_pod(record)

def die(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)

os.replace = os.rename = die
record.state, record.hostname = PodState.NOTREADY, "new"
store.save_pod(record)
"""


def test_crash_in_a_state_write_leaves_the_old_record(tmp_path: Path) -> None:
    state = tmp_path / "state"
    pod_id = "c" * 64
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(state), pod_id],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()

    pods_dir = state / "pods"
    record_path = pods_dir / f"{pod_id}.json"
    leftovers = [p for p in pods_dir.iterdir() if p != record_path]
    assert len(leftovers) == 1, leftovers
    # The crash came after the new record was fully written, before it replaced the old one.
    assert json.loads(leftovers[0].read_text())["hostname"] == "new"
    assert json.loads(record_path.read_text())["hostname"] == "old"

    loaded_pods, loaded_containers = Store(state).load()
    assert loaded_pods == [
        PodRecord(
            id=pod_id,
            metadata=PodMetadata("crash", "e2e", "uid-1"),
            state=PodState.READY,
            created_at=1,
            hostname="old",
        )
    ]
    assert loaded_containers == []
    assert sorted(pods_dir.iterdir()) == [record_path], "the temporary file was not cleaned up"


async def test_a_pod_that_fails_to_start_leaves_nothing_behind(
    runtime_daemon: RuntimeDaemon, cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    # The kernel refuses a hostname over 64 bytes: the pod's holder cannot set it up.
    run_root = Store(runtime_daemon.state_dir).run_dir
    before = sorted(run_root.iterdir())
    error = await rpc_error(pods.run("bad-hostname", hostname="h" * 65))
    assert error.code() != grpc.StatusCode.OK
    assert sorted(run_root.iterdir()) == before, "a run directory was left behind"
    listed = await cri.ListPodSandbox(pb.ListPodSandboxRequest())
    assert [p.metadata.name for p in listed.items if p.metadata.name == "bad-hostname"] == []
    # The holder that failed may still be exiting when the error arrives: give it a moment.
    await wait_until(
        lambda: processes_mentioning("h" * 65) == [],
        "the failed pod's processes are gone",
        timeout=PROCESS_EXIT_SECONDS,
    )


async def test_a_pod_that_fails_after_its_files_are_made_leaves_no_mount(tmp_path: Path) -> None:
    # podgate's CNI plugin (NRI) with no CNI binaries to run: RunPodSandbox fails at the network
    # step, after the pod's namespaces and files (its /dev/shm tmpfs) exist. No binary runs,
    # so no interface or address is made either.
    empty, confs, plugins = tmp_path / "no-cni", tmp_path / "conf.d", tmp_path / "plugins"
    for directory in (empty, confs, plugins):
        directory.mkdir()
    conf = {"state_dir": str(tmp_path / "cni"), "plugin_dirs": str(empty)}
    (confs / "10-cni.conf").write_text(json.dumps(conf))
    args = (
        *("--network", "nri", "--nri-config-dir", str(confs)),
        *("--nri-plugin-dir", str(plugins), "--nri-plugin", "cni"),
    )
    with state_root() as root, running_daemon(root, args) as daemon:
        run_root = Store(daemon.state_dir).run_dir
        before = sorted(run_root.iterdir())
        async with daemon.connect() as cri:
            error = await rpc_error(Pods(cri).run("no-network"))
        assert error.code() != grpc.StatusCode.OK
        assert "NRI RunPodSandbox failed" in (error.details() or ""), error.details()
        with open("/proc/self/mountinfo") as mounts:
            left = [f[4] for f in (line.split() for line in mounts) if str(run_root) in f[4]]
        assert left == [], f"the failed pod left mounts behind: {left}"
        assert sorted(run_root.iterdir()) == before, "a run directory was left behind"
