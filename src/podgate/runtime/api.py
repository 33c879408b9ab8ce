"""The runtime's interface, as the CRI service (and tests) see it.

Errors are domain errors; the CRI layer maps them to gRPC codes in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from podgate.linux.netdev import InterfaceCounters
from podgate.model import (
    ContainerMetadata,
    ContainerRecord,
    ContainerSpec,
    NamespaceMode,
    PodMetadata,
    PodRecord,
)
from podgate.runtime.events import ContainerEvents


class RuntimeError_(Exception):
    """Root of the runtime's domain errors."""


class NotFoundError(RuntimeError_):
    pass


class InvalidArgumentError(RuntimeError_):
    pass


class FailedPreconditionError(RuntimeError_):
    pass


class ResourceExhaustedError(RuntimeError_):
    pass


class DeadlineExceededError(RuntimeError_):
    pass


@dataclass(slots=True)
class PodConfig:
    metadata: PodMetadata
    hostname: str = ""
    log_directory: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    pid_mode: NamespaceMode = NamespaceMode.CONTAINER
    network_mode: NamespaceMode = NamespaceMode.POD  # NODE = host network
    ipc_mode: NamespaceMode = NamespaceMode.POD
    runtime_handler: str = ""
    cgroup_parent: str = ""
    privileged: bool = False
    dns: dict[str, list[str]] | None = None
    sysctls: dict[str, str] = field(default_factory=dict)
    overhead: dict[str, Any] = field(default_factory=dict)  # CRI resources, zeros left out
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ExecSyncResult:
    stdout: bytes
    stderr: bytes
    exit_code: int


@dataclass(slots=True)
class ContainerUsage:
    """A container's resource use, from its cgroup and its writable layer."""

    timestamp: int  # ns since the epoch
    cpu_usage_ns: int = 0
    cpu_nano_cores: int | None = None  # needs an earlier sample
    memory_usage: int = 0
    memory_working_set: int = 0
    memory_rss: int = 0
    memory_available: int | None = None  # only with a limit
    page_faults: int = 0
    major_page_faults: int = 0
    writable_mountpoint: str = ""
    writable_bytes: int = 0
    writable_inodes: int = 0


@dataclass(slots=True)
class PodUsage:
    """A pod's resource use: its cgroup (every container in it), its network namespace's
    interfaces, and each container's own usage."""

    timestamp: int  # ns since the epoch
    cpu_usage_ns: int = 0
    cpu_nano_cores: int | None = None  # needs an earlier sample
    memory_usage: int = 0
    memory_working_set: int = 0
    memory_rss: int = 0
    memory_available: int | None = None  # only with a limit
    page_faults: int = 0
    major_page_faults: int = 0
    processes: int = 0
    default_interface: InterfaceCounters | None = None  # eth0, else the first one not loopback
    interfaces: list[InterfaceCounters] = field(default_factory=list)  # the others
    containers: list[tuple[ContainerRecord, ContainerUsage]] = field(default_factory=list)


@dataclass(slots=True)
class RuntimeCondition:
    type: str
    status: bool
    reason: str = ""
    message: str = ""


class RuntimeApi(Protocol):
    name: str
    version: str

    # -- pods
    async def run_pod(self, config: PodConfig) -> str: ...

    async def stop_pod(self, pod_id: str) -> None:
        """Idempotent; an unknown pod is not an error."""
        ...

    async def remove_pod(self, pod_id: str) -> None:
        """Idempotent; an unknown pod is not an error. Removes its containers."""
        ...

    def get_pod(self, pod_id: str) -> PodRecord:
        """NotFoundError if unknown. Accepts a unique id prefix, as crictl users expect."""
        ...

    def list_pods(self) -> list[PodRecord]: ...

    async def pod_network(self, pod: PodRecord) -> tuple[str, list[str]]:
        """The pod's IP and additional IPs, as PodSandboxStatus reports them."""
        ...

    # -- containers
    async def create_container(
        self,
        pod_id: str,
        metadata: ContainerMetadata,
        spec: ContainerSpec,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str: ...

    async def start_container(self, container_id: str) -> None: ...

    async def stop_container(self, container_id: str, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; idempotent."""
        ...

    async def remove_container(self, container_id: str) -> None:
        """Idempotent; stops it first if running."""
        ...

    def get_container(self, container_id: str) -> ContainerRecord: ...

    def list_containers(self) -> list[ContainerRecord]: ...

    async def exec_sync(
        self, container_id: str, command: Sequence[str], timeout: float
    ) -> ExecSyncResult:
        """Run to completion; output capped (16 MiB each); timeout 0 = none."""
        ...

    # -- streaming: each returns a one-time URL on the streaming server
    def exec_url(
        self,
        container_id: str,
        command: Sequence[str],
        *,
        tty: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> str: ...

    def attach_url(
        self, container_id: str, *, tty: bool, stdin: bool, stdout: bool, stderr: bool
    ) -> str: ...

    def port_forward_url(self, pod_id: str, ports: Sequence[int]) -> str: ...

    # -- resources, stats, logs
    async def container_usage(self, container: ContainerRecord) -> ContainerUsage: ...

    async def pod_usage(self, pod: PodRecord) -> PodUsage: ...

    # Container lifecycle events (GetContainerEvents).
    events: ContainerEvents

    async def update_container_resources(
        self, container_id: str, resources: Mapping[str, object]
    ) -> None:
        """Apply CRI LinuxContainerResources fields (zero = unchanged) and record them."""
        ...

    async def update_pod_resources(
        self, pod_id: str, overhead: Mapping[str, object], resources: Mapping[str, object]
    ) -> None:
        """CRI UpdatePodSandboxResources: the pod-level resources recorded (and applied to a
        pod cgroup podgate owns), with NRI UpdatePodSandbox / PostUpdatePodSandbox."""
        ...

    async def reopen_container_log(self, container_id: str) -> None:
        """The log file is reopened (created at its path) before this returns."""
        ...

    # -- runtime
    def conditions(self) -> list[RuntimeCondition]: ...

    def update_runtime_config(self, pod_cidr: str) -> None: ...
