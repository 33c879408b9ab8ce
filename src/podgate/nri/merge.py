"""The pure parts of the NRI adaptation: merging plugins' CreateContainer adjustments, checking
event masks, and aggregating PodSandboxStatus answers. No I/O, no clock.

Adjustments are merged plugin by plugin in invocation order (containerd/nri `result.go`,
reference §6.7). Every adjustable field has an owner: a simple field (memory limit, args, …)
one, a compound field (env, annotations, mounts, rlimits, unified cgroup keys) one per entry.
A plugin that sets what another plugin already owns fails the whole creation with
`plugins "<this>" and "<owner>" both tried to set <field>` — the plugin asking now first, the
earlier owner second, as upstream formats it.

Removal is how a plugin overrides on purpose. An env name, annotation key or mount destination
prefixed with `-` removes the entry (from the container and from earlier plugins' adjustments)
and records the remover as its owner, marked for removal (`-<plugin>`, as upstream's
`ClearEnv`). The plugin that removed an entry may set it again (in the same reply: removals are
applied first); any other plugin that sets it later conflicts with the remover. Removing never
conflicts. `args` works the same with upstream's marker, a leading "". OCI hooks never
conflict: they accumulate, and their owner reads "a,b".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from podgate.nri import api_pb2 as api

__all__ = [
    "HOOK_KINDS",
    "REMOVAL_PREFIX",
    "VALID_EVENTS",
    "AdjustmentMerger",
    "ConflictError",
    "Field",
    "MergeResult",
    "NriError",
    "aggregate_pod_ips",
    "event_bit",
    "event_mask",
    "merge_adjustments",
    "subscribed",
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

    def __init__(self, plugin: str, other: str, subject: str) -> None:
        super().__init__(f'plugins "{plugin}" and "{other}" both tried to set {subject}')
        self.plugin = plugin
        self.other = other
        self.subject = subject


class Field(enum.IntEnum):
    """Adjustable fields, numbered as upstream's `api.Field` (the keys of `FieldOwners`)."""

    ANNOTATIONS = 1
    MOUNTS = 2
    OCI_HOOKS = 3
    ENV = 6
    ARGS = 7
    MEM_LIMIT = 8
    MEM_RESERVATION = 9
    MEM_SWAP_LIMIT = 10
    MEM_KERNEL_LIMIT = 11
    MEM_TCP_LIMIT = 12
    MEM_SWAPPINESS = 13
    MEM_DISABLE_OOM_KILLER = 14
    MEM_USE_HIERARCHY = 15
    CPU_SHARES = 16
    CPU_QUOTA = 17
    CPU_PERIOD = 18
    CPU_REALTIME_RUNTIME = 19
    CPU_REALTIME_PERIOD = 20
    CPUSET_CPUS = 21
    CPUSET_MEMS = 22
    PIDS_LIMIT = 23
    BLOCKIO_CLASS = 25
    RDT_CLASS = 26
    CGROUPS_UNIFIED = 27
    CGROUPS_PATH = 28
    OOM_SCORE_ADJ = 29
    RLIMITS = 30


# (LinuxResources group, field, owner key, name in conflict messages). Wrapper-typed fields
# (OptionalInt64, …) count as set when present; the cpuset strings when non-empty.
_RESOURCE_FIELDS: tuple[tuple[str, str, Field, str], ...] = (
    ("memory", "limit", Field.MEM_LIMIT, "memory limit"),
    ("memory", "reservation", Field.MEM_RESERVATION, "memory reservation"),
    ("memory", "swap", Field.MEM_SWAP_LIMIT, "memory swap limit"),
    ("memory", "kernel", Field.MEM_KERNEL_LIMIT, "memory kernel limit"),
    ("memory", "kernel_tcp", Field.MEM_TCP_LIMIT, "memory TCP limit"),
    ("memory", "swappiness", Field.MEM_SWAPPINESS, "memory swappiness"),
    ("memory", "disable_oom_killer", Field.MEM_DISABLE_OOM_KILLER, "memory disable OOM killer"),
    ("memory", "use_hierarchy", Field.MEM_USE_HIERARCHY, "memory use hierarchy"),
    ("cpu", "shares", Field.CPU_SHARES, "CPU shares"),
    ("cpu", "quota", Field.CPU_QUOTA, "CPU quota"),
    ("cpu", "period", Field.CPU_PERIOD, "CPU period"),
    ("cpu", "realtime_runtime", Field.CPU_REALTIME_RUNTIME, "CPU realtime runtime"),
    ("cpu", "realtime_period", Field.CPU_REALTIME_PERIOD, "CPU realtime period"),
    ("cpu", "cpus", Field.CPUSET_CPUS, "CPU pinning"),
    ("cpu", "mems", Field.CPUSET_MEMS, "memory pinning"),
)
_STRING_RESOURCE_FIELDS = frozenset({"cpus", "mems"})


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
        # Entry key -> value, or None for "remove"; insertion order is the output order.
        self._env: dict[str, str | None] = {}
        self._annotations: dict[str, str | None] = {}
        self._mounts: dict[str, api.Mount | None] = {}
        self._rlimits: dict[str, api.POSIXRlimit] = {}
        self._args: list[str] | None = None
        self._hooks = api.Hooks()
        self._linux = api.LinuxContainerAdjustment()

    # -- ownership
    def _claim_simple(self, field: Field, plugin: str, subject: str) -> None:
        _check_owner(self._simple.get(field), plugin, subject)
        self._simple[field] = plugin

    def _clear_simple(self, field: Field, plugin: str) -> None:
        self._simple[field] = REMOVAL_PREFIX + plugin

    def _claim_entry(self, field: Field, key: str, plugin: str, subject: str) -> None:
        owners = self._compound.setdefault(field, {})
        _check_owner(owners.get(key), plugin, subject)
        owners[key] = plugin

    def _clear_entry(self, field: Field, key: str, plugin: str) -> None:
        self._compound.setdefault(field, {})[key] = REMOVAL_PREFIX + plugin

    # -- merging
    def apply(self, plugin: str, adjust: api.ContainerAdjustment | None) -> None:
        """Merge one plugin's adjustment (`plugin` is its full "idx-name"); ConflictError if it
        touches what another plugin owns. After an error the merger must not be used again."""
        if adjust is None:
            return
        self._merge_env(plugin, adjust.env)
        self._merge_annotations(plugin, adjust.annotations)
        self._merge_mounts(plugin, adjust.mounts)
        self._merge_args(plugin, adjust.args)
        if adjust.HasField("hooks"):
            self._merge_hooks(plugin, adjust.hooks)
        if adjust.HasField("linux"):
            self._merge_linux(plugin, adjust.linux)
        self._merge_rlimits(plugin, adjust.rlimits)

    def _merge_env(self, plugin: str, env: Sequence[api.KeyValue]) -> None:
        removed = _removed_keys(kv.key for kv in env)
        for name in removed:
            self._clear_entry(Field.ENV, name, plugin)
            self._env.pop(name, None)
            self._env[name] = None
        values: dict[str, str] = {}
        for kv in env:
            if not kv.key.startswith(REMOVAL_PREFIX):
                self._claim_entry(Field.ENV, kv.key, plugin, f'environment variable "{kv.key}"')
                values[kv.key] = kv.value
        for name, value in values.items():
            self._env.pop(name, None)
            self._env[name] = value
        changed = set(values) | set(removed)
        kept = [item for item in self.container.env if item.partition("=")[0] not in changed]
        self.container.ClearField("env")
        self.container.env.extend(kept + [f"{name}={value}" for name, value in values.items()])

    def _merge_annotations(self, plugin: str, annotations: Mapping[str, str]) -> None:
        removed = _removed_keys(annotations)
        for key in removed:
            self._clear_entry(Field.ANNOTATIONS, key, plugin)
            self._annotations.pop(key, None)
            self._annotations[key] = None
            self.container.annotations.pop(key, None)
        for key, value in sorted(annotations.items()):
            if key.startswith(REMOVAL_PREFIX):
                continue
            self._claim_entry(Field.ANNOTATIONS, key, plugin, f'annotation "{key}"')
            self._annotations.pop(key, None)
            self._annotations[key] = value
            self.container.annotations[key] = value

    def _merge_mounts(self, plugin: str, mounts: Sequence[api.Mount]) -> None:
        removed = _removed_keys(m.destination for m in mounts)
        for destination in removed:
            self._clear_entry(Field.MOUNTS, destination, plugin)
            self._mounts.pop(destination, None)
            self._mounts[destination] = None
        added: dict[str, api.Mount] = {}
        for mount in mounts:
            if mount.destination.startswith(REMOVAL_PREFIX):
                continue
            self._claim_entry(
                Field.MOUNTS, mount.destination, plugin, f'mount "{mount.destination}"'
            )
            added[mount.destination] = mount
        for destination, mount in added.items():
            self._mounts.pop(destination, None)
            self._mounts[destination] = mount
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
        self._claim_simple(Field.ARGS, plugin, "args")
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

    def _merge_linux(self, plugin: str, linux: api.LinuxContainerAdjustment) -> None:
        if linux.HasField("resources"):
            self._merge_resources(plugin, linux.resources)
        if linux.cgroups_path:
            self._claim_simple(Field.CGROUPS_PATH, plugin, "cgroups path")
            self._linux.cgroups_path = linux.cgroups_path
            self.container.linux.cgroups_path = linux.cgroups_path
        if linux.HasField("oom_score_adj"):
            self._claim_simple(Field.OOM_SCORE_ADJ, plugin, "OOM score adjustment")
            self._linux.oom_score_adj.CopyFrom(linux.oom_score_adj)
            self.container.linux.oom_score_adj.CopyFrom(linux.oom_score_adj)

    def _merge_resources(self, plugin: str, resources: api.LinuxResources) -> None:
        merged = self._linux.resources
        seen = self.container.linux.resources
        for group_name, name, field, subject in _RESOURCE_FIELDS:
            if not resources.HasField(group_name):  # type: ignore[arg-type]
                continue
            group: Any = getattr(resources, group_name)
            if name in _STRING_RESOURCE_FIELDS:
                value = getattr(group, name)
                if not value:
                    continue
                self._claim_simple(field, plugin, subject)
                setattr(getattr(merged, group_name), name, value)
                setattr(getattr(seen, group_name), name, value)
            elif group.HasField(name):
                self._claim_simple(field, plugin, subject)
                getattr(getattr(merged, group_name), name).CopyFrom(getattr(group, name))
                getattr(getattr(seen, group_name), name).CopyFrom(getattr(group, name))
        if resources.HasField("pids"):
            self._claim_simple(Field.PIDS_LIMIT, plugin, "pids limit")
            merged.pids.CopyFrom(resources.pids)
            seen.pids.CopyFrom(resources.pids)
        for message_field, field, subject in (
            ("blockio_class", Field.BLOCKIO_CLASS, "block I/O class"),
            ("rdt_class", Field.RDT_CLASS, "RDT class"),
        ):
            if resources.HasField(message_field):  # type: ignore[arg-type]
                self._claim_simple(field, plugin, subject)
                getattr(merged, message_field).CopyFrom(getattr(resources, message_field))
                getattr(seen, message_field).CopyFrom(getattr(resources, message_field))
        for key, value in sorted(resources.unified.items()):
            self._claim_entry(Field.CGROUPS_UNIFIED, key, plugin, f'unified resource "{key}"')
            merged.unified[key] = value
            seen.unified[key] = value

    def _merge_rlimits(self, plugin: str, rlimits: Sequence[api.POSIXRlimit]) -> None:
        added: dict[str, api.POSIXRlimit] = {}
        for rlimit in rlimits:
            self._claim_entry(Field.RLIMITS, rlimit.type, plugin, f'rlimit "{rlimit.type}"')
            added[rlimit.type] = rlimit
        if added:
            self._rlimits.update(added)
            kept = [r for r in self.container.rlimits if r.type not in added]
            self.container.ClearField("rlimits")
            self.container.rlimits.extend(kept + list(added.values()))

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
        if self._linux.ListFields():
            adjust.linux.CopyFrom(self._linux)
        adjust.rlimits.extend(self._rlimits.values())
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
        return MergeResult(self.adjustment(), self.owners())


def _check_owner(owner: str | None, plugin: str, subject: str) -> None:
    if owner is None or owner == plugin:
        return
    remover, removed = _removal(owner)
    if removed and remover == plugin:
        return  # the plugin removed the entry itself: it may set it again
    raise ConflictError(plugin, remover, subject)


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
