"""Pods and containers as the runtime records them (one JSON file each in the state dir).

Field names follow CRI where CRI has them. Times are nanoseconds since the epoch, as CRI's.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class PodState(enum.Enum):
    READY = "ready"
    NOTREADY = "notready"


class ContainerState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    EXITED = "exited"
    UNKNOWN = "unknown"


class NamespaceMode(enum.IntEnum):
    """CRI NamespaceMode: where a pod's or container's PID/IPC/network namespace comes from."""

    POD = 0
    CONTAINER = 1
    NODE = 2
    TARGET = 3


@dataclass(slots=True)
class PodMetadata:
    name: str
    namespace: str
    uid: str = ""
    attempt: int = 0


@dataclass(slots=True)
class ProcessRef:
    """A process we did not start in this daemon's lifetime: pid plus its start time, so a
    reused pid is never mistaken for ours."""

    pid: int
    start_time: int  # clock ticks since boot, field 22 of /proc/<pid>/stat


@dataclass(slots=True)
class PodRecord:
    id: str
    metadata: PodMetadata
    state: PodState
    created_at: int
    hostname: str = ""
    log_directory: str = ""
    runtime_handler: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    pid_mode: NamespaceMode = NamespaceMode.CONTAINER
    network_mode: NamespaceMode = NamespaceMode.POD  # NODE = host network
    ipc_mode: NamespaceMode = NamespaceMode.POD
    holder: ProcessRef | None = None
    # The process whose namespaces are the pod's (the holder's PID-1 child when the pod
    # shares a PID namespace, else the holder itself).
    ns_process: ProcessRef | None = None
    ip: str = ""
    additional_ips: list[str] = field(default_factory=list)
    # CRI LinuxPodSandboxConfig.cgroup_parent ("" = podgate's own parent) and privileged flag.
    cgroup_parent: str = ""
    privileged: bool = False
    # CRI DNSConfig as {"servers": [...], "searches": [...], "options": [...]}; None = absent.
    dns: dict[str, list[str]] | None = None
    sysctls: dict[str, str] = field(default_factory=dict)
    # Pod-level CRI LinuxContainerResources (overhead, and the sum of the containers'), as
    # ContainerSpec.resources keeps them: from RunPodSandbox, then UpdatePodSandboxResources.
    overhead: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    # Anything extra the network or sandbox layers need to keep (e.g. sandbox dirs).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ContainerMetadata:
    name: str
    attempt: int = 0


@dataclass(slots=True)
class ContainerSpec:
    """What CreateContainer asked for (the parts podgate honours)."""

    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    working_dir: str = ""
    envs: dict[str, str] = field(default_factory=dict)
    image: str = ""
    root_dir: str = ""  # optional root directory (chroot); "" = the host's filesystem
    run_as_user: int | None = None
    run_as_group: int | None = None
    stdin: bool = False
    stdin_once: bool = False
    tty: bool = False
    log_path: str = ""  # relative to the pod's log_directory, as CRI says
    pid_mode: NamespaceMode = NamespaceMode.CONTAINER
    mounts: list[dict[str, Any]] = field(default_factory=list)
    # The container's root as image layers: lower directories, topmost first. Empty = no
    # image (the command runs on the node's filesystem or `root_dir`, without runc).
    rootfs: list[str] = field(default_factory=list)
    # The image config's Entrypoint, Cmd, Env, WorkingDir, User (OCI image-spec names).
    image_config: dict[str, Any] = field(default_factory=dict)
    # The image from the store the root was made of (empty without one): its ID, the repo
    # digest or ID ContainerStatus reports as image_ref, and its first tag (image.image).
    image_id: str = ""
    image_ref: str = ""
    image_name: str = ""
    run_as_username: str = ""
    supplemental_groups: list[int] = field(default_factory=list)
    supplemental_groups_strict: bool = False
    privileged: bool = False
    readonly_rootfs: bool = False
    no_new_privs: bool = False
    cap_add: list[str] = field(default_factory=list)
    cap_drop: list[str] = field(default_factory=list)
    masked_paths: list[str] = field(default_factory=list)
    readonly_paths: list[str] = field(default_factory=list)
    # Seccomp/AppArmor profile type ("" unset, RuntimeDefault, Unconfined, Localhost) and ref.
    seccomp: str = ""
    seccomp_ref: str = ""
    apparmor: str = ""
    apparmor_ref: str = ""
    # CRI LinuxContainerResources fields (cpu_shares, cpu_quota, cpu_period, cpuset_cpus,
    # cpuset_mems, memory_limit_in_bytes, memory_swap_limit_in_bytes, oom_score_adj).
    resources: dict[str, Any] = field(default_factory=dict)
    # CRI Device {"container_path", "host_path", "permissions"}.
    devices: list[dict[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ContainerRecord:
    id: str
    pod_id: str
    metadata: ContainerMetadata
    spec: ContainerSpec
    state: ContainerState
    created_at: int
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    reason: str = ""
    message: str = ""
    log_file: str = ""  # absolute path of the CRI log file ("" when none)
    shim: ProcessRef | None = None
    process: ProcessRef | None = None  # the container's main process, host pid
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    # The identity the container's process got: {"uid", "gid", "additionalGids"} (OCI names).
    user: dict[str, Any] | None = None


def to_json(record: PodRecord | ContainerRecord) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(asdict(record))  # type: ignore[no-any-return]


def pod_from_json(data: dict[str, Any]) -> PodRecord:
    return PodRecord(
        id=data["id"],
        metadata=PodMetadata(**data["metadata"]),
        state=PodState(data["state"]),
        created_at=data["created_at"],
        hostname=data.get("hostname", ""),
        log_directory=data.get("log_directory", ""),
        runtime_handler=data.get("runtime_handler", ""),
        labels=dict(data.get("labels", {})),
        annotations=dict(data.get("annotations", {})),
        pid_mode=NamespaceMode(data.get("pid_mode", NamespaceMode.CONTAINER)),
        network_mode=NamespaceMode(data.get("network_mode", NamespaceMode.POD)),
        ipc_mode=NamespaceMode(data.get("ipc_mode", NamespaceMode.POD)),
        holder=ProcessRef(**data["holder"]) if data.get("holder") else None,
        ns_process=ProcessRef(**data["ns_process"]) if data.get("ns_process") else None,
        ip=data.get("ip", ""),
        additional_ips=list(data.get("additional_ips", [])),
        cgroup_parent=data.get("cgroup_parent", ""),
        privileged=bool(data.get("privileged", False)),
        dns=data.get("dns"),
        sysctls=dict(data.get("sysctls", {})),
        overhead=dict(data.get("overhead", {})),
        resources=dict(data.get("resources", {})),
        extra=dict(data.get("extra", {})),
    )


def container_from_json(data: dict[str, Any]) -> ContainerRecord:
    spec = dict(data["spec"])
    spec["pid_mode"] = NamespaceMode(spec.get("pid_mode", NamespaceMode.CONTAINER))
    return ContainerRecord(
        id=data["id"],
        pod_id=data["pod_id"],
        metadata=ContainerMetadata(**data["metadata"]),
        spec=ContainerSpec(**spec),
        state=ContainerState(data["state"]),
        created_at=data["created_at"],
        started_at=data.get("started_at", 0),
        finished_at=data.get("finished_at", 0),
        exit_code=data.get("exit_code", 0),
        reason=data.get("reason", ""),
        message=data.get("message", ""),
        log_file=data.get("log_file", ""),
        shim=ProcessRef(**data["shim"]) if data.get("shim") else None,
        process=ProcessRef(**data["process"]) if data.get("process") else None,
        labels=dict(data.get("labels", {})),
        annotations=dict(data.get("annotations", {})),
        user=data.get("user"),
    )
