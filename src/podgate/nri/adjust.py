"""Builders for what an NRI plugin answers: a container adjustment (`Adjustment`) and a
container update (`Update`), one method per adjustable field, named after containerd/nri's Go
helpers (`AddEnv`, `RemoveMount`, `SetLinuxMemoryLimit`, …). Removals use NRI's `-` key marker.
Pure: they only fill protobuf messages.

    adjust = Adjustment().add_env("FOO", "bar").add_rlimit("RLIMIT_NOFILE", hard=4096, soft=1024)
    return adjust.message
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Self

from podgate.nri import api_pb2 as api
from podgate.nri.merge import HOOK_KINDS, REMOVAL_PREFIX

__all__ = ["Adjustment", "Resources", "Update"]


class Resources:
    """Setters for a LinuxResources message (shared by adjustments and updates)."""

    def _resources(self) -> api.LinuxResources:
        raise NotImplementedError

    def set_memory_limit(self, limit: int) -> Self:
        self._resources().memory.limit.value = limit
        return self

    def set_memory_reservation(self, reservation: int) -> Self:
        self._resources().memory.reservation.value = reservation
        return self

    def set_memory_swap(self, swap: int) -> Self:
        self._resources().memory.swap.value = swap
        return self

    def set_memory_kernel(self, limit: int) -> Self:
        self._resources().memory.kernel.value = limit
        return self

    def set_memory_kernel_tcp(self, limit: int) -> Self:
        self._resources().memory.kernel_tcp.value = limit
        return self

    def set_memory_use_hierarchy(self, use: bool) -> Self:
        self._resources().memory.use_hierarchy.value = use
        return self

    def set_memory_swappiness(self, swappiness: int) -> Self:
        self._resources().memory.swappiness.value = swappiness
        return self

    def set_memory_disable_oom_killer(self, disable: bool) -> Self:
        self._resources().memory.disable_oom_killer.value = disable
        return self

    def set_cpu_shares(self, shares: int) -> Self:
        self._resources().cpu.shares.value = shares
        return self

    def set_cpu_quota(self, quota: int) -> Self:
        self._resources().cpu.quota.value = quota
        return self

    def set_cpu_period(self, period: int) -> Self:
        self._resources().cpu.period.value = period
        return self

    def set_cpu_realtime(self, runtime: int, period: int) -> Self:
        self._resources().cpu.realtime_runtime.value = runtime
        self._resources().cpu.realtime_period.value = period
        return self

    def set_cpuset_cpus(self, cpus: str) -> Self:
        self._resources().cpu.cpus = cpus
        return self

    def set_cpuset_mems(self, mems: str) -> Self:
        self._resources().cpu.mems = mems
        return self

    def add_hugepage_limit(self, page_size: str, limit: int) -> Self:
        self._resources().hugepage_limits.add(page_size=page_size, limit=limit)
        return self

    def set_blockio_class(self, name: str) -> Self:
        self._resources().blockio_class.value = name
        return self

    def set_rdt_class(self, name: str) -> Self:
        self._resources().rdt_class.value = name
        return self

    def set_unified(self, key: str, value: str) -> Self:
        self._resources().unified[key] = value
        return self

    def set_pids_limit(self, limit: int) -> Self:
        self._resources().pids.limit = limit
        return self

    def add_device_rule(
        self, *, allow: bool, kind: str = "a", major: int | None = None,
        minor: int | None = None, access: str = "rwm",
    ) -> Self:  # fmt: skip
        rule = self._resources().devices.add(allow=allow, type=kind, access=access)
        if major is not None:
            rule.major.value = major
        if minor is not None:
            rule.minor.value = minor
        return self


class Adjustment(Resources):
    """A ContainerAdjustment under construction; `message` is the result."""

    def __init__(self) -> None:
        self.message = api.ContainerAdjustment()

    def _resources(self) -> api.LinuxResources:
        return self.message.linux.resources

    # -- annotations, mounts, env, args, hooks, rlimits, CDI
    def add_annotation(self, key: str, value: str) -> Self:
        self.message.annotations[key] = value
        return self

    def remove_annotation(self, key: str) -> Self:
        self.message.annotations[REMOVAL_PREFIX + key] = ""
        return self

    def add_mount(
        self, destination: str, source: str, kind: str = "bind", options: Sequence[str] = ()
    ) -> Self:
        self.message.mounts.add(destination=destination, source=source, type=kind, options=options)
        return self

    def remove_mount(self, destination: str) -> Self:
        self.message.mounts.add(destination=REMOVAL_PREFIX + destination)
        return self

    def add_env(self, key: str, value: str) -> Self:
        self.message.env.add(key=key, value=value)
        return self

    def remove_env(self, key: str) -> Self:
        self.message.env.add(key=REMOVAL_PREFIX + key)
        return self

    def set_args(self, args: Sequence[str]) -> Self:
        """Replace the command line; conflicts with another plugin that sets it too."""
        del self.message.args[:]
        self.message.args.extend(args)
        return self

    def replace_args(self, args: Sequence[str]) -> Self:
        """Replace the command line, overriding other plugins (upstream's UpdateArgs)."""
        return self.set_args(["", *args])

    def add_hook(
        self, kind: str, path: str, args: Sequence[str] = (), env: Sequence[str] = (),
        timeout: int | None = None,
    ) -> Self:  # fmt: skip
        """An OCI hook; `kind` is one of HOOK_KINDS (prestart, create_runtime, …, poststop);
        `timeout` in seconds."""
        if kind not in HOOK_KINDS:
            raise ValueError(f"unknown OCI hook kind {kind!r}")
        hook = getattr(self.message.hooks, kind).add(path=path, args=args, env=env)
        if timeout is not None:
            hook.timeout.value = timeout
        return self

    def add_rlimit(self, kind: str, *, hard: int, soft: int) -> Self:
        self.message.rlimits.add(type=kind, hard=hard, soft=soft)
        return self

    def add_cdi_device(self, name: str) -> Self:
        self.message.CDI_devices.add(name=name)
        return self

    # -- linux
    def add_device(
        self, path: str, kind: str, major: int, minor: int, *, file_mode: int | None = None,
        uid: int | None = None, gid: int | None = None,
    ) -> Self:  # fmt: skip
        device = self.message.linux.devices.add(path=path, type=kind, major=major, minor=minor)
        if file_mode is not None:
            device.file_mode.value = file_mode
        if uid is not None:
            device.uid.value = uid
        if gid is not None:
            device.gid.value = gid
        return self

    def remove_device(self, path: str) -> Self:
        self.message.linux.devices.add(path=REMOVAL_PREFIX + path)
        return self

    def set_cgroups_path(self, path: str) -> Self:
        self.message.linux.cgroups_path = path
        return self

    def set_oom_score_adj(self, value: int) -> Self:
        self.message.linux.oom_score_adj.value = value
        return self

    def set_io_priority(self, klass: api.IOPrioClass.ValueType, priority: int) -> Self:
        # `class` is a Python keyword: the field is set by name
        self.message.linux.io_priority.CopyFrom(
            api.LinuxIOPriority(**{"class": klass, "priority": priority})
        )
        return self

    def set_seccomp_policy(self, policy: api.LinuxSeccomp) -> Self:
        self.message.linux.seccomp_policy.CopyFrom(policy)
        return self

    def add_namespace(self, kind: str, path: str = "") -> Self:
        self.message.linux.namespaces.add(type=kind, path=path)
        return self

    def remove_namespace(self, kind: str) -> Self:
        self.message.linux.namespaces.add(type=REMOVAL_PREFIX + kind)
        return self

    def set_sysctl(self, key: str, value: str) -> Self:
        self.message.linux.sysctl[key] = value
        return self

    def remove_sysctl(self, key: str) -> Self:
        self.message.linux.sysctl[REMOVAL_PREFIX + key] = ""
        return self

    def add_net_device(self, host_name: str, name: str) -> Self:
        self.message.linux.net_devices[host_name].name = name
        return self

    def remove_net_device(self, host_name: str) -> Self:
        self.message.linux.net_devices[REMOVAL_PREFIX + host_name].Clear()
        return self

    def set_scheduler(self, scheduler: api.LinuxScheduler) -> Self:
        self.message.linux.scheduler.CopyFrom(scheduler)
        return self

    def set_rdt_clos_id(self, clos_id: str) -> Self:
        self.message.linux.rdt.clos_id.value = clos_id
        return self

    def set_rdt_schemata(self, schemata: Iterable[str]) -> Self:
        self.message.linux.rdt.schemata.value.extend(schemata)
        return self

    def set_rdt_monitoring(self, enable: bool) -> Self:
        self.message.linux.rdt.enable_monitoring.value = enable
        return self

    def remove_rdt(self) -> Self:
        self.message.linux.rdt.remove = True
        return self

    def set_memory_policy(
        self, mode: api.MpolMode.ValueType, nodes: str, flags: Iterable[api.MpolFlag.ValueType] = ()
    ) -> Self:
        self.message.linux.memory_policy.CopyFrom(
            api.LinuxMemoryPolicy(mode=mode, nodes=nodes, flags=flags)
        )
        return self


class Update(Resources):
    """A ContainerUpdate under construction; `message` is the result."""

    def __init__(self, container_id: str, *, ignore_failure: bool = False) -> None:
        self.message = api.ContainerUpdate(container_id=container_id, ignore_failure=ignore_failure)

    def _resources(self) -> api.LinuxResources:
        return self.message.linux.resources
