"""The CRI services over real gRPC on a real unix socket, in front of an in-memory runtime.

Wire numbers come from the reference (k8s-streaming.md §8, runtime-and-nri.md §8.1) and the
upstream cri-api proto; the rest checks that every field makes the round trip unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.images.store import ImageStore
from podgate.linux.netdev import InterfaceCounters
from podgate.model import (
    ContainerMetadata,
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    NamespaceMode,
    PodMetadata,
    PodRecord,
    PodState,
    ProcessRef,
)
from podgate.runtime.api import (
    DeadlineExceededError,
    ExecSyncResult,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PodConfig,
    PodUsage,
    ResourceExhaustedError,
    RuntimeApi,
    RuntimeCondition,
)
from podgate.runtime.cri import convert
from podgate.runtime.cri.errors import status_code
from podgate.runtime.cri.service import serve_cri, stop_cri
from podgate.runtime.events import ContainerEvent, ContainerEvents, ContainerEventType

CREATED_BASE = 1_700_000_000_123_456_789  # arbitrary creation time, ns
STREAM_BASE = "http://127.0.0.1:10010"

# ----------------------------------------------------------------------------- fake runtime


class FakeRuntime:
    """RuntimeApi in memory. Records every call; `fail[method]` makes that method raise."""

    name = "fake"
    version = "9.8.7"

    def __init__(self) -> None:
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, BaseException] = {}
        self.exec_result = ExecSyncResult(stdout=b"", stderr=b"", exit_code=0)
        self.runtime_conditions = [
            RuntimeCondition("RuntimeReady", True),
            RuntimeCondition("NetworkReady", True),
        ]
        self.next_ip = "10.88.0.7"
        self.next_additional_ips = ["fd00:10:88::7"]
        self.pod_cidr = ""
        self._count = 0
        self.events = ContainerEvents()
        self.usage = PodUsage(timestamp=CREATED_BASE)

    def _call(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))
        if method in self.fail:
            raise self.fail[method]

    def _next(self, kind: str) -> tuple[str, int]:
        self._count += 1
        return f"{kind}{self._count:04d}abcdef", CREATED_BASE + self._count

    @staticmethod
    def _lookup(table: Mapping[str, Any], prefix: str, kind: str) -> Any:
        if prefix in table:
            return table[prefix]
        found = [key for key in table if key.startswith(prefix)]
        if len(found) != 1:
            raise NotFoundError(f"{kind} {prefix!r} not found")
        return table[found[0]]

    async def run_pod(self, config: PodConfig) -> str:
        self._call("run_pod", config)
        pod_id, created = self._next("pod")
        self.pods[pod_id] = PodRecord(
            id=pod_id,
            metadata=config.metadata,
            state=PodState.READY,
            created_at=created,
            hostname=config.hostname,
            log_directory=config.log_directory,
            runtime_handler=config.runtime_handler,
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            pid_mode=config.pid_mode,
            ip=self.next_ip,
            additional_ips=list(self.next_additional_ips),
        )
        return pod_id

    async def stop_pod(self, pod_id: str) -> None:
        self._call("stop_pod", pod_id)
        if pod_id in self.pods:
            self.pods[pod_id].state = PodState.NOTREADY

    async def remove_pod(self, pod_id: str) -> None:
        self._call("remove_pod", pod_id)
        self.pods.pop(pod_id, None)
        for cid in [c.id for c in self.containers.values() if c.pod_id == pod_id]:
            del self.containers[cid]

    def get_pod(self, pod_id: str) -> PodRecord:
        self._call("get_pod", pod_id)
        return self._lookup(self.pods, pod_id, "pod")  # type: ignore[no-any-return]

    def list_pods(self) -> list[PodRecord]:
        self._call("list_pods")
        return list(self.pods.values())

    async def pod_network(self, pod: PodRecord) -> tuple[str, list[str]]:
        return pod.ip, list(pod.additional_ips)

    async def create_container(
        self,
        pod_id: str,
        metadata: ContainerMetadata,
        spec: ContainerSpec,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        self._call("create_container", pod_id, metadata, spec, labels, annotations)
        pod = self._lookup(self.pods, pod_id, "pod")
        container_id, created = self._next("ctr")
        self.containers[container_id] = ContainerRecord(
            id=container_id,
            pod_id=pod.id,
            metadata=metadata,
            spec=spec,
            state=ContainerState.CREATED,
            created_at=created,
            log_file=os.path.join(pod.log_directory, spec.log_path) if spec.log_path else "",
            labels=dict(labels),
            annotations=dict(annotations),
        )
        return container_id

    async def start_container(self, container_id: str) -> None:
        self._call("start_container", container_id)
        container = self._lookup(self.containers, container_id, "container")
        container.state = ContainerState.RUNNING

    async def stop_container(self, container_id: str, timeout: float) -> None:
        self._call("stop_container", container_id, timeout)

    async def remove_container(self, container_id: str) -> None:
        self._call("remove_container", container_id)
        self.containers.pop(container_id, None)

    def get_container(self, container_id: str) -> ContainerRecord:
        self._call("get_container", container_id)
        return self._lookup(self.containers, container_id, "container")  # type: ignore[no-any-return]

    def list_containers(self) -> list[ContainerRecord]:
        self._call("list_containers")
        return list(self.containers.values())

    async def exec_sync(
        self, container_id: str, command: Sequence[str], timeout: float
    ) -> ExecSyncResult:
        self._call("exec_sync", container_id, list(command), timeout)
        return self.exec_result

    def exec_url(
        self,
        container_id: str,
        command: Sequence[str],
        *,
        tty: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> str:
        self._call("exec_url", container_id, list(command), tty, stdin, stdout, stderr)
        return f"{STREAM_BASE}/exec/AbCdEf01"

    def attach_url(
        self, container_id: str, *, tty: bool, stdin: bool, stdout: bool, stderr: bool
    ) -> str:
        self._call("attach_url", container_id, tty, stdin, stdout, stderr)
        return f"{STREAM_BASE}/attach/AbCdEf02"

    def port_forward_url(self, pod_id: str, ports: Sequence[int]) -> str:
        self._call("port_forward_url", pod_id, list(ports))
        return f"{STREAM_BASE}/portforward/AbCdEf03"

    async def pod_usage(self, pod: PodRecord) -> PodUsage:
        self._call("pod_usage", pod.id)
        return self.usage

    def conditions(self) -> list[RuntimeCondition]:
        self._call("conditions")
        return self.runtime_conditions

    def update_runtime_config(self, pod_cidr: str) -> None:
        self._call("update_runtime_config", pod_cidr)
        self.pod_cidr = pod_cidr

    async def update_pod_resources(
        self, pod_id: str, overhead: Mapping[str, object], resources: Mapping[str, object]
    ) -> None:
        self._call("update_pod_resources", pod_id, dict(overhead), dict(resources))
        pod = self._lookup(self.pods, pod_id, "pod")
        pod.overhead, pod.resources = dict(overhead), dict(resources)

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == method]


def _conforms(runtime: FakeRuntime) -> RuntimeApi:
    return runtime


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Cri:
    runtime: FakeRuntime
    rt: pb_grpc.RuntimeServiceAsyncStub
    img: pb_grpc.ImageServiceAsyncStub
    channel: grpc.aio.Channel
    socket_path: str
    state_dir: str
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def short_dir() -> Any:
    # sun_path is 108 bytes; pytest's tmp_path can be longer than that.
    path = tempfile.mkdtemp(prefix="pgcri-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def cri(short_dir: str) -> AsyncIterator[Cri]:
    runtime = FakeRuntime()
    socket_path = os.path.join(short_dir, "cri.sock")
    server = await serve_cri(_conforms(runtime), socket_path, images=ImageStore(short_dir))
    channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
    try:
        yield Cri(
            runtime,
            pb_grpc.RuntimeServiceStub(channel),
            pb_grpc.ImageServiceStub(channel),
            channel,
            socket_path,
            short_dir,
        )
    finally:
        await channel.close()
        await stop_cri(server, socket_path, grace=0)


async def expect_status(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def pod_request(
    name: str = "web-0",
    *,
    labels: Mapping[str, str] | None = None,
    pid: pb.NamespaceMode.ValueType = pb.CONTAINER,
) -> pb.RunPodSandboxRequest:
    return pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, uid=f"uid-{name}", namespace="shop", attempt=2
            ),
            hostname=f"{name}-host",
            log_directory=f"/var/log/pods/shop_{name}_uid-{name}",
            labels=dict(labels or {"app": "web"}),
            annotations={"kubernetes.io/config.seen": "2026-01-01T00:00:00Z", "a/b": "c=d"},
            linux=pb.LinuxPodSandboxConfig(
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.POD, pid=pid, ipc=pb.POD)
                )
            ),
        ),
        runtime_handler="runc",
    )


def container_config(name: str = "app", **overrides: Any) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=3),
        image=pb.ImageSpec(image="docker.io/library/busybox:1.36"),
        command=["/bin/sh", "-c"],
        args=["echo hi; sleep 3600"],
        working_dir="/srv",
        envs=[pb.KeyValue(key="A", value="1"), pb.KeyValue(key="B", value="x=y")],
        mounts=[
            pb.Mount(
                container_path="/data",
                host_path="/var/lib/data",
                readonly=True,
                propagation=pb.PROPAGATION_HOST_TO_CONTAINER,
            )
        ],
        labels={"io.kubernetes.container.name": name, "tier": "front"},
        annotations={"io.kubernetes.container.restartCount": "3"},
        log_path=f"{name}/3.log",
        stdin=True,
        stdin_once=True,
        tty=True,
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(
                run_as_user=pb.Int64Value(value=1000),
                run_as_group=pb.Int64Value(value=2000),
                namespace_options=pb.NamespaceOption(pid=pb.POD),
            )
        ),
    )
    for key, value in overrides.items():
        getattr(config, key).CopyFrom(value)
    return config


async def run_pod(cri: Cri, name: str = "web-0", **kwargs: Any) -> str:
    response = await cri.rt.RunPodSandbox(pod_request(name, **kwargs))
    return response.pod_sandbox_id


async def create_container(cri: Cri, pod_id: str, name: str = "app") -> str:
    response = await cri.rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=container_config(name))
    )
    return response.container_id


# ----------------------------------------------------------------------------- wire contract


def test_package_and_service_names_are_upstream() -> None:
    runtime = pb.DESCRIPTOR.services_by_name["RuntimeService"]
    image = pb.DESCRIPTOR.services_by_name["ImageService"]
    assert pb.DESCRIPTOR.package == "runtime.v1"
    assert runtime.full_name == "runtime.v1.RuntimeService"
    assert image.full_name == "runtime.v1.ImageService"
    assert {m.name for m in runtime.methods} == {
        "Version",
        "Status",
        "UpdateRuntimeConfig",
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "PodSandboxStatus",
        "ListPodSandbox",
        "CreateContainer",
        "StartContainer",
        "StopContainer",
        "RemoveContainer",
        "ListContainers",
        "ContainerStatus",
        "UpdateContainerResources",
        "ReopenContainerLog",
        "ExecSync",
        "Exec",
        "Attach",
        "PortForward",
        "ContainerStats",
        "ListContainerStats",
        "PodSandboxStats",
        "ListPodSandboxStats",
        "GetContainerEvents",
        "RuntimeConfig",
        "UpdatePodSandboxResources",
    }
    assert runtime.methods_by_name["Exec"].input_type.full_name == "runtime.v1.ExecRequest"
    assert {m.name for m in image.methods} == {
        "ListImages",
        "ImageStatus",
        "PullImage",
        "RemoveImage",
        "ImageFsInfo",
    }


def test_exec_request_field_numbers() -> None:
    # k8s-streaming.md §8: container_id 1, cmd 2, tty 3, stdin 4, stdout 5, stderr 6.
    request = pb.ExecRequest(container_id="c", cmd=["sh"], tty=True, stdin=True, stdout=True)
    assert request.SerializeToString() == b"\x0a\x01c\x12\x02sh\x18\x01\x20\x01\x28\x01"
    assert pb.ExecRequest(stderr=True).SerializeToString() == b"\x30\x01"


def test_update_pod_sandbox_resources_field_numbers() -> None:
    # Upstream: pod_sandbox_id = 1, overhead = 2, resources = 3 (LinuxContainerResources, whose
    # cpu_shares is 3 and memory_limit_in_bytes 4); the response is empty.
    request = pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id="p",
        overhead=pb.LinuxContainerResources(cpu_shares=2),
        resources=pb.LinuxContainerResources(memory_limit_in_bytes=1),
    )
    assert request.SerializeToString() == b"\x0a\x01p\x12\x02\x18\x02\x1a\x02\x20\x01"
    assert pb.UpdatePodSandboxResourcesResponse().SerializeToString() == b""


def test_attach_request_numbers_differ_from_exec() -> None:
    # k8s-streaming.md §8: Attach puts stdin (2) before tty (3); stdout 4, stderr 5.
    assert pb.AttachRequest(stdin=True).SerializeToString() == b"\x10\x01"
    assert pb.AttachRequest(tty=True).SerializeToString() == b"\x18\x01"
    assert pb.AttachRequest(stdout=True).SerializeToString() == b"\x20\x01"
    assert pb.AttachRequest(stderr=True).SerializeToString() == b"\x28\x01"


def test_port_forward_request_is_packed_int32() -> None:
    # runtime-and-nri.md §1.1: pod_sandbox_id = 1, repeated int32 port = 2 (packed in proto3).
    wire = pb.PortForwardRequest(pod_sandbox_id="p", port=[80, 8080]).SerializeToString()
    assert wire == b"\x0a\x01p\x12\x03\x50\x90\x3f"
    assert pb.PortForwardResponse(url="u").SerializeToString() == b"\x0a\x01u"


def test_pod_sandbox_status_network_is_field_5() -> None:
    # runtime-and-nri.md §8.1: network = 5, PodSandboxNetworkStatus{ip = 1, additional_ips = 2},
    # PodIP{ip = 1}.
    status = pb.PodSandboxStatus(
        network=pb.PodSandboxNetworkStatus(ip="10.0.0.1", additional_ips=[pb.PodIP(ip="fd00::1")])
    )
    assert status.SerializeToString() == b"\x2a\x15\x0a\x0810.0.0.1\x12\x09\x0a\x07fd00::1"
    # created_at = 4 (int64), runtime_handler = 9; request: pod_sandbox_id 1, verbose 2.
    assert pb.PodSandboxStatus(created_at=1).SerializeToString() == b"\x20\x01"
    assert pb.PodSandboxStatus(runtime_handler="r").SerializeToString() == b"\x4a\x01r"
    request = pb.PodSandboxStatusRequest(pod_sandbox_id="x", verbose=True)
    assert request.SerializeToString() == b"\x0a\x01x\x10\x01"
    # Response: status 1, info 2, containers_statuses 3, timestamp 4.
    assert pb.PodSandboxStatusResponse(timestamp=1).SerializeToString() == b"\x20\x01"
    response = pb.PodSandboxStatusResponse(containers_statuses=[pb.ContainerStatus()])
    assert response.SerializeToString() == b"\x1a\x00"


def test_pod_sandbox_state_values() -> None:
    # runtime-and-nri.md §8.1: SANDBOX_READY = 0, SANDBOX_NOTREADY = 1.
    assert (pb.SANDBOX_READY, pb.SANDBOX_NOTREADY) == (0, 1)


# ----------------------------------------------------------------------------- runtime info


async def test_version(cri: Cri) -> None:
    response = await cri.rt.Version(pb.VersionRequest(version="v1"))
    assert response == pb.VersionResponse(
        version="0.1.0",
        runtime_name="podgate",
        runtime_version="9.8.7",
        runtime_api_version="v1",
    )


async def test_status_reports_runtime_conditions(cri: Cri) -> None:
    cri.runtime.runtime_conditions = [
        RuntimeCondition("RuntimeReady", True),
        RuntimeCondition("NetworkReady", False, "NetworkPluginNotReady", "cni not initialized"),
    ]
    response = await cri.rt.Status(pb.StatusRequest())
    assert list(response.status.conditions) == [
        pb.RuntimeCondition(type="RuntimeReady", status=True),
        pb.RuntimeCondition(
            type="NetworkReady",
            status=False,
            reason="NetworkPluginNotReady",
            message="cni not initialized",
        ),
    ]


async def test_update_runtime_config_passes_pod_cidr(cri: Cri) -> None:
    cidr = "10.244.1.0/24,fd00:10:244:1::/64"
    request = pb.UpdateRuntimeConfigRequest(
        runtime_config=pb.RuntimeConfig(network_config=pb.NetworkConfig(pod_cidr=cidr))
    )
    assert await cri.rt.UpdateRuntimeConfig(request) == pb.UpdateRuntimeConfigResponse()
    assert cri.runtime.called("update_runtime_config") == [(cidr,)]


# ----------------------------------------------------------------------------- pod sandboxes


async def test_run_pod_sandbox_passes_the_config(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    assert pod_id == "pod0001abcdef"
    [(config,)] = cri.runtime.called("run_pod")
    assert config == PodConfig(
        metadata=PodMetadata(name="web-0", namespace="shop", uid="uid-web-0", attempt=2),
        hostname="web-0-host",
        log_directory="/var/log/pods/shop_web-0_uid-web-0",
        labels={"app": "web"},
        annotations={"kubernetes.io/config.seen": "2026-01-01T00:00:00Z", "a/b": "c=d"},
        pid_mode=NamespaceMode.CONTAINER,
        runtime_handler="runc",
    )


async def test_run_pod_sandbox_pid_mode(cri: Cri) -> None:
    await run_pod(cri, "shared", pid=pb.POD)
    await run_pod(cri, "host", pid=pb.NODE)
    # No linux section at all: proto3 reads pid as 0, which CRI defines as POD.
    bare = pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="bare", namespace="n"))
    )
    await cri.rt.RunPodSandbox(bare)
    modes = [config.pid_mode for (config,) in cri.runtime.called("run_pod")]
    assert modes == [NamespaceMode.POD, NamespaceMode.NODE, NamespaceMode.POD]


async def test_pod_sandbox_status_round_trip(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    before = time.time_ns()
    response = await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    after = time.time_ns()
    status = response.status
    assert status.id == pod_id
    assert status.metadata == pb.PodSandboxMetadata(
        name="web-0", uid="uid-web-0", namespace="shop", attempt=2
    )
    assert status.state == pb.SANDBOX_READY
    assert status.created_at == CREATED_BASE + 1
    assert status.network == pb.PodSandboxNetworkStatus(
        ip="10.88.0.7", additional_ips=[pb.PodIP(ip="fd00:10:88::7")]
    )
    assert status.linux.namespaces.options.pid == pb.CONTAINER
    assert dict(status.labels) == {"app": "web"}
    assert dict(status.annotations) == {
        "kubernetes.io/config.seen": "2026-01-01T00:00:00Z",
        "a/b": "c=d",
    }
    assert status.runtime_handler == "runc"
    assert dict(response.info) == {}
    assert [c.id for c in response.containers_statuses] == [container_id]
    assert response.containers_statuses[0].state == pb.CONTAINER_CREATED
    assert before <= response.timestamp <= after


async def test_pod_sandbox_status_by_prefix_and_after_stop(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))
    response = await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id="pod0001"))
    assert response.status.id == pod_id
    assert response.status.state == pb.SANDBOX_NOTREADY
    assert cri.runtime.called("stop_pod") == [(pod_id,)]


async def test_pod_sandbox_status_additional_ips_exclude_the_primary(cri: Cri) -> None:
    cri.runtime.next_ip = "10.1.0.4"
    cri.runtime.next_additional_ips = ["10.1.0.4", "fd00::4", "10.2.0.4"]
    pod_id = await run_pod(cri)
    response = await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    assert response.status.network.ip == "10.1.0.4"
    assert [p.ip for p in response.status.network.additional_ips] == ["fd00::4", "10.2.0.4"]


async def test_pod_sandbox_status_host_network_has_no_ip(cri: Cri) -> None:
    cri.runtime.next_ip = ""
    cri.runtime.next_additional_ips = []
    pod_id = await run_pod(cri)
    response = await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    assert response.status.network == pb.PodSandboxNetworkStatus()


async def test_pod_sandbox_status_verbose_info(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    record = cri.runtime.pods[pod_id]
    record.holder = ProcessRef(pid=100, start_time=5)
    record.ns_process = ProcessRef(pid=101, start_time=6)
    record.extra = {"netns": "/var/run/netns/cni-1"}
    request = pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True)
    response = await cri.rt.PodSandboxStatus(request)
    assert list(response.info) == ["info"]
    assert json.loads(response.info["info"]) == {
        "pid": 101,
        "holderPid": 100,
        "hostname": "web-0-host",
        "logDirectory": "/var/log/pods/shop_web-0_uid-web-0",
        "runtimeHandler": "runc",
        "pidMode": "CONTAINER",
        "extra": {"netns": "/var/run/netns/cni-1"},
    }


async def test_remove_pod_sandbox_then_status_is_not_found(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    assert cri.runtime.called("remove_pod") == [(pod_id,)]
    details = await expect_status(
        cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id)),
        grpc.StatusCode.NOT_FOUND,
    )
    assert pod_id in details


async def test_update_pod_sandbox_resources_passes_both_sets(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    await cri.rt.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=pod_id[:6],
            overhead=pb.LinuxContainerResources(cpu_shares=10, memory_limit_in_bytes=1 << 20),
            resources=pb.LinuxContainerResources(
                cpu_period=100000, cpu_quota=50000, memory_limit_in_bytes=64 << 20
            ),
        )
    )
    assert cri.runtime.called("update_pod_resources") == [
        (
            pod_id[:6],
            {"cpu_shares": 10, "memory_limit_in_bytes": 1 << 20},
            {"cpu_period": 100000, "cpu_quota": 50000, "memory_limit_in_bytes": 64 << 20},
        )
    ]


async def test_update_pod_sandbox_resources_needs_a_pod_id(cri: Cri) -> None:
    await expect_status(
        cri.rt.UpdatePodSandboxResources(pb.UpdatePodSandboxResourcesRequest()),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert cri.runtime.called("update_pod_resources") == []


async def test_list_pod_sandbox_items(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    response = await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())
    assert list(response.items) == [
        pb.PodSandbox(
            id=pod_id,
            metadata=pb.PodSandboxMetadata(
                name="web-0", uid="uid-web-0", namespace="shop", attempt=2
            ),
            state=pb.SANDBOX_READY,
            created_at=CREATED_BASE + 1,
            labels={"app": "web"},
            annotations={"kubernetes.io/config.seen": "2026-01-01T00:00:00Z", "a/b": "c=d"},
            runtime_handler="runc",
        )
    ]


async def test_list_pod_sandbox_filters(cri: Cri) -> None:
    web0 = await run_pod(cri, "web-0", labels={"app": "web", "shard": "0"})
    web1 = await run_pod(cri, "web-1", labels={"app": "web", "shard": "1"})
    db = await run_pod(cri, "db-0", labels={"app": "db"})
    await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=web1))

    async def ids(flt: pb.PodSandboxFilter) -> list[str]:
        response = await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest(filter=flt))
        return sorted(item.id for item in response.items)

    ready = pb.PodSandboxStateValue(state=pb.SANDBOX_READY)
    notready = pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)
    assert await ids(pb.PodSandboxFilter()) == sorted([web0, web1, db])
    assert await ids(pb.PodSandboxFilter(id=db)) == [db]
    assert await ids(pb.PodSandboxFilter(id=db[:7])) == [db]  # unique prefix
    assert await ids(pb.PodSandboxFilter(id="nope")) == []
    # SANDBOX_READY is 0: the filter is set by presence, not by value.
    assert await ids(pb.PodSandboxFilter(state=ready)) == sorted([web0, db])
    assert await ids(pb.PodSandboxFilter(state=notready)) == [web1]
    assert await ids(pb.PodSandboxFilter(label_selector={"app": "web"})) == sorted([web0, web1])
    selector = {"app": "web", "shard": "1"}
    assert await ids(pb.PodSandboxFilter(label_selector=selector)) == [web1]
    assert await ids(pb.PodSandboxFilter(label_selector={"app": "web"}, state=ready)) == [web0]
    assert await ids(pb.PodSandboxFilter(label_selector={"app": "cache"})) == []
    assert await ids(pb.PodSandboxFilter(id=web0, state=notready)) == []


def test_stats_and_event_field_numbers() -> None:
    # Upstream runtime.v1: PodSandboxStatsFilter id 1, label_selector 2; NetworkUsage
    # default_interface 2; LinuxPodSandboxStats process 4; ContainerEventResponse
    # container_id 1, container_event_type 2, created_at 3; CONTAINER_STOPPED_EVENT = 2.
    flt = pb.PodSandboxStatsFilter(id="p", label_selector={"a": "b"})
    assert flt.SerializeToString() == bytes.fromhex("0a0170 1206 0a0161 120162")
    network = pb.NetworkUsage(default_interface=pb.NetworkInterfaceUsage(name="e"))
    assert network.SerializeToString() == bytes.fromhex("1203 0a0165")
    linux = pb.LinuxPodSandboxStats(process=pb.ProcessUsage(timestamp=1))
    assert linux.SerializeToString() == bytes.fromhex("22020801")
    event = pb.ContainerEventResponse(
        container_id="c", container_event_type=pb.CONTAINER_STOPPED_EVENT, created_at=5
    )
    assert event.SerializeToString() == bytes.fromhex("0a0163 1002 1805")


async def test_pod_sandbox_stats_convert_and_filter(cri: Cri) -> None:
    web = await run_pod(cri, "web-0", labels={"app": "web"})
    db = await run_pod(cri, "db-0", labels={"app": "db"})
    gone = await run_pod(cri, "old-0", labels={"app": "web"})
    await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=gone))
    cri.runtime.usage = PodUsage(
        timestamp=CREATED_BASE,
        cpu_usage_ns=7,
        memory_working_set=11,
        processes=3,
        default_interface=InterfaceCounters("eth0", 1, 2, 3, 4),
        interfaces=[InterfaceCounters("lo", 5, 0, 5, 0)],
    )
    stats = (await cri.rt.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=web))).stats
    assert stats.attributes.id == web and stats.attributes.metadata.name == "web-0"
    assert dict(stats.attributes.labels) == {"app": "web"}
    linux = stats.linux
    assert (linux.cpu.timestamp, linux.cpu.usage_core_nano_seconds.value) == (CREATED_BASE, 7)
    assert not linux.cpu.HasField("usage_nano_cores")  # unknown is absent, not zero
    assert linux.memory.working_set_bytes.value == 11
    assert linux.process.process_count.value == 3
    eth0 = linux.network.default_interface
    assert (eth0.name, eth0.rx_bytes.value, eth0.rx_errors.value) == ("eth0", 1, 2)
    assert (eth0.tx_bytes.value, eth0.tx_errors.value) == (3, 4)
    assert [i.name for i in linux.network.interfaces] == ["lo"]

    async def ids(flt: pb.PodSandboxStatsFilter) -> list[str]:
        response = await cri.rt.ListPodSandboxStats(pb.ListPodSandboxStatsRequest(filter=flt))
        return sorted(s.attributes.id for s in response.stats)

    assert await ids(pb.PodSandboxStatsFilter()) == sorted([web, db])  # ready pods only
    assert await ids(pb.PodSandboxStatsFilter(id=db[:7])) == [db]
    assert await ids(pb.PodSandboxStatsFilter(label_selector={"app": "web"})) == [web]
    assert await ids(pb.PodSandboxStatsFilter(id="nope")) == []
    await expect_status(
        cri.rt.PodSandboxStats(pb.PodSandboxStatsRequest()), grpc.StatusCode.INVALID_ARGUMENT
    )


async def test_container_events_stream_until_the_hub_closes(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    pod = cri.runtime.pods[pod_id]
    container = cri.runtime.containers[container_id]
    call = cri.rt.GetContainerEvents(pb.GetEventsRequest())
    await call.initial_metadata()  # subscribed
    for n, kind in enumerate((ContainerEventType.CREATED, ContainerEventType.DELETED)):
        cri.runtime.events.publish(
            ContainerEvent(container_id, kind, CREATED_BASE + n, pod, (container,))
        )
    first = await call.read()
    second = await call.read()
    assert isinstance(first, pb.ContainerEventResponse)
    assert isinstance(second, pb.ContainerEventResponse)
    assert (first.container_id, first.container_event_type) == (
        container_id,
        pb.CONTAINER_CREATED_EVENT,
    )
    assert first.created_at == CREATED_BASE
    assert first.pod_sandbox_status.id == pod_id
    assert [s.id for s in first.containers_statuses] == [container_id]
    assert second.container_event_type == pb.CONTAINER_DELETED_EVENT
    await cri.runtime.events.aclose()  # what the daemon does before stopping the server
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


# ----------------------------------------------------------------------------- containers


async def test_create_container_passes_the_config(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    assert container_id == "ctr0002abcdef"
    [(got_pod, metadata, spec, labels, annotations)] = cri.runtime.called("create_container")
    assert got_pod == pod_id
    assert metadata == ContainerMetadata(name="app", attempt=3)
    assert spec == ContainerSpec(
        command=["/bin/sh", "-c"],
        args=["echo hi; sleep 3600"],
        working_dir="/srv",
        envs={"A": "1", "B": "x=y"},
        image="docker.io/library/busybox:1.36",
        run_as_user=1000,
        run_as_group=2000,
        stdin=True,
        stdin_once=True,
        tty=True,
        log_path="app/3.log",
        pid_mode=NamespaceMode.POD,
        mounts=[
            {
                "container_path": "/data",
                "host_path": "/var/lib/data",
                "readonly": True,
                "selinux_relabel": False,
                "propagation": "PROPAGATION_HOST_TO_CONTAINER",
                "recursive_read_only": False,
            }
        ],
    )
    assert labels == {"io.kubernetes.container.name": "app", "tier": "front"}
    assert annotations == {"io.kubernetes.container.restartCount": "3"}


async def test_create_container_without_user_leaves_it_unset(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="plain"), command=["true"])
    await cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=config))
    [(_, _, spec, _, _)] = cri.runtime.called("create_container")
    assert (spec.run_as_user, spec.run_as_group) == (None, None)
    # uid 0 is a real request, distinct from "unset".
    config.linux.security_context.run_as_user.value = 0
    await cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=config))
    assert cri.runtime.called("create_container")[1][2].run_as_user == 0


async def test_container_status_round_trip(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    record = cri.runtime.containers[container_id]
    record.state = ContainerState.EXITED
    record.started_at = CREATED_BASE + 1_000
    record.finished_at = CREATED_BASE + 2_000
    record.exit_code = 137
    record.reason = "Error"
    record.message = "killed"
    response = await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=container_id))
    status = response.status
    assert status.id == container_id
    assert status.metadata == pb.ContainerMetadata(name="app", attempt=3)
    assert status.state == pb.CONTAINER_EXITED
    assert status.created_at == CREATED_BASE + 2
    assert status.started_at == CREATED_BASE + 1_000
    assert status.finished_at == CREATED_BASE + 2_000
    assert status.exit_code == 137
    assert status.image == pb.ImageSpec(image="docker.io/library/busybox:1.36")
    assert status.image_ref == "docker.io/library/busybox:1.36"
    assert (status.reason, status.message) == ("Error", "killed")
    assert dict(status.labels) == {"io.kubernetes.container.name": "app", "tier": "front"}
    assert dict(status.annotations) == {"io.kubernetes.container.restartCount": "3"}
    assert list(status.mounts) == [
        pb.Mount(
            container_path="/data",
            host_path="/var/lib/data",
            readonly=True,
            propagation=pb.PROPAGATION_HOST_TO_CONTAINER,
        )
    ]
    # CRI's status log path is the full path: log_directory joined with the config's log_path.
    assert status.log_path == "/var/log/pods/shop_web-0_uid-web-0/app/3.log"
    assert dict(response.info) == {}


async def test_container_status_verbose_has_pid(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    cri.runtime.containers[container_id].process = ProcessRef(pid=4242, start_time=9)
    request = pb.ContainerStatusRequest(container_id=container_id, verbose=True)
    response = await cri.rt.ContainerStatus(request)
    info = json.loads(response.info["info"])
    assert info["pid"] == 4242
    assert info["sandboxID"] == pod_id
    assert info["logPath"] == "/var/log/pods/shop_web-0_uid-web-0/app/3.log"
    assert info["config"]["command"] == ["/bin/sh", "-c"]


async def test_container_lifecycle_calls(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=container_id))
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=container_id, timeout=30))
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=container_id))
    await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=container_id))
    assert cri.runtime.called("start_container") == [(container_id,)]
    assert cri.runtime.called("stop_container") == [(container_id, 30.0), (container_id, 0.0)]
    assert cri.runtime.called("remove_container") == [(container_id,)]
    response = await cri.rt.ListContainers(pb.ListContainersRequest())
    assert list(response.containers) == []


async def test_list_containers_items(cri: Cri) -> None:
    pod_id = await run_pod(cri)
    container_id = await create_container(cri, pod_id)
    response = await cri.rt.ListContainers(pb.ListContainersRequest())
    assert list(response.containers) == [
        pb.Container(
            id=container_id,
            pod_sandbox_id=pod_id,
            metadata=pb.ContainerMetadata(name="app", attempt=3),
            image=pb.ImageSpec(image="docker.io/library/busybox:1.36"),
            image_ref="docker.io/library/busybox:1.36",
            state=pb.CONTAINER_CREATED,
            created_at=CREATED_BASE + 2,
            labels={"io.kubernetes.container.name": "app", "tier": "front"},
            annotations={"io.kubernetes.container.restartCount": "3"},
            image_id="docker.io/library/busybox:1.36",
        )
    ]


async def test_list_containers_filters(cri: Cri) -> None:
    pod_a = await run_pod(cri, "a")
    pod_b = await run_pod(cri, "b")
    a1 = await create_container(cri, pod_a, "one")
    a2 = await create_container(cri, pod_a, "two")
    b1 = await create_container(cri, pod_b, "one")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=a2))

    async def ids(flt: pb.ContainerFilter) -> list[str]:
        response = await cri.rt.ListContainers(pb.ListContainersRequest(filter=flt))
        return sorted(c.id for c in response.containers)

    created = pb.ContainerStateValue(state=pb.CONTAINER_CREATED)
    running = pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)
    assert await ids(pb.ContainerFilter()) == sorted([a1, a2, b1])
    assert await ids(pb.ContainerFilter(id=a2)) == [a2]
    assert await ids(pb.ContainerFilter(id="missing")) == []
    assert await ids(pb.ContainerFilter(pod_sandbox_id=pod_a)) == sorted([a1, a2])
    assert await ids(pb.ContainerFilter(pod_sandbox_id=pod_b[:7])) == [b1]
    assert await ids(pb.ContainerFilter(pod_sandbox_id="missing")) == []
    # CONTAINER_CREATED is 0: the filter is set by presence.
    assert await ids(pb.ContainerFilter(state=created)) == sorted([a1, b1])
    assert await ids(pb.ContainerFilter(state=running)) == [a2]
    selector = {"io.kubernetes.container.name": "one"}
    assert await ids(pb.ContainerFilter(label_selector=selector)) == sorted([a1, b1])
    both = pb.ContainerFilter(label_selector=selector, pod_sandbox_id=pod_b)
    assert await ids(both) == [b1]
    assert await ids(pb.ContainerFilter(pod_sandbox_id=pod_a, state=running)) == [a2]


# ----------------------------------------------------------------------------- exec & streaming


async def test_exec_sync_output_and_timeout(cri: Cri) -> None:
    cri.runtime.exec_result = ExecSyncResult(stdout=b"hi\n\x00\xff", stderr=b"warn\n", exit_code=3)
    request = pb.ExecSyncRequest(container_id="ctr1", cmd=["sh", "-c", "echo hi"], timeout=5)
    response = await cri.rt.ExecSync(request)
    assert response == pb.ExecSyncResponse(stdout=b"hi\n\x00\xff", stderr=b"warn\n", exit_code=3)
    await cri.rt.ExecSync(pb.ExecSyncRequest(container_id="ctr1", cmd=["true"]))
    assert cri.runtime.called("exec_sync") == [
        ("ctr1", ["sh", "-c", "echo hi"], 5.0),
        ("ctr1", ["true"], 0.0),  # 0 = no timeout
    ]


async def test_exec_sync_negative_exit_code_survives(cri: Cri) -> None:
    cri.runtime.exec_result = ExecSyncResult(stdout=b"", stderr=b"", exit_code=-1)
    response = await cri.rt.ExecSync(pb.ExecSyncRequest(container_id="c", cmd=["x"]))
    assert response.exit_code == -1


async def test_exec_returns_url(cri: Cri) -> None:
    request = pb.ExecRequest(container_id="ctr1", cmd=["sh"], tty=True, stdin=True, stdout=True)
    response = await cri.rt.Exec(request)
    assert response.url == "http://127.0.0.1:10010/exec/AbCdEf01"
    assert cri.runtime.called("exec_url") == [("ctr1", ["sh"], True, True, True, False)]


async def test_attach_returns_url(cri: Cri) -> None:
    request = pb.AttachRequest(container_id="ctr1", stdin=True, stdout=True, stderr=True)
    response = await cri.rt.Attach(request)
    assert response.url == "http://127.0.0.1:10010/attach/AbCdEf02"
    assert cri.runtime.called("attach_url") == [("ctr1", False, True, True, True)]


async def test_port_forward_returns_url(cri: Cri) -> None:
    request = pb.PortForwardRequest(pod_sandbox_id="pod1", port=[1, 8080, 65535])
    response = await cri.rt.PortForward(request)
    assert response.url == "http://127.0.0.1:10010/portforward/AbCdEf03"
    # No ports is fine: SPDY clients name the port on each stream.
    await cri.rt.PortForward(pb.PortForwardRequest(pod_sandbox_id="pod1"))
    assert cri.runtime.called("port_forward_url") == [
        ("pod1", [1, 8080, 65535]),
        ("pod1", []),
    ]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFoundError("pod x not found"), grpc.StatusCode.NOT_FOUND),
        (InvalidArgumentError("bad handler"), grpc.StatusCode.INVALID_ARGUMENT),
        (FailedPreconditionError("pod x is not ready"), grpc.StatusCode.FAILED_PRECONDITION),
        (
            ResourceExhaustedError("maximum number of in-flight requests exceeded"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (DeadlineExceededError("command timed out"), grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
async def test_domain_errors_map_to_codes(
    cri: Cri, error: Exception, code: grpc.StatusCode
) -> None:
    for method in ("run_pod", "get_container", "exec_url", "exec_sync"):
        cri.runtime.fail[method] = error
    calls = [
        cri.rt.RunPodSandbox(pod_request()),
        cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id="c")),
        cri.rt.Exec(pb.ExecRequest(container_id="c", cmd=["sh"], stdout=True)),
        cri.rt.ExecSync(pb.ExecSyncRequest(container_id="c", cmd=["sh"])),
    ]
    for call in calls:
        assert await expect_status(call, code) == str(error)


async def test_unexpected_errors_are_internal_and_logged(
    cri: Cri, caplog: pytest.LogCaptureFixture
) -> None:
    cri.runtime.fail["get_pod"] = KeyError("boom")
    with caplog.at_level(logging.ERROR, logger="podgate.runtime.cri"):
        details = await expect_status(
            cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id="p")),
            grpc.StatusCode.INTERNAL,
        )
    assert details == "'boom'"
    [record] = [r for r in caplog.records if r.name == "podgate.runtime.cri.errors"]
    assert "PodSandboxStatus" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)


async def test_error_without_message_names_its_type(cri: Cri) -> None:
    cri.runtime.fail["list_pods"] = RuntimeError()
    details = await expect_status(
        cri.rt.ListPodSandbox(pb.ListPodSandboxRequest()), grpc.StatusCode.INTERNAL
    )
    assert details == "RuntimeError"


def test_status_code_subclasses_map_like_their_base() -> None:
    class GoneError(NotFoundError):
        pass

    assert status_code(GoneError("x")) == grpc.StatusCode.NOT_FOUND
    assert status_code(ValueError("x")) == grpc.StatusCode.INTERNAL


# ----------------------------------------------------------------------------- validation

_BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("RunPodSandbox", pb.RunPodSandboxRequest(), "config"),
    ("RunPodSandbox", pb.RunPodSandboxRequest(config=pb.PodSandboxConfig()), "metadata"),
    (
        "RunPodSandbox",
        pb.RunPodSandboxRequest(
            config=pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(namespace="n"))
        ),
        "metadata.name",
    ),
    ("RunPodSandbox", pod_request(pid=pb.TARGET), "target"),
    ("RunPodSandbox", pod_request(pid=7), "namespace mode 7"),  # type: ignore[arg-type]
    ("StopPodSandbox", pb.StopPodSandboxRequest(), "pod_sandbox_id"),
    ("RemovePodSandbox", pb.RemovePodSandboxRequest(), "pod_sandbox_id"),
    ("PodSandboxStatus", pb.PodSandboxStatusRequest(), "pod_sandbox_id"),
    (
        "CreateContainer",
        pb.CreateContainerRequest(config=container_config()),
        "pod_sandbox_id",
    ),
    ("CreateContainer", pb.CreateContainerRequest(pod_sandbox_id="p"), "config"),
    (
        "CreateContainer",
        pb.CreateContainerRequest(pod_sandbox_id="p", config=pb.ContainerConfig(command=["x"])),
        "metadata",
    ),
    (
        "CreateContainer",
        pb.CreateContainerRequest(
            pod_sandbox_id="p", config=pb.ContainerConfig(metadata=pb.ContainerMetadata())
        ),
        "metadata.name",
    ),
    (
        "CreateContainer",
        pb.CreateContainerRequest(
            pod_sandbox_id="p",
            config=container_config(
                linux=pb.LinuxContainerConfig(
                    security_context=pb.LinuxContainerSecurityContext(
                        run_as_group=pb.Int64Value(value=5)
                    )
                )
            ),
        ),
        'user group "5" is specified without user',
    ),
    (
        "CreateContainer",
        pb.CreateContainerRequest(
            pod_sandbox_id="p",
            config=container_config(
                image=pb.ImageSpec(image=""),  # a user name is resolved in an image
                linux=pb.LinuxContainerConfig(
                    security_context=pb.LinuxContainerSecurityContext(run_as_username="nobody")
                ),
            ),
        ),
        "run_as_username",
    ),
    (
        "CreateContainer",
        pb.CreateContainerRequest(
            pod_sandbox_id="p",
            config=container_config(
                linux=pb.LinuxContainerConfig(
                    security_context=pb.LinuxContainerSecurityContext(
                        namespace_options=pb.NamespaceOption(pid=pb.TARGET, target_id="c1")
                    )
                )
            ),
        ),
        "TARGET",
    ),
    ("StartContainer", pb.StartContainerRequest(), "container_id"),
    ("StopContainer", pb.StopContainerRequest(), "container_id"),
    ("StopContainer", pb.StopContainerRequest(container_id="c", timeout=-1), "timeout"),
    ("RemoveContainer", pb.RemoveContainerRequest(), "container_id"),
    ("ContainerStatus", pb.ContainerStatusRequest(), "container_id"),
    ("ExecSync", pb.ExecSyncRequest(cmd=["x"]), "container_id"),
    ("ExecSync", pb.ExecSyncRequest(container_id="c"), "cmd"),
    ("ExecSync", pb.ExecSyncRequest(container_id="c", cmd=["x"], timeout=-5), "timeout"),
    ("Exec", pb.ExecRequest(cmd=["x"], stdout=True), "container_id"),
    ("Exec", pb.ExecRequest(container_id="c", stdout=True), "cmd"),
    (
        "Exec",
        pb.ExecRequest(container_id="c", cmd=["x"], tty=True, stdout=True, stderr=True),
        "tty and stderr cannot both be true",
    ),
    ("Exec", pb.ExecRequest(container_id="c", cmd=["x"], tty=True), "stdin, stdout, or stderr"),
    ("Attach", pb.AttachRequest(stdout=True), "container_id"),
    (
        "Attach",
        pb.AttachRequest(container_id="c", tty=True, stdin=True, stderr=True),
        "tty and stderr cannot both be true",
    ),
    ("Attach", pb.AttachRequest(container_id="c"), "stdin, stdout, or stderr"),
    ("PortForward", pb.PortForwardRequest(port=[80]), "pod_sandbox_id"),
    ("PortForward", pb.PortForwardRequest(pod_sandbox_id="p", port=[80, 0]), "port 0"),
    ("PortForward", pb.PortForwardRequest(pod_sandbox_id="p", port=[65536]), "port 65536"),
    ("PortForward", pb.PortForwardRequest(pod_sandbox_id="p", port=[-1]), "port -1"),
]


@pytest.mark.parametrize(
    ("method", "request_message", "mentions"),
    _BAD_REQUESTS,
    ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(_BAD_REQUESTS)],
)
async def test_invalid_requests_never_reach_the_runtime(
    cri: Cri, method: str, request_message: Any, mentions: str
) -> None:
    details = await expect_status(
        getattr(cri.rt, method)(request_message), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert mentions in details
    assert cri.runtime.calls == []


async def test_tty_and_stderr_message_is_exact(cri: Cri) -> None:
    # k8s-streaming.md §7.2: the streaming server's exact wording.
    request = pb.ExecRequest(container_id="c", cmd=["x"], tty=True, stderr=True)
    details = await expect_status(cri.rt.Exec(request), grpc.StatusCode.INVALID_ARGUMENT)
    assert details == "tty and stderr cannot both be true"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=5))
def test_ports_accepted_exactly_in_range(values: list[int]) -> None:
    if all(1 <= v <= 65535 for v in values):
        assert convert.ports(values) == values
    else:
        with pytest.raises(InvalidArgumentError):
            convert.ports(values)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcd"), st.sampled_from("xy"), max_size=4),
    st.dictionaries(st.sampled_from("abcd"), st.sampled_from("xy"), max_size=4),
)
def test_label_selector_is_subset_match(labels: dict[str, str], selector: dict[str, str]) -> None:
    assert convert.matches_selector(labels, selector) == (selector.items() <= labels.items())


# ----------------------------------------------------------------------------- images


async def test_list_images_is_empty(cri: Cri) -> None:
    assert await cri.img.ListImages(pb.ListImagesRequest()) == pb.ListImagesResponse()


async def test_image_status_says_not_present(cri: Cri) -> None:
    request = pb.ImageStatusRequest(image=pb.ImageSpec(image="busybox"))
    response = await cri.img.ImageStatus(request)
    assert not response.HasField("image")


async def test_pull_without_registry_client_is_unimplemented(cri: Cri) -> None:
    pull = pb.PullImageRequest(image=pb.ImageSpec(image="busybox:1.36"))
    details = await expect_status(cri.img.PullImage(pull), grpc.StatusCode.UNIMPLEMENTED)
    assert "no registry client" in details and "busybox:1.36" in details


async def test_remove_unknown_image_is_success(cri: Cri) -> None:
    for name in ("busybox:1.36", "0" * 64, "sha256:" + "0" * 64):
        remove = pb.RemoveImageRequest(image=pb.ImageSpec(image=name))
        assert await cri.img.RemoveImage(remove) == pb.RemoveImageResponse()


async def test_image_fs_info_reports_the_image_store(cri: Cri) -> None:
    before = time.time_ns()
    response = await cri.img.ImageFsInfo(pb.ImageFsInfoRequest())
    after = time.time_ns()
    [usage] = response.image_filesystems
    assert list(response.container_filesystems) == []
    assert usage.fs_id.mountpoint == os.path.join(cri.state_dir, "images")
    assert before <= usage.timestamp <= after
    # An empty store: its directories, and nothing like the whole disk.
    assert 0 < usage.used_bytes.value < 1024 * 1024
    assert usage.inodes_used.value >= 5


# ----------------------------------------------------------------------------- socket


async def test_unserved_methods_are_unimplemented_and_logged_once(
    cri: Cri, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="podgate.runtime.cri.errors")
    names = ("CheckpointContainer", "ListMetricDescriptors")
    for name in (*names, *names, *names):
        call = cri.channel.unary_unary(
            f"/runtime.v1.RuntimeService/{name}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        details = await expect_status(call(b""), grpc.StatusCode.UNIMPLEMENTED)
        assert name in details
    pull = pb.PullImageRequest(image=pb.ImageSpec(image="busybox:1.36"))
    for _ in range(2):
        await expect_status(cri.img.PullImage(pull), grpc.StatusCode.UNIMPLEMENTED)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for name in names:
        [line] = [m for m in warned if f"/runtime.v1.RuntimeService/{name}" in m]
        assert "not served by podgate" in line
    [pull_line] = [m for m in warned if "PullImage" in m]
    assert "no registry client" in pull_line


async def test_socket_is_private_and_removed_on_stop(short_dir: str) -> None:
    path = os.path.join(short_dir, "cri.sock")
    server = await serve_cri(_conforms(FakeRuntime()), path, images=ImageStore(short_dir))
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600
    finally:
        await stop_cri(server, path, grace=0)
    assert not os.path.exists(path)


async def test_stale_socket_is_replaced(short_dir: str) -> None:
    path = os.path.join(short_dir, "cri.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    server = await serve_cri(_conforms(FakeRuntime()), path, images=ImageStore(short_dir))
    try:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            version = await pb_grpc.RuntimeServiceStub(channel).Version(pb.VersionRequest())
        assert version.runtime_name == "podgate"
    finally:
        await stop_cri(server, path, grace=0)


async def test_refuses_to_replace_a_regular_file(short_dir: str) -> None:
    path = os.path.join(short_dir, "cri.sock")
    Path(path).write_text("not a socket")
    with pytest.raises(FileExistsError):
        await serve_cri(_conforms(FakeRuntime()), path, images=ImageStore(short_dir))
    assert Path(path).read_text() == "not a socket"


async def test_rejects_a_socket_path_too_long_for_sun_path(short_dir: str) -> None:
    path = os.path.join(short_dir, "x" * 120 + ".sock")
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        await serve_cri(_conforms(FakeRuntime()), path, images=ImageStore(short_dir))
