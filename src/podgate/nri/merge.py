"""The pure parts of the NRI adaptation: merging plugins' CreateContainer adjustments, checking
event masks, and aggregating PodSandboxStatus answers. No I/O, no clock.

Adjustments are merged plugin by plugin in invocation order (containerd/nri `result.go`,
reference §6.7). Every adjustable field has an owner: a simple field (memory limit, args, …)
one, a compound field (env, annotations, mounts, rlimits, unified cgroup keys) one per entry.
A plugin that sets what another plugin already owns fails the whole creation with
`plugins "<this>" and "<owner>" both tried to set <Field> <key>` — the plugin asking now first,
the earlier owner second, the field by its upstream `api.Field` name, the entry key after it
(nothing after the space for a simple field), exactly as upstream's `FieldOwners.Conflict`.

Every field a plugin set is also recorded as a `Claim` (plugin, field, key), so the runtime can
refuse what it cannot apply by name (`unapplied`) instead of dropping it.

Removal is how a plugin overrides on purpose. An env name, annotation key or mount destination
prefixed with `-` removes the entry (from the container and from earlier plugins' adjustments)
and records the remover as its owner, marked for removal (`-<plugin>`, as upstream's
`ClearEnv`). The plugin that removed an entry may set it again (in the same reply: removals are
applied first); any other plugin that sets it later conflicts with the remover. Removing never
conflicts. `args` works the same with upstream's marker, a leading "". OCI hooks never
conflict: they accumulate, and their owner reads "a,b". Devices (by path), namespaces (by type),
sysctls (by key) and network devices (by host interface) take `-` removals too; CDI devices,
hugepage limits (by page size), unified cgroup keys and rlimits are added only. Device cgroup
rules (`resources.devices`, NRI v1 emulation) accumulate without an owner, as upstream. An RDT
adjustment with `remove` clears the RDT owners (the remover may set them again).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from podgate.nri import api_pb2 as api

__all__ = [
    "HOOK_KINDS",
    "REMOVAL_PREFIX",
    "VALID_EVENTS",
    "AdjustmentMerger",
    "Claim",
    "ConflictError",
    "Field",
    "MergeResult",
    "NriError",
    "UnappliedAdjustmentError",
    "UpdateCollector",
    "aggregate_pod_ips",
    "event_bit",
    "event_mask",
    "merge_adjustments",
    "subscribed",
    "unapplied",
]

# Every event bit a plugin may subscribe to: events 1..15, i.e. main's 0x3FFF plus
# POD_SANDBOX_STATUS (0x4000, containerd/nri #267), so plugins built from that PR register.
VALID_EVENTS = (1 << (api.LAST - 1)) - 1
_INT32_MASK = 0xFFFFFFFF  # ConfigureResponse.events is an int32; judge its bits unsigned
REMOVAL_PREFIX = "-"  # marks a key (env name, annotation key, mount destination) for removal
HOOK_KINDS = tuple(field.name for field in api.Hooks.DESCRIPTOR.fields)


class NriError(Exception):
    """A plugin failed the operation (an error status, a rejected or conflicting adjustment)."""


class ConflictError(NriError):
    """Two plugins tried to set the same field or entry."""

    def __init__(self, plugin: str, other: str, field: Field, key: str = "") -> None:
        subject = f"{field.upstream_name} {key}"  # upstream's qualify(): name, space, key
        super().__init__(f'plugins "{plugin}" and "{other}" both tried to set {subject}')
        self.plugin = plugin
        self.other = other
        self.field = field
        self.key = key


@dataclass(frozen=True, slots=True)
class Claim:
    """One thing a plugin set (or removed, `removed`) in its adjustment."""

    plugin: str
    field: Field
    key: str = ""  # the entry of a compound field; "" for a simple one
    removed: bool = False


class UnappliedAdjustmentError(NriError):
    """A plugin set something the runtime cannot apply to the container (yet)."""

    def __init__(self, claims: Sequence[Claim]) -> None:
        first = claims[0]
        what = f"{first.field.upstream_name} {first.key}".rstrip()
        verb = "removed" if first.removed else "set"
        more = f" (and {len(claims) - 1} more)" if len(claims) > 1 else ""
        super().__init__(
            f'plugin "{first.plugin}" {verb} {what}, which this runtime cannot apply to '
            f"containers yet{more}"
        )
        self.claims = list(claims)


def unapplied(claims: Iterable[Claim], applied: Collection[Field]) -> list[Claim]:
    """The claims whose field the runtime does not apply (see convert.APPLIED_FIELDS)."""
    return [claim for claim in claims if claim.field not in applied]


class Field(enum.IntEnum):
    """Adjustable fields, numbered as upstream's `api.Field` (the keys of `FieldOwners`)."""

    ANNOTATIONS = api.Annotations
    MOUNTS = api.Mounts
    OCI_HOOKS = api.OciHooks
    DEVICES = api.Devices
    CDI_DEVICES = api.CdiDevices
    ENV = api.Env
    ARGS = api.Args
    MEM_LIMIT = api.MemLimit
    MEM_RESERVATION = api.MemReservation
    MEM_SWAP_LIMIT = api.MemSwapLimit
    MEM_KERNEL_LIMIT = api.MemKernelLimit
    MEM_TCP_LIMIT = api.MemTCPLimit
    MEM_SWAPPINESS = api.MemSwappiness
    MEM_DISABLE_OOM_KILLER = api.MemDisableOomKiller
    MEM_USE_HIERARCHY = api.MemUseHierarchy
    CPU_SHARES = api.CPUShares
    CPU_QUOTA = api.CPUQuota
    CPU_PERIOD = api.CPUPeriod
    CPU_REALTIME_RUNTIME = api.CPURealtimeRuntime
    CPU_REALTIME_PERIOD = api.CPURealtimePeriod
    CPUSET_CPUS = api.CPUSetCPUs
    CPUSET_MEMS = api.CPUSetMems
    PIDS_LIMIT = api.PidsLimit
    HUGEPAGE_LIMITS = api.HugepageLimits
    BLOCKIO_CLASS = api.BlockioClass
    RDT_CLASS = api.RdtClass
    CGROUPS_UNIFIED = api.CgroupsUnified
    CGROUPS_PATH = api.CgroupsPath
    OOM_SCORE_ADJ = api.OomScoreAdj
    RLIMITS = api.Rlimits
    IO_PRIORITY = api.IoPriority
    SECCOMP_POLICY = api.SeccompPolicy
    NAMESPACE = api.Namespace
    SYSCTL = api.Sysctl
    NET_DEVICES = api.LinuxNetDevices
    SCHEDULER = api.LinuxSched
    RDT_CLOS_ID = api.RdtClosID
    RDT_SCHEMATA = api.RdtSchemata
    RDT_ENABLE_MONITORING = api.RdtEnableMonitoring
    MEMORY_POLICY = api.MemoryPolicy
    # Not an upstream Field (upstream keeps no owner for them): device cgroup rules in
    # LinuxResources.devices, so a rule the runtime cannot apply is still refused by name.
    DEVICE_CGROUP_RULES = 1000

    @property
    def upstream_name(self) -> str:
        """How upstream spells the field (`api.Field` names, as in conflict messages)."""
        if self is Field.DEVICE_CGROUP_RULES:
            return "LinuxResources.Devices"
        return api.Field.Name(api.Field.ValueType(self))


# (LinuxResources group, field, owner key, name in conflict messages). Wrapper-typed fields
# (OptionalInt64, …) count as set when present; the cpuset strings when non-empty.
_RESOURCE_FIELDS: tuple[tuple[str, str, Field], ...] = (
    ("memory", "limit", Field.MEM_LIMIT),
    ("memory", "reservation", Field.MEM_RESERVATION),
    ("memory", "swap", Field.MEM_SWAP_LIMIT),
    ("memory", "kernel", Field.MEM_KERNEL_LIMIT),
    ("memory", "kernel_tcp", Field.MEM_TCP_LIMIT),
    ("memory", "swappiness", Field.MEM_SWAPPINESS),
    ("memory", "disable_oom_killer", Field.MEM_DISABLE_OOM_KILLER),
    ("memory", "use_hierarchy", Field.MEM_USE_HIERARCHY),
    ("cpu", "shares", Field.CPU_SHARES),
    ("cpu", "quota", Field.CPU_QUOTA),
    ("cpu", "period", Field.CPU_PERIOD),
    ("cpu", "realtime_runtime", Field.CPU_REALTIME_RUNTIME),
    ("cpu", "realtime_period", Field.CPU_REALTIME_PERIOD),
    ("cpu", "cpus", Field.CPUSET_CPUS),
    ("cpu", "mems", Field.CPUSET_MEMS),
)
# (LinuxContainerAdjustment field, owner key) for whole-message simple fields.
_LINUX_MESSAGE_FIELDS: tuple[tuple[str, Field], ...] = (
    ("oom_score_adj", Field.OOM_SCORE_ADJ),
    ("io_priority", Field.IO_PRIORITY),
    ("seccomp_policy", Field.SECCOMP_POLICY),
    ("scheduler", Field.SCHEDULER),
    ("memory_policy", Field.MEMORY_POLICY),
)
_RDT_FIELDS: tuple[tuple[str, Field], ...] = (
    ("clos_id", Field.RDT_CLOS_ID),
    ("schemata", Field.RDT_SCHEMATA),
    ("enable_monitoring", Field.RDT_ENABLE_MONITORING),
)
_STRING_RESOURCE_FIELDS = frozenset({"cpus", "mems"})
# LinuxContainerAdjustment fields the Container message (what later plugins see) also has.
_CONTAINER_LINUX_FIELDS = frozenset(
    name
    for name, _ in _LINUX_MESSAGE_FIELDS
    if name in api.LinuxContainer.DESCRIPTOR.fields_by_name
)


# ----------------------------------------------------------------------------- event masks


def event_bit(event: int) -> int:
    """The mask bit of an `api.Event`."""
    return 1 << (event - 1)


def event_mask(events: int) -> int:
    """A plugin's ConfigureResponse.events, checked: 0 means every event; bits outside
    VALID_EVENTS fail the registration with upstream's "invalid plugin events: 0x…"."""
    events &= _INT32_MASK
    if events == 0:
        return VALID_EVENTS
    extra = events & ~VALID_EVENTS
    if extra:
        raise NriError(f"invalid plugin events: 0x{extra:x}")
    return events


def subscribed(mask: int, event: int) -> bool:
    return bool(mask & event_bit(event))


# ----------------------------------------------------------------------------- PodSandboxStatus


def aggregate_pod_ips(replies: Iterable[api.PodSandboxStatusResponse]) -> tuple[str, list[str]]:
    """PodSandboxStatus answers (in plugin order) as (ip, additional_ips), the way
    containerd/nri #267 revision 2 aggregates them: the first non-empty `ip` is the pod IP;
    later plugins' `ip` and every plugin's `additional_ips` follow in order. Empty strings and
    repeats (of the pod IP too) are dropped, the first occurrence kept."""
    primary = ""
    additional: list[str] = []
    seen: set[str] = set()

    def add(address: str) -> None:
        if address and address not in seen:
            seen.add(address)
            additional.append(address)

    for reply in replies:
        if reply.ip and not primary:
            primary = reply.ip
            seen.add(primary)
            if primary in additional:  # an earlier plugin listed it as an additional IP
                additional.remove(primary)
        else:
            add(reply.ip)
        for address in reply.additional_ips:
            add(address)
    return primary, additional


# ----------------------------------------------------------------------------- adjustments


@dataclass(frozen=True, slots=True)
class MergeResult:
    adjust: api.ContainerAdjustment
    owners: api.OwningPlugins
    claims: tuple[Claim, ...] = ()  # everything set or removed, by whom, in merge order


def _removal(key: str) -> tuple[str, bool]:
    if key.startswith(REMOVAL_PREFIX):
        return key[len(REMOVAL_PREFIX) :], True
    return key, False


class AdjustmentMerger:
    """Collects CreateContainer replies plugin by plugin (`apply`), tracking ownership.

    `container` is the container as the next plugin should see it: the original with every
    accepted adjustment applied (upstream hands later plugins the adjusted request too).
    """

    def __init__(self, container: api.Container) -> None:
        self.container_id = container.id
        self.container = api.Container()
        self.container.CopyFrom(container)
        self._simple: dict[Field, str] = {}
        self._compound: dict[Field, dict[str, str]] = {}
        self._claims: list[Claim] = []
        # Entry key -> value, or None for "remove"; insertion order is the output order.
        self._env: dict[str, str | None] = {}
        self._annotations: dict[str, str | None] = {}
        self._mounts: dict[str, api.Mount | None] = {}
        self._devices: dict[str, api.LinuxDevice | None] = {}
        self._sysctl: dict[str, str | None] = {}
        self._net_devices: dict[str, api.LinuxNetDevice | None] = {}
        self._rlimits: dict[str, api.POSIXRlimit] = {}
        self._cdi_devices: list[api.CDIDevice] = []
        self._namespaces: list[api.LinuxNamespace] = []
        self._args: list[str] | None = None
        self._hooks = api.Hooks()
        self._linux = api.LinuxContainerAdjustment()

    # -- ownership
    def _claim_simple(self, field: Field, plugin: str) -> None:
        _check_owner(self._simple.get(field), plugin, field)
        self._simple[field] = plugin
        self._claims.append(Claim(plugin, field))

    def _clear_simple(self, field: Field, plugin: str) -> None:
        self._simple[field] = REMOVAL_PREFIX + plugin

    def _claim_entry(self, field: Field, key: str, plugin: str, *, removed: bool = False) -> None:
        owners = self._compound.setdefault(field, {})
        _check_owner(owners.get(key), plugin, field, key)
        owners[key] = plugin
        self._claims.append(Claim(plugin, field, key, removed))

    def _clear_entry(self, field: Field, key: str, plugin: str) -> None:
        self._compound.setdefault(field, {})[key] = REMOVAL_PREFIX + plugin
        self._claims.append(Claim(plugin, field, key, removed=True))

    # -- merging
    def apply(self, plugin: str, adjust: api.ContainerAdjustment | None) -> None:
        """Merge one plugin's adjustment (`plugin` is its full "idx-name"); ConflictError if it
        touches what another plugin owns. After an error the merger must not be used again."""
        if adjust is None:
            return
        self._merge_annotations(plugin, adjust.annotations)
        self._merge_mounts(plugin, adjust.mounts)
        self._merge_env(plugin, adjust.env)
        self._merge_args(plugin, adjust.args)
        if adjust.HasField("hooks"):
            self._merge_hooks(plugin, adjust.hooks)
        if adjust.HasField("linux"):
            self._merge_linux(plugin, adjust.linux)
        self._merge_rlimits(plugin, adjust.rlimits)
        self._merge_cdi_devices(plugin, adjust.CDI_devices)

    def _merge_keyed(
        self,
        plugin: str,
        field: Field,
        merged: dict[str, Any],
        entries: Sequence[tuple[str, Any]],
    ) -> tuple[dict[str, Any], list[str]]:
        """A compound field whose entries are keyed and may be `-`-removed: removals first
        (clearing ownership), then claims. Returns (set entries, removed keys)."""
        removed = _removed_keys(key for key, _ in entries)
        for key in removed:
            self._clear_entry(field, key, plugin)
            merged.pop(key, None)
            merged[key] = None
        added: dict[str, Any] = {}
        for key, value in entries:
            if not key.startswith(REMOVAL_PREFIX):
                self._claim_entry(field, key, plugin)
                added[key] = value
        for key, value in added.items():
            merged.pop(key, None)
            merged[key] = value
        return added, removed

    def _merge_env(self, plugin: str, env: Sequence[api.KeyValue]) -> None:
        values, removed = self._merge_keyed(
            plugin, Field.ENV, self._env, [(kv.key, kv.value) for kv in env]
        )
        changed = set(values) | set(removed)
        kept = [item for item in self.container.env if item.partition("=")[0] not in changed]
        self.container.ClearField("env")
        self.container.env.extend(kept + [f"{name}={value}" for name, value in values.items()])

    def _merge_annotations(self, plugin: str, annotations: Mapping[str, str]) -> None:
        values, removed = self._merge_keyed(
            plugin, Field.ANNOTATIONS, self._annotations, sorted(annotations.items())
        )
        for key in removed:
            self.container.annotations.pop(key, None)
        self.container.annotations.update(values)

    def _merge_mounts(self, plugin: str, mounts: Sequence[api.Mount]) -> None:
        added, removed = self._merge_keyed(
            plugin, Field.MOUNTS, self._mounts, [(m.destination, m) for m in mounts]
        )
        changed = set(added) | set(removed)
        kept = [m for m in self.container.mounts if m.destination not in changed]
        self.container.ClearField("mounts")
        self.container.mounts.extend(kept + list(added.values()))

    def _merge_args(self, plugin: str, args: Sequence[str]) -> None:
        if not args:
            return
        replacement = list(args)
        if replacement[0] == "":  # upstream's removal marker for the simple `args` field
            self._clear_simple(Field.ARGS, plugin)
            replacement = replacement[1:]
        self._claim_simple(Field.ARGS, plugin)
        self._args = replacement
        self.container.ClearField("args")
        self.container.args.extend(replacement)

    def _merge_hooks(self, plugin: str, hooks: api.Hooks) -> None:
        added = False
        for kind in HOOK_KINDS:
            entries = getattr(hooks, kind)
            if entries:
                getattr(self._hooks, kind).extend(entries)
                getattr(self.container.hooks, kind).extend(entries)
                added = True
        if added:
            current = self._simple.get(Field.OCI_HOOKS)
            self._simple[Field.OCI_HOOKS] = f"{current},{plugin}" if current else plugin
            self._claims.append(Claim(plugin, Field.OCI_HOOKS))

    def _merge_linux(self, plugin: str, linux: api.LinuxContainerAdjustment) -> None:
        seen = self.container.linux
        if linux.devices:
            added, removed = self._merge_keyed(
                plugin, Field.DEVICES, self._devices, [(d.path, d) for d in linux.devices]
            )
            changed = set(added) | set(removed)
            kept = [d for d in seen.devices if d.path not in changed]
            seen.ClearField("devices")
            seen.devices.extend(kept + list(added.values()))
        if linux.HasField("resources"):
            self._merge_resources(plugin, linux.resources)
        if linux.cgroups_path:
            self._claim_simple(Field.CGROUPS_PATH, plugin)
            self._linux.cgroups_path = linux.cgroups_path
            seen.cgroups_path = linux.cgroups_path
        for name, field in _LINUX_MESSAGE_FIELDS:
            if linux.HasField(name):  # type: ignore[arg-type]
                self._claim_simple(field, plugin)
                getattr(self._linux, name).CopyFrom(getattr(linux, name))
                if name in _CONTAINER_LINUX_FIELDS:
                    getattr(seen, name).CopyFrom(getattr(linux, name))
        self._merge_namespaces(plugin, linux.namespaces)
        if linux.sysctl:
            values, removed = self._merge_keyed(
                plugin, Field.SYSCTL, self._sysctl, sorted(linux.sysctl.items())
            )
            for key in removed:
                seen.sysctl.pop(key, None)
            seen.sysctl.update(values)
        if linux.net_devices:
            devices, removed = self._merge_keyed(
                plugin, Field.NET_DEVICES, self._net_devices, sorted(linux.net_devices.items())
            )
            for key in removed:
                seen.net_devices.pop(key, None)
            for key, device in devices.items():
                seen.net_devices[key].CopyFrom(device)
        if linux.HasField("rdt"):
            self._merge_rdt(plugin, linux.rdt)

    def _merge_namespaces(self, plugin: str, namespaces: Sequence[api.LinuxNamespace]) -> None:
        """Upstream claims a namespace type for a removal (`-type`) as well as for a set."""
        seen = self.container.linux
        for namespace in namespaces:
            kind, removed = _removal(namespace.type)
            self._claim_entry(Field.NAMESPACE, kind, plugin, removed=removed)
            self._namespaces.append(namespace)
            kept = [n for n in seen.namespaces if n.type != kind]
            if not removed:
                kept.append(namespace)
            seen.ClearField("namespaces")
            seen.namespaces.extend(kept)

    def _merge_rdt(self, plugin: str, rdt: api.LinuxRdt) -> None:
        merged = self._linux.rdt
        if rdt.remove:
            for _, field in _RDT_FIELDS:
                self._clear_simple(field, plugin)
            self._claims.append(Claim(plugin, Field.RDT_CLOS_ID, removed=True))
            merged.Clear()
            merged.remove = True
        for name, field in _RDT_FIELDS:
            if rdt.HasField(name):  # type: ignore[arg-type]
                self._claim_simple(field, plugin)
                getattr(merged, name).CopyFrom(getattr(rdt, name))
        if not merged.ListFields():
            self._linux.ClearField("rdt")
        self.container.linux.rdt.CopyFrom(merged)

    def merge_resources(self, plugin: str, resources: api.LinuxResources) -> None:
        """Resources alone, as a container update carries them (ownership as in `apply`)."""
        self._merge_resources(plugin, resources)

    def merged_resources(self) -> api.LinuxResources:
        return self._linux.resources

    def _merge_resources(self, plugin: str, resources: api.LinuxResources) -> None:
        merged = self._linux.resources
        seen = self.container.linux.resources
        for group_name, name, field in _RESOURCE_FIELDS:
            if not resources.HasField(group_name):  # type: ignore[arg-type]
                continue
            group: Any = getattr(resources, group_name)
            if name in _STRING_RESOURCE_FIELDS:
                value = getattr(group, name)
                if not value:
                    continue
                self._claim_simple(field, plugin)
                setattr(getattr(merged, group_name), name, value)
                setattr(getattr(seen, group_name), name, value)
            elif group.HasField(name):
                self._claim_simple(field, plugin)
                getattr(getattr(merged, group_name), name).CopyFrom(getattr(group, name))
                getattr(getattr(seen, group_name), name).CopyFrom(getattr(group, name))
        for limit in resources.hugepage_limits:
            self._claim_entry(Field.HUGEPAGE_LIMITS, limit.page_size, plugin)
            merged.hugepage_limits.append(limit)
            seen.hugepage_limits.append(limit)
        if resources.devices:  # cgroup device rules accumulate; upstream keeps no owner
            merged.devices.extend(resources.devices)
            seen.devices.extend(resources.devices)
            self._claims.append(Claim(plugin, Field.DEVICE_CGROUP_RULES))
        if resources.HasField("pids"):
            self._claim_simple(Field.PIDS_LIMIT, plugin)
            merged.pids.CopyFrom(resources.pids)
            seen.pids.CopyFrom(resources.pids)
        for message_field, field in (
            ("blockio_class", Field.BLOCKIO_CLASS),
            ("rdt_class", Field.RDT_CLASS),
        ):
            if resources.HasField(message_field):  # type: ignore[arg-type]
                self._claim_simple(field, plugin)
                getattr(merged, message_field).CopyFrom(getattr(resources, message_field))
                getattr(seen, message_field).CopyFrom(getattr(resources, message_field))
        for key, value in sorted(resources.unified.items()):
            self._claim_entry(Field.CGROUPS_UNIFIED, key, plugin)
            merged.unified[key] = value
            seen.unified[key] = value

    def _merge_rlimits(self, plugin: str, rlimits: Sequence[api.POSIXRlimit]) -> None:
        added: dict[str, api.POSIXRlimit] = {}
        for rlimit in rlimits:
            self._claim_entry(Field.RLIMITS, rlimit.type, plugin)
            added[rlimit.type] = rlimit
        if added:
            self._rlimits.update(added)
            kept = [r for r in self.container.rlimits if r.type not in added]
            self.container.ClearField("rlimits")
            self.container.rlimits.extend(kept + list(added.values()))

    def _merge_cdi_devices(self, plugin: str, devices: Sequence[api.CDIDevice]) -> None:
        """CDI devices are only added (upstream resolves them in the runtime); injecting the
        same name twice conflicts."""
        for device in devices:
            self._claim_entry(Field.CDI_DEVICES, device.name, plugin)
            self._cdi_devices.append(device)

    # -- results
    def adjustment(self) -> api.ContainerAdjustment:
        """The merged adjustment: removals as `-`-prefixed entries, then what is set."""
        adjust = api.ContainerAdjustment()
        for name, value in self._env.items():
            adjust.env.append(
                api.KeyValue(key=REMOVAL_PREFIX + name)
                if value is None
                else api.KeyValue(key=name, value=value)
            )
        for key, annotation in self._annotations.items():
            if annotation is None:
                adjust.annotations[REMOVAL_PREFIX + key] = ""
            else:
                adjust.annotations[key] = annotation
        for destination, mount in self._mounts.items():
            adjust.mounts.append(
                api.Mount(destination=REMOVAL_PREFIX + destination) if mount is None else mount
            )
        if self._args is not None:
            adjust.args.extend(self._args)
        if any(getattr(self._hooks, kind) for kind in HOOK_KINDS):
            adjust.hooks.CopyFrom(self._hooks)
        linux = api.LinuxContainerAdjustment()
        linux.CopyFrom(self._linux)
        for path, device in self._devices.items():
            linux.devices.append(
                api.LinuxDevice(path=REMOVAL_PREFIX + path) if device is None else device
            )
        linux.namespaces.extend(self._namespaces)
        for key, sysctl in self._sysctl.items():
            linux.sysctl[key if sysctl is not None else REMOVAL_PREFIX + key] = sysctl or ""
        for key, net_device in self._net_devices.items():
            if net_device is None:
                linux.net_devices[REMOVAL_PREFIX + key].Clear()
            else:
                linux.net_devices[key].CopyFrom(net_device)
        if linux.ListFields():
            adjust.linux.CopyFrom(linux)
        adjust.rlimits.extend(self._rlimits.values())
        adjust.CDI_devices.extend(self._cdi_devices)
        return adjust

    def owners(self) -> api.OwningPlugins:
        """Who set what, in upstream's `OwningPlugins` shape (for validator plugins)."""
        field_owners = api.FieldOwners()
        for field, owner in self._simple.items():
            field_owners.simple[int(field)] = owner
        for field, entries in self._compound.items():
            field_owners.compound[int(field)].owners.update(entries)
        owning = api.OwningPlugins()
        owning.owners[self.container_id].CopyFrom(field_owners)
        return owning

    def result(self) -> MergeResult:
        return MergeResult(self.adjustment(), self.owners(), tuple(self._claims))


class UpdateCollector:
    """Container updates from several plugins, merged per container with the same ownership
    rules as adjustments (upstream's `result.update`); `creating` is the id of a container
    being created, which no plugin may update ("plugin %q asked update of %q during
    creation")."""

    def __init__(self, *, creating: str = "", requested: api.ContainerUpdate | None = None) -> None:
        self._creating = creating
        self._mergers: dict[str, AdjustmentMerger] = {}
        self._ignore_failure: dict[str, bool] = {}
        self.evictions: list[api.ContainerEviction] = []
        if requested is not None:  # UpdateContainer: the runtime's own request comes first
            merger = self._merger(requested.container_id, requested.ignore_failure)
            merger.merged_resources().CopyFrom(requested.linux.resources)  # no owner: the base

    def _merger(self, container_id: str, ignore_failure: bool) -> AdjustmentMerger:
        merger = self._mergers.get(container_id)
        if merger is None:
            merger = self._mergers[container_id] = AdjustmentMerger(api.Container(id=container_id))
            self._ignore_failure[container_id] = ignore_failure
        else:  # upstream: a failure is ignored only if every plugin said so
            self._ignore_failure[container_id] &= ignore_failure
        return merger

    def add(self, plugin: str, updates: Iterable[api.ContainerUpdate]) -> None:
        for update in updates:
            if self._creating and update.container_id == self._creating:
                raise NriError(
                    f'plugin "{plugin}" asked update of "{update.container_id}" during creation'
                )
            merger = self._merger(update.container_id, update.ignore_failure)
            if update.HasField("linux") and update.linux.HasField("resources"):
                merger.merge_resources(plugin, update.linux.resources)

    def evict(self, evictions: Iterable[api.ContainerEviction]) -> None:
        self.evictions.extend(evictions)

    def updates(self) -> list[api.ContainerUpdate]:
        result = []
        for container_id, merger in self._mergers.items():
            update = api.ContainerUpdate(
                container_id=container_id, ignore_failure=self._ignore_failure[container_id]
            )
            update.linux.resources.CopyFrom(merger.merged_resources())
            result.append(update)
        return result

    def owners(self) -> api.OwningPlugins:
        owning = api.OwningPlugins()
        for merger in self._mergers.values():
            owning.owners.MergeFrom(merger.owners().owners)
        return owning


def _check_owner(owner: str | None, plugin: str, field: Field, key: str = "") -> None:
    if owner is None or owner == plugin:
        return
    remover, removed = _removal(owner)
    if removed and remover == plugin:
        return  # the plugin removed the entry itself: it may set it again
    raise ConflictError(plugin, remover, field, key)


def _removed_keys(keys: Iterable[str]) -> list[str]:
    """The keys a reply marks for removal, without their prefix."""
    return [key[len(REMOVAL_PREFIX) :] for key in keys if key.startswith(REMOVAL_PREFIX)]


def merge_adjustments(
    container: api.Container,
    replies: Iterable[tuple[str, api.ContainerAdjustment | None]],
) -> MergeResult:
    """Merge (plugin full name, adjustment) pairs in order; ConflictError on a conflict."""
    merger = AdjustmentMerger(container)
    for plugin, adjust in replies:
        merger.apply(plugin, adjust)
    return merger.result()
