"""podgate's runtime records as NRI messages, and a merged NRI adjustment applied back to a
container's spec. Pure functions: no I/O.

Mounts follow containerd's CRI → OCI mapping: a CRI mount is an OCI bind mount with options
`rbind`, the propagation (`rprivate`, `rslave`, `rshared`) and `ro`/`rw` (plus `rro` for a
recursive read-only one); an NRI mount coming back is read the same way. Only what
`ContainerSpec` can hold is applied: env, args, mounts and annotations — `APPLIED_FIELDS`, the
one table of what reaches a container. Everything else a plugin may set (hooks, devices,
rlimits, resources, …) is merged and validated by the adaptation, and then refused by the
runtime by name rather than dropped (runtime.nri).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from podgate.model import (
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    NamespaceMode,
    PodRecord,
)
from podgate.nri import api_pb2 as api
from podgate.nri.merge import REMOVAL_PREFIX, Field

__all__ = [
    "APPLIED_FIELDS",
    "apply_adjustment",
    "container",
    "mount_from_nri",
    "mount_to_nri",
    "pod_sandbox",
]

_STATES: dict[ContainerState, api.ContainerState.ValueType] = {
    ContainerState.CREATED: api.CONTAINER_CREATED,
    ContainerState.RUNNING: api.CONTAINER_RUNNING,
    ContainerState.EXITED: api.CONTAINER_STOPPED,
    ContainerState.UNKNOWN: api.CONTAINER_UNKNOWN,
}
# CRI MountPropagation names (as ContainerSpec.mounts stores them) <-> OCI mount options.
_PROPAGATION_OPTIONS = {
    "PROPAGATION_PRIVATE": "rprivate",
    "PROPAGATION_HOST_TO_CONTAINER": "rslave",
    "PROPAGATION_BIDIRECTIONAL": "rshared",
}
_PROPAGATION_FROM_OPTION = {
    "private": "PROPAGATION_PRIVATE",
    "rprivate": "PROPAGATION_PRIVATE",
    "slave": "PROPAGATION_HOST_TO_CONTAINER",
    "rslave": "PROPAGATION_HOST_TO_CONTAINER",
    "shared": "PROPAGATION_BIDIRECTIONAL",
    "rshared": "PROPAGATION_BIDIRECTIONAL",
}
_BIND = "bind"

# The adjustment fields `apply_adjustment` carries into a container. A plugin that sets any
# other field fails CreateContainer with its name and the field's; add a field here in the same
# change that applies it to the container's OCI spec.
APPLIED_FIELDS: frozenset[Field] = frozenset(
    {
        Field.ANNOTATIONS,
        Field.MOUNTS,
        Field.ENV,
        Field.ARGS,
    }
)


# ----------------------------------------------------------------------------- records → NRI


def pod_sandbox(pod: PodRecord, *, netns_path: str, ips: Sequence[str]) -> api.PodSandbox:
    """The pod as plugins see it. `netns_path` is the network namespace plugins configure
    ("" for host-network pods or when it is gone); `ips` lists the primary IP first."""
    message = api.PodSandbox(
        id=pod.id,
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        namespace=pod.metadata.namespace,
        labels=pod.labels,
        annotations=pod.annotations,
        runtime_handler=pod.runtime_handler,
        pid=pod.ns_process.pid if pod.ns_process is not None else 0,
        ips=[ip for ip in ips if ip],
    )
    namespaces = message.linux.namespaces
    if pod.network_mode is not NamespaceMode.NODE and netns_path:
        namespaces.add(type="network", path=netns_path)
    if pod.ns_process is not None:
        proc = f"/proc/{pod.ns_process.pid}/ns"
        if pod.ipc_mode is NamespaceMode.POD:
            namespaces.add(type="ipc", path=f"{proc}/ipc")
        if pod.pid_mode is NamespaceMode.POD:
            namespaces.add(type="pid", path=f"{proc}/pid")
    return message


def mount_to_nri(mount: dict[str, Any]) -> api.Mount:
    """A ContainerSpec mount (CRI fields) as the OCI bind mount containerd would make of it."""
    options = [
        "rbind",
        _PROPAGATION_OPTIONS.get(str(mount.get("propagation", "")), "rprivate"),
        "ro" if mount.get("readonly") else "rw",
    ]
    if mount.get("recursive_read_only"):
        options.append("rro")
    return api.Mount(
        destination=str(mount.get("container_path", "")),
        type=_BIND,
        source=str(mount.get("host_path", "")),
        options=options,
    )


def container(c: ContainerRecord) -> api.Container:
    """The container as plugins see it: args are command + args, env "KEY=value"."""
    return api.Container(
        id=c.id,
        pod_sandbox_id=c.pod_id,
        name=c.metadata.name,
        state=_STATES[c.state],
        labels=c.labels,
        annotations=c.annotations,
        args=[*c.spec.command, *c.spec.args],
        env=[f"{key}={value}" for key, value in c.spec.envs.items()],
        mounts=[mount_to_nri(mount) for mount in c.spec.mounts],
        pid=c.process.pid if c.process is not None else 0,
        created_at=c.created_at,
        started_at=c.started_at,
        finished_at=c.finished_at,
        exit_code=c.exit_code,
        status_reason=c.reason,
        status_message=c.message,
    )


# ----------------------------------------------------------------------------- NRI → spec


def mount_from_nri(mount: api.Mount) -> dict[str, Any]:
    """An NRI mount as a ContainerSpec mount (the CRI fields `runtime.cri.convert` stores)."""
    options = set(mount.options)
    propagation = "PROPAGATION_PRIVATE"
    for option in mount.options:
        propagation = _PROPAGATION_FROM_OPTION.get(option, propagation)
    return {
        "container_path": mount.destination,
        "host_path": mount.source,
        "readonly": "ro" in options or "rro" in options,
        "selinux_relabel": False,
        "propagation": propagation,
        "recursive_read_only": "rro" in options,
    }


def apply_adjustment(
    spec: ContainerSpec, annotations: MutableMapping[str, str], adjust: api.ContainerAdjustment
) -> None:
    """Apply a (merged) adjustment in place: in each field removals (`-key`) first, then what
    is set, as upstream applies one reply. Args replace command + args as a whole."""
    for kv in adjust.env:
        if kv.key.startswith(REMOVAL_PREFIX):
            spec.envs.pop(kv.key[len(REMOVAL_PREFIX) :], None)
    for kv in adjust.env:
        if not kv.key.startswith(REMOVAL_PREFIX):
            spec.envs[kv.key] = kv.value

    args = list(adjust.args)
    if args and args[0] == "":  # upstream's "replace, do not conflict" marker
        args = args[1:]
    if args:
        spec.command, spec.args = args, []

    removed = {
        m.destination[len(REMOVAL_PREFIX) :]
        for m in adjust.mounts
        if m.destination.startswith(REMOVAL_PREFIX)
    }
    added = [m for m in adjust.mounts if not m.destination.startswith(REMOVAL_PREFIX)]
    replaced = removed | {m.destination for m in added}
    spec.mounts = [m for m in spec.mounts if m.get("container_path") not in replaced]
    spec.mounts.extend(mount_from_nri(m) for m in added)

    for key in adjust.annotations:
        if key.startswith(REMOVAL_PREFIX):
            annotations.pop(key[len(REMOVAL_PREFIX) :], None)
    for key, value in adjust.annotations.items():
        if not key.startswith(REMOVAL_PREFIX):
            annotations[key] = value
