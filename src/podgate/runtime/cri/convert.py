"""CRI messages ↔ podgate's runtime records, and the request checks done before the runtime.

Pure functions: no I/O, no clock. A request that cannot be honoured raises InvalidArgumentError
(mapped to INVALID_ARGUMENT in errors.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from podgate.cri import api_pb2 as pb
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
)
from podgate.runtime.api import (
    ContainerUsage,
    InvalidArgumentError,
    PodConfig,
    PodUsage,
    RuntimeCondition,
)
from podgate.runtime.events import ContainerEvent, ContainerEventType

# Ports are 16-bit and port 0 cannot be connected to.
MIN_PORT = 1
MAX_PORT = 65535

_POD_STATES: dict[PodState, pb.PodSandboxState.ValueType] = {
    PodState.READY: pb.SANDBOX_READY,
    PodState.NOTREADY: pb.SANDBOX_NOTREADY,
}
_CONTAINER_STATES: dict[ContainerState, pb.ContainerState.ValueType] = {
    ContainerState.CREATED: pb.CONTAINER_CREATED,
    ContainerState.RUNNING: pb.CONTAINER_RUNNING,
    ContainerState.EXITED: pb.CONTAINER_EXITED,
    ContainerState.UNKNOWN: pb.CONTAINER_UNKNOWN,
}
_NAMESPACE_MODES: dict[NamespaceMode, pb.NamespaceMode.ValueType] = {
    NamespaceMode.POD: pb.POD,
    NamespaceMode.CONTAINER: pb.CONTAINER,
    NamespaceMode.NODE: pb.NODE,
    NamespaceMode.TARGET: pb.TARGET,
}
_EVENT_TYPES: dict[ContainerEventType, pb.ContainerEventType.ValueType] = {
    ContainerEventType.CREATED: pb.CONTAINER_CREATED_EVENT,
    ContainerEventType.STARTED: pb.CONTAINER_STARTED_EVENT,
    ContainerEventType.STOPPED: pb.CONTAINER_STOPPED_EVENT,
    ContainerEventType.DELETED: pb.CONTAINER_DELETED_EVENT,
}
_NAMESPACE_MODES_FROM_PB = {value: mode for mode, value in _NAMESPACE_MODES.items()}


# ---------------------------------------------------------------------------- request checks


def require(value: str, field: str) -> str:
    if not value:
        raise InvalidArgumentError(f"{field} is required")
    return value


def timeout_seconds(value: int, field: str = "timeout") -> float:
    """A CRI timeout in whole seconds; 0 means none (ExecSync) or at once (StopContainer)."""
    if value < 0:
        raise InvalidArgumentError(f"{field} must not be negative, got {value}")
    return float(value)


def check_stdio(*, tty: bool, stdin: bool, stdout: bool, stderr: bool) -> None:
    """The streaming server's GetExec/GetAttach rules."""
    if tty and stderr:
        raise InvalidArgumentError("tty and stderr cannot both be true")
    if not (stdin or stdout or stderr):
        raise InvalidArgumentError("one of stdin, stdout, or stderr must be set")


def command(cmd: Sequence[str]) -> list[str]:
    if not cmd:
        raise InvalidArgumentError("cmd is required")
    return list(cmd)


def ports(values: Iterable[int]) -> list[int]:
    """Ports to forward; an empty list is allowed (SPDY clients name ports per stream)."""
    result = list(values)
    for port in result:
        if not MIN_PORT <= port <= MAX_PORT:
            raise InvalidArgumentError(
                f"port {port} is out of range, must be {MIN_PORT}..{MAX_PORT}"
            )
    return result


def namespace_mode(value: int, field: str) -> NamespaceMode:
    try:
        return _NAMESPACE_MODES_FROM_PB[pb.NamespaceMode.ValueType(value)]
    except KeyError:
        raise InvalidArgumentError(f"{field}: unknown namespace mode {value}") from None


# ---------------------------------------------------------------------------- requests → domain


def pod_config(request: pb.RunPodSandboxRequest) -> PodConfig:
    if not request.HasField("config"):
        raise InvalidArgumentError("config is required")
    config = request.config
    if not config.HasField("metadata"):
        raise InvalidArgumentError("config.metadata is required")
    metadata = config.metadata
    require(metadata.name, "config.metadata.name")
    # An absent namespace_options reads as pid=POD, the CRI default.
    pid = config.linux.security_context.namespace_options.pid
    pid_mode = namespace_mode(pid, "config.linux.security_context.namespace_options.pid")
    if pid_mode is NamespaceMode.TARGET:
        raise InvalidArgumentError("a pod sandbox cannot take its pid namespace from a target")
    options = config.linux.security_context.namespace_options
    network_mode = namespace_mode(options.network, "namespace_options.network")
    ipc_mode = namespace_mode(options.ipc, "namespace_options.ipc")
    for mode, name in ((network_mode, "network"), (ipc_mode, "ipc")):
        if mode not in (NamespaceMode.POD, NamespaceMode.NODE):
            raise InvalidArgumentError(f"namespace_options.{name}: only POD or NODE")
    return PodConfig(
        metadata=PodMetadata(
            name=metadata.name,
            namespace=metadata.namespace,
            uid=metadata.uid,
            attempt=metadata.attempt,
        ),
        hostname=config.hostname,
        log_directory=config.log_directory,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        pid_mode=pid_mode,
        network_mode=network_mode,
        ipc_mode=ipc_mode,
        runtime_handler=request.runtime_handler,
        cgroup_parent=config.linux.cgroup_parent,
        privileged=config.linux.security_context.privileged,
        dns=(
            {
                "servers": list(config.dns_config.servers),
                "searches": list(config.dns_config.searches),
                "options": list(config.dns_config.options),
            }
            if config.HasField("dns_config")
            else None
        ),
        sysctls=dict(config.linux.sysctls),
        overhead=resources(config.linux.overhead),
        resources=resources(config.linux.resources),
    )


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """CreateContainer's arguments, in the runtime's terms."""

    pod_id: str
    metadata: ContainerMetadata
    spec: ContainerSpec
    labels: dict[str, str]
    annotations: dict[str, str]


def mount_to_dict(mount: pb.Mount) -> dict[str, Any]:
    return {
        "container_path": mount.container_path,
        "host_path": mount.host_path,
        "readonly": mount.readonly,
        "selinux_relabel": mount.selinux_relabel,
        "propagation": pb.MountPropagation.Name(mount.propagation),
        "recursive_read_only": mount.recursive_read_only,
    }


def mount_from_dict(data: Mapping[str, Any]) -> pb.Mount:
    propagation = str(data.get("propagation", "PROPAGATION_PRIVATE"))
    return pb.Mount(
        container_path=str(data.get("container_path", "")),
        host_path=str(data.get("host_path", "")),
        readonly=bool(data.get("readonly", False)),
        selinux_relabel=bool(data.get("selinux_relabel", False)),
        propagation=pb.MountPropagation.Value(propagation),
        recursive_read_only=bool(data.get("recursive_read_only", False)),
    )


def container_request(request: pb.CreateContainerRequest) -> ContainerRequest:
    pod_id = require(request.pod_sandbox_id, "pod_sandbox_id")
    if not request.HasField("config"):
        raise InvalidArgumentError("config is required")
    config = request.config
    if not config.HasField("metadata"):
        raise InvalidArgumentError("config.metadata is required")
    require(config.metadata.name, "config.metadata.name")
    security = config.linux.security_context
    rootfs = _local_rootfs(config.image.image)
    if security.run_as_username and not config.image.image:
        # Resolving a user name needs the image's /etc/passwd.
        raise InvalidArgumentError("run_as_username needs a container root (an image)")
    run_as_user = security.run_as_user.value if security.HasField("run_as_user") else None
    run_as_group = security.run_as_group.value if security.HasField("run_as_group") else None
    if run_as_group is not None and run_as_user is None and not security.run_as_username:
        raise InvalidArgumentError(f'user group "{run_as_group}" is specified without user')
    pid_mode = namespace_mode(
        security.namespace_options.pid, "config.linux.security_context.namespace_options.pid"
    )
    if pid_mode is NamespaceMode.TARGET:
        # ContainerSpec has nowhere to carry target_id.
        raise InvalidArgumentError("pid namespace mode TARGET is not supported")
    spec = ContainerSpec(
        command=list(config.command),
        args=list(config.args),
        working_dir=config.working_dir,
        envs={env.key: env.value for env in config.envs},
        image=config.image.image,
        run_as_user=run_as_user,
        run_as_group=run_as_group,
        stdin=config.stdin,
        stdin_once=config.stdin_once,
        tty=config.tty,
        log_path=config.log_path,
        pid_mode=pid_mode,
        mounts=[mount_to_dict(mount) for mount in config.mounts],
        rootfs=rootfs,
        run_as_username=security.run_as_username,
        supplemental_groups=list(security.supplemental_groups),
        supplemental_groups_strict=security.supplemental_groups_policy == pb.Strict,
        privileged=security.privileged,
        readonly_rootfs=security.readonly_rootfs,
        no_new_privs=security.no_new_privs,
        cap_add=list(security.capabilities.add_capabilities),
        cap_drop=list(security.capabilities.drop_capabilities),
        masked_paths=list(security.masked_paths),
        readonly_paths=list(security.readonly_paths),
        seccomp=_profile_type(security, "seccomp", "seccomp_profile_path"),
        seccomp_ref=security.seccomp.localhost_ref if security.HasField("seccomp") else "",
        apparmor=_profile_type(security, "apparmor", "apparmor_profile"),
        apparmor_ref=security.apparmor.localhost_ref if security.HasField("apparmor") else "",
        resources=resources(config.linux.resources),
        devices=[
            {
                "container_path": d.container_path,
                "host_path": d.host_path,
                "permissions": d.permissions,
            }
            for d in config.devices
        ],
    )
    return ContainerRequest(
        pod_id=pod_id,
        metadata=ContainerMetadata(name=config.metadata.name, attempt=config.metadata.attempt),
        spec=spec,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
    )


def _local_rootfs(image: str) -> list[str]:
    """Until images are pulled, an absolute `image.image` names a root directory on the node
    (the single lower layer of the container's overlay)."""
    return [image] if image.startswith("/") else []


def _profile_type(security: pb.LinuxContainerSecurityContext, name: str, legacy: str) -> str:
    """The SecurityProfile type name ("RuntimeDefault", ...); else the deprecated string
    (`runtime/default`, `unconfined`, `localhost/<ref>`); "" when neither is set (unset = no
    seccomp filter, as containerd). The new field wins."""
    if security.HasField(name):  # type: ignore[arg-type]
        profile: pb.SecurityProfile = getattr(security, name)
        return pb.SecurityProfile.ProfileType.Name(profile.profile_type)
    return str(getattr(security, legacy))


def resources(resources: pb.LinuxContainerResources) -> dict[str, Any]:
    """The CRI resources podgate applies, zero values left out."""
    out: dict[str, Any] = {}
    for name in (
        "cpu_period",
        "cpu_quota",
        "cpu_shares",
        "memory_limit_in_bytes",
        "memory_swap_limit_in_bytes",
        "oom_score_adj",
        "cpuset_cpus",
        "cpuset_mems",
    ):
        value = getattr(resources, name)
        if value:
            out[name] = value
    return out


def pod_cidr(request: pb.UpdateRuntimeConfigRequest) -> str:
    return request.runtime_config.network_config.pod_cidr


# ---------------------------------------------------------------------------- domain → messages


def pod_state(state: PodState) -> pb.PodSandboxState.ValueType:
    return _POD_STATES[state]


def container_state(state: ContainerState) -> pb.ContainerState.ValueType:
    return _CONTAINER_STATES[state]


def matches_selector(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """CRI label selectors are MatchLabels only, ANDed."""
    return all(labels.get(key) == value for key, value in selector.items())


def pod_metadata(metadata: PodMetadata) -> pb.PodSandboxMetadata:
    return pb.PodSandboxMetadata(
        name=metadata.name,
        uid=metadata.uid,
        namespace=metadata.namespace,
        attempt=metadata.attempt,
    )


def pod_sandbox(record: PodRecord) -> pb.PodSandbox:
    return pb.PodSandbox(
        id=record.id,
        metadata=pod_metadata(record.metadata),
        state=pod_state(record.state),
        created_at=record.created_at,
        labels=record.labels,
        annotations=record.annotations,
        runtime_handler=record.runtime_handler,
    )


def pod_sandbox_status(
    record: PodRecord, ip: str | None = None, additional_ips: Sequence[str] | None = None
) -> pb.PodSandboxStatus:
    """`ip`/`additional_ips` override the recorded addresses (fresh from NRI plugins)."""
    if ip is None:
        ip, additional_ips = record.ip, record.additional_ips
    options = pb.NamespaceOption(
        pid=_NAMESPACE_MODES[record.pid_mode],
        network=_NAMESPACE_MODES[record.network_mode],
        ipc=_NAMESPACE_MODES[record.ipc_mode],
    )
    return pb.PodSandboxStatus(
        id=record.id,
        metadata=pod_metadata(record.metadata),
        state=pod_state(record.state),
        created_at=record.created_at,
        network=pb.PodSandboxNetworkStatus(
            ip=ip,
            additional_ips=[pb.PodIP(ip=extra) for extra in additional_ips or () if extra != ip],
        ),
        linux=pb.LinuxPodSandboxStatus(namespaces=pb.Namespace(options=options)),
        labels=record.labels,
        annotations=record.annotations,
        runtime_handler=record.runtime_handler,
    )


def pod_info(record: PodRecord) -> dict[str, str]:
    """PodSandboxStatus `info` for verbose requests: one JSON document, as containerd's."""
    ns_process = record.ns_process or record.holder
    info = {
        "pid": ns_process.pid if ns_process else 0,
        "holderPid": record.holder.pid if record.holder else 0,
        "hostname": record.hostname,
        "logDirectory": record.log_directory,
        "runtimeHandler": record.runtime_handler,
        "pidMode": record.pid_mode.name,
        "extra": record.extra,
    }
    return {"info": json.dumps(info, sort_keys=True, default=str)}


def container_metadata(metadata: ContainerMetadata) -> pb.ContainerMetadata:
    return pb.ContainerMetadata(name=metadata.name, attempt=metadata.attempt)


def image_identity(spec: ContainerSpec) -> tuple[str, str, str]:
    """(image.image, image_ref, image_id) as containerd reports them: the image's first tag,
    its first repo digest (else its ID), its ID. A container without an image from the
    store has the reference it was created with, the best identity there is."""
    if spec.image_id:
        return spec.image_name or spec.image, spec.image_ref or spec.image_id, spec.image_id
    return spec.image, spec.image, spec.image


def container(record: ContainerRecord) -> pb.Container:
    image, image_ref, image_id = image_identity(record.spec)
    return pb.Container(
        id=record.id,
        pod_sandbox_id=record.pod_id,
        metadata=container_metadata(record.metadata),
        image=pb.ImageSpec(image=image),
        image_ref=image_ref,
        state=container_state(record.state),
        created_at=record.created_at,
        labels=record.labels,
        annotations=record.annotations,
        image_id=image_id,
    )


def container_status(record: ContainerRecord) -> pb.ContainerStatus:
    image, image_ref, image_id = image_identity(record.spec)
    return pb.ContainerStatus(
        id=record.id,
        metadata=container_metadata(record.metadata),
        state=container_state(record.state),
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        exit_code=record.exit_code,
        image=pb.ImageSpec(image=image),
        image_ref=image_ref,
        reason=record.reason,
        message=record.message,
        labels=record.labels,
        annotations=record.annotations,
        mounts=[mount_from_dict(mount) for mount in record.spec.mounts],
        log_path=record.log_file,
        image_id=image_id,
        resources=pb.ContainerResources(linux=_linux_resources(record.spec.resources))
        if record.spec.resources
        else None,
        user=pb.ContainerUser(
            linux=pb.LinuxContainerUser(
                uid=record.user["uid"],
                gid=record.user["gid"],
                supplemental_groups=record.user.get("additionalGids", []),
            )
        )
        if record.user
        else None,
    )


def _linux_resources(values: Mapping[str, Any]) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(**dict(values))


def container_info(record: ContainerRecord) -> dict[str, str]:
    """ContainerStatus `info` for verbose requests; crictl reads `info.pid` from it."""
    info = {
        "sandboxID": record.pod_id,
        "pid": record.process.pid if record.process else 0,
        "logPath": record.log_file,
        "config": asdict(record.spec),
    }
    return {"info": json.dumps(info, sort_keys=True, default=str)}


def _u64(value: int | None) -> pb.UInt64Value | None:
    return None if value is None else pb.UInt64Value(value=max(value, 0))


def container_stats(record: ContainerRecord, usage: ContainerUsage) -> pb.ContainerStats:
    return pb.ContainerStats(
        attributes=pb.ContainerAttributes(
            id=record.id,
            metadata=container_metadata(record.metadata),
            labels=record.labels,
            annotations=record.annotations,
        ),
        cpu=pb.CpuUsage(
            timestamp=usage.timestamp,
            usage_core_nano_seconds=_u64(usage.cpu_usage_ns),
            usage_nano_cores=_u64(usage.cpu_nano_cores),
        ),
        memory=pb.MemoryUsage(
            timestamp=usage.timestamp,
            working_set_bytes=_u64(usage.memory_working_set),
            available_bytes=_u64(usage.memory_available),
            usage_bytes=_u64(usage.memory_usage),
            rss_bytes=_u64(usage.memory_rss),
            page_faults=_u64(usage.page_faults),
            major_page_faults=_u64(usage.major_page_faults),
        ),
        writable_layer=pb.FilesystemUsage(
            timestamp=usage.timestamp,
            fs_id=pb.FilesystemIdentifier(mountpoint=usage.writable_mountpoint),
            used_bytes=_u64(usage.writable_bytes),
            inodes_used=_u64(usage.writable_inodes),
        ),
    )


def _interface(counters: InterfaceCounters) -> pb.NetworkInterfaceUsage:
    return pb.NetworkInterfaceUsage(
        name=counters.name,
        rx_bytes=_u64(counters.rx_bytes),
        rx_errors=_u64(counters.rx_errors),
        tx_bytes=_u64(counters.tx_bytes),
        tx_errors=_u64(counters.tx_errors),
    )


def pod_sandbox_stats(record: PodRecord, usage: PodUsage) -> pb.PodSandboxStats:
    default = usage.default_interface
    return pb.PodSandboxStats(
        attributes=pb.PodSandboxAttributes(
            id=record.id,
            metadata=pod_metadata(record.metadata),
            labels=record.labels,
            annotations=record.annotations,
        ),
        linux=pb.LinuxPodSandboxStats(
            cpu=pb.CpuUsage(
                timestamp=usage.timestamp,
                usage_core_nano_seconds=_u64(usage.cpu_usage_ns),
                usage_nano_cores=_u64(usage.cpu_nano_cores),
            ),
            memory=pb.MemoryUsage(
                timestamp=usage.timestamp,
                working_set_bytes=_u64(usage.memory_working_set),
                available_bytes=_u64(usage.memory_available),
                usage_bytes=_u64(usage.memory_usage),
                rss_bytes=_u64(usage.memory_rss),
                page_faults=_u64(usage.page_faults),
                major_page_faults=_u64(usage.major_page_faults),
            ),
            network=pb.NetworkUsage(
                timestamp=usage.timestamp,
                default_interface=_interface(default) if default is not None else None,
                interfaces=[_interface(i) for i in usage.interfaces],
            ),
            process=pb.ProcessUsage(timestamp=usage.timestamp, process_count=_u64(usage.processes)),
            containers=[container_stats(c, u) for c, u in usage.containers],
        ),
    )


def container_event(event: ContainerEvent) -> pb.ContainerEventResponse:
    """An event as containerd sends it: the pod's status and all its containers' statuses
    as they were when it happened (no pod status once the pod is gone)."""
    return pb.ContainerEventResponse(
        container_id=event.container_id,
        container_event_type=_EVENT_TYPES[event.type],
        created_at=event.created_at,
        pod_sandbox_status=pod_sandbox_status(event.pod) if event.pod is not None else None,
        containers_statuses=[container_status(c) for c in event.containers],
    )


def runtime_condition(condition: RuntimeCondition) -> pb.RuntimeCondition:
    return pb.RuntimeCondition(
        type=condition.type,
        status=condition.status,
        reason=condition.reason,
        message=condition.message,
    )
