"""The runtime's side of NRI: which events it sends when, and what it does with the answers.

The order follows containerd (reference §8.2) with one change that NRI-owned networking needs:
`StopPodSandbox` goes out after the containers stop but *before* the pod's namespaces are
released, so network plugins tear down while the netns still exists (containerd runs CNI there
instead). With NRI networking on, each network plugin is asked `PodSandboxStatus` right after
its `RunPodSandbox`, and the plugins after it in index order get RunPodSandbox with the IPs
found so far — containerd runs CNI before NRI's RunPodSandbox, so its plugins all see the IPs;
here the network plugins are NRI plugins themselves, so only those ordered before them see
none. The IPs are recorded before the pod is Ready; CRI PodSandboxStatus asks again through a
short cache, since the kubelet polls it.

PodSandboxStatus merge policy (containerd/nri #267, revision 2): the first non-empty `ip` in
plugin index order is the pod IP; later plugins' `ip` and every `additional_ips` entry follow in
order, duplicates dropped.

Nothing a plugin sets is dropped: after merging and validation, CreateContainer fails with the
plugin and the field named when the adjustment touches a field outside
`convert.APPLIED_FIELDS`, or one this host cannot honour (`podgate.oci.adjust.check`: cgroup
controllers, runc's version, resctrl, configured classes, CDI devices), or — for a container
without a root of its own, which has no OCI spec — anything beyond env, args, mounts and
annotations. What passes is returned as OCI-shaped data the runtime applies to the container's
config.json (podgate.oci.adjust.apply) where containerd applies it.

Container updates (plugins' replies, unsolicited UpdateContainers, and the CRI's
UpdateContainerResources through UpdateContainer/PostUpdateContainer) reach the runtime through
a `ContainerUpdater`: new limits into config.json and the live cgroup (`runc update`).
Evictions stop the container without a StopContainer event: they arrive while the adaptation
delivers another event, and the event would wait for that one to finish.

Pod updates (CRI UpdatePodSandboxResources) are split around the runtime's change: UpdatePodSandbox
before it (a plugin's error fails the call), PostUpdatePodSandbox after it, with the pod as it
then is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from podgate.model import ContainerRecord, PodRecord, PodState
from podgate.nri import api_pb2 as api
from podgate.nri import convert
from podgate.nri.adaptation import UpdatesNotSupportedError
from podgate.nri.merge import Claim, MergeResult, NriError, UnappliedAdjustmentError, unapplied
from podgate.oci import adjust as oci_adjust
from podgate.oci import cdi, features
from podgate.runtime.api import FailedPreconditionError
from podgate.runtime.sandbox import lifecycle as sandbox

log = logging.getLogger(__name__)

# How long a PodSandboxStatus answer is reused: the kubelet polls every few seconds and each
# plugin may take up to the request timeout, so the runtime does not ask on every poll.
STATUS_CACHE_SECONDS = 2.0


class NriAdaptation(Protocol):
    """What the runtime needs from the NRI adaptation (podgate.nri.adaptation.Adaptation)."""

    async def run_pod_sandbox(
        self, pod: api.PodSandbox, *, network: bool = False
    ) -> tuple[str, list[str]]: ...
    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None: ...
    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None: ...
    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]]: ...
    async def update_pod_sandbox(
        self,
        pod: api.PodSandbox,
        overhead: api.LinuxResources | None = None,
        resources: api.LinuxResources | None = None,
    ) -> None: ...
    async def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None: ...
    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> MergeResult: ...
    async def update_container(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        resources: api.LinuxResources | None = None,
    ) -> list[api.ContainerUpdate]: ...
    async def post_update_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> None: ...
    async def post_create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> None: ...
    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...
    async def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...
    async def stop_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...
    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


def netns_path(pod: PodRecord) -> str:
    """The netns plugins configure: the guest's for sandboxed pods, the holder's otherwise."""
    if pod.ns_process is None:
        return ""
    try:
        return f"/proc/{sandbox.container_ns_pid(pod)}/ns/net"
    except FailedPreconditionError:
        return ""


class ContainerUpdater(Protocol):
    """What the runtime offers plugins' updates (podgate.runtime.runtime.Runtime)."""

    async def apply_resources(self, container_id: str, resources: dict[str, Any]) -> None:
        """A partial OCI `linux.resources` into the container's spec and live cgroup."""

    async def evict_container(self, container_id: str, reason: str) -> None:
        """Stop the container (no NRI event: the caller is inside one)."""


class UnsupportedAdjustmentError(NriError):
    """A plugin set something this host cannot honour; names the plugin, field and why."""

    def __init__(self, claim: Claim | None, refusal: oci_adjust.Refusal) -> None:
        plugin = claim.plugin if claim is not None else "?"
        what = f"{refusal.field} {refusal.key}".rstrip()
        super().__init__(
            f'plugin "{plugin}" set {what}, which this host cannot honour: {refusal.reason}'
        )
        self.plugin = plugin
        self.refusal = refusal


def _owner(claims: Iterable[Claim], refusal: oci_adjust.Refusal) -> Claim | None:
    """The plugin behind a refused field (the one that set that entry, else the field)."""
    matching = [c for c in claims if c.field.upstream_name == refusal.field and not c.removed]
    for claim in matching:
        if claim.key == refusal.key:
            return claim
    return matching[-1] if matching else None


class RuntimeNri:
    """Sends lifecycle events for a Runtime; `network` makes NRI plugins own pod networking.
    `runc` is the OCI runtime whose features decide what can be honoured; `cdi_spec_dirs`
    where CDI device specs are read."""

    def __init__(
        self,
        adaptation: NriAdaptation,
        *,
        network: bool,
        runc: str = "runc",
        cdi_spec_dirs: Sequence[str] = cdi.DEFAULT_SPEC_DIRS,
    ) -> None:
        self.adaptation = adaptation
        self.network = network
        self.runc = runc
        self.cdi_spec_dirs = tuple(cdi_spec_dirs)
        self.updater: ContainerUpdater | None = None
        self._failures: dict[str, str] = {}  # container id -> why its last update failed
        self._support: oci_adjust.HostSupport | None = None
        self._status_cache: dict[str, tuple[float, str, list[str]]] = {}

    async def host_support(self) -> oci_adjust.HostSupport:
        if self._support is None:
            self._support = await asyncio.to_thread(features.probe, self.runc)
        return self._support

    def pod_message(self, pod: PodRecord) -> api.PodSandbox:
        ips = [pod.ip, *pod.additional_ips] if pod.ip else []
        return convert.pod_sandbox(pod, netns_path=netns_path(pod), ips=ips)

    # ------------------------------------------------------------------ pods
    async def pod_started(self, pod: PodRecord) -> None:
        """The netns exists: plugins set the pod up; with NRI networking, collect the IPs.

        Raises (and has sent RemovePodSandbox) when a plugin fails the pod.
        """
        message = self.pod_message(pod)
        try:
            ip, additional = await self.adaptation.run_pod_sandbox(message, network=self.network)
            if self.network:
                pod.ip, pod.additional_ips = ip, list(additional)
                self._status_cache[pod.id] = (time.monotonic(), ip, list(additional))
        except Exception:
            await self._quietly("RemovePodSandbox", self.adaptation.remove_pod_sandbox, message)
            raise

    async def pod_stopping(self, pod: PodRecord) -> None:
        """Containers are stopped, namespaces still exist; errors are only logged."""
        message = self.pod_message(pod)
        await self._quietly("StopPodSandbox", self.adaptation.stop_pod_sandbox, message)
        self._status_cache.pop(pod.id, None)

    async def pod_removed(self, pod: PodRecord) -> None:
        await self._quietly(
            "RemovePodSandbox", self.adaptation.remove_pod_sandbox, self.pod_message(pod)
        )
        self._status_cache.pop(pod.id, None)

    async def pod_ips(self, pod: PodRecord) -> tuple[str, list[str]]:
        """The pod's IPs for CRI PodSandboxStatus, refreshed through NRI at most every few
        seconds; a failing plugin fails the call, as in containerd's test bed."""
        if not self.network or pod.state is not PodState.READY:
            return pod.ip, list(pod.additional_ips)
        cached = self._status_cache.get(pod.id)
        now = time.monotonic()
        if cached is not None and now - cached[0] < STATUS_CACHE_SECONDS:
            return cached[1], list(cached[2])
        ip, additional = await self.adaptation.pod_sandbox_status(self.pod_message(pod))
        self._status_cache[pod.id] = (now, ip, list(additional))
        return ip, list(additional)

    # ------------------------------------------------------------------ containers
    async def container_creating(
        self, pod: PodRecord, container: ContainerRecord
    ) -> dict[str, Any]:
        """Plugins adjust the container before it is recorded; conflicts, and what cannot be
        honoured, fail the creation. Returns the adjustment for the container's OCI spec."""
        result = await self.adaptation.create_container(
            self.pod_message(pod), convert.container(container)
        )
        rooted = bool(container.spec.rootfs)
        fields = convert.APPLIED_FIELDS if rooted else convert.NAMESPACE_CONTAINER_FIELDS
        refused = unapplied(result.claims, fields)
        if refused:
            error = UnappliedAdjustmentError(refused)
            if not rooted:
                first = refused[0]
                what = f"{first.field.upstream_name} {first.key}".rstrip()
                more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
                error.args = (
                    f'plugin "{first.plugin}" set {what}, which a container without a root of '
                    f"its own cannot take (it has no OCI spec){more}",
                )
            raise error
        for mount in result.adjust.mounts:
            if not rooted and not convert.is_bind(mount):
                refusal = oci_adjust.Refusal(
                    "Mounts",
                    mount.destination,
                    f"a container without a root takes bind mounts only, not {mount.type}",
                )
                raise UnsupportedAdjustmentError(_owner(result.claims, refusal), refusal)
        adjustment = convert.oci_adjustment(result.adjust) if rooted else {}
        if adjustment.get("cdiDevices"):
            try:
                adjustment["cdiEdits"] = await asyncio.to_thread(
                    cdi.resolve, adjustment["cdiDevices"], self.cdi_spec_dirs
                )
            except (cdi.CdiError, OSError) as exc:
                refusal = oci_adjust.Refusal("CdiDevices", "", str(exc))
                raise UnsupportedAdjustmentError(_owner(result.claims, refusal), refusal) from exc
        if adjustment:
            refusals = oci_adjust.check(adjustment, await self.host_support())
            if refusals:
                raise UnsupportedAdjustmentError(_owner(result.claims, refusals[0]), refusals[0])
        convert.apply_adjustment(container.spec, container.annotations, result.adjust)
        return adjustment

    async def container_updating(
        self, pod: PodRecord, container: ContainerRecord, resources: api.LinuxResources
    ) -> None:
        """A container's resources change (CRI UpdateContainerResources): UpdateContainer,
        the merged updates applied, then PostUpdateContainer, in upstream's order."""
        pod_message, message = self.pod_message(pod), convert.container(container)
        updates = await self.adaptation.update_container(pod_message, message, resources)
        failed = await self.update_containers(updates)
        fatal = [update.container_id for update in failed if not update.ignore_failure]
        if fatal:
            reasons = "; ".join(f"{i}: {self._failures.get(i, 'failed')}" for i in fatal)
            raise NriError(f"failed to update containers ({reasons})")
        await self._quietly(
            "PostUpdateContainer", self.adaptation.post_update_container, pod_message, message
        )

    async def pod_updating(
        self,
        pod: PodRecord,
        overhead: api.LinuxResources | None,
        resources: api.LinuxResources | None,
    ) -> None:
        """A pod's resources are about to change (CRI UpdatePodSandboxResources): the pod as it
        is, the new resources beside it. A plugin's error fails the call (as containerd)."""
        await self.adaptation.update_pod_sandbox(self.pod_message(pod), overhead, resources)

    async def pod_updated(self, pod: PodRecord) -> None:
        """The new resources are recorded: PostUpdatePodSandbox, errors only logged."""
        await self._quietly(
            "PostUpdatePodSandbox", self.adaptation.post_update_pod_sandbox, self.pod_message(pod)
        )

    # ------------------------------------------------------------------ updates (the seam)
    async def update_containers(
        self, updates: Sequence[api.ContainerUpdate]
    ) -> list[api.ContainerUpdate]:
        """Apply plugins' container updates through the runtime; returns those that failed
        (each logged with its reason)."""
        if not updates:
            return []
        if self.updater is None:
            ids = ", ".join(update.container_id for update in updates)
            raise UpdatesNotSupportedError(
                f"updating container resources ({ids}) is not supported by this runtime"
            )
        support = await self.host_support()
        failed = []
        for update in updates:
            resources = convert.oci_resources(update.linux.resources)
            refusals = oci_adjust.check({"resources": resources}, support)
            refusals += [
                oci_adjust.Refusal("HugepageLimits", h["pageSize"], "runc update cannot change it")
                for h in resources.get("hugepageLimits", ())
            ]
            try:
                if refusals:
                    raise oci_adjust.AdjustError(refusals[0])
                if resources:
                    await self.updater.apply_resources(update.container_id, resources)
            except Exception as exc:
                log.warning("nri: update of container %s failed: %s", update.container_id, exc)
                self._failures[update.container_id] = str(exc)
                failed.append(update)
            else:
                self._failures.pop(update.container_id, None)
        return failed

    async def evict_containers(self, evictions: Sequence[api.ContainerEviction]) -> None:
        if not evictions:
            return
        if self.updater is None:
            ids = ", ".join(eviction.container_id for eviction in evictions)
            raise UpdatesNotSupportedError(
                f"evicting containers ({ids}) is not supported by this runtime"
            )
        for eviction in evictions:
            log.info("nri: evicting container %s: %s", eviction.container_id, eviction.reason)
            await self.updater.evict_container(eviction.container_id, eviction.reason)

    async def container_created(self, pod: PodRecord, container: ContainerRecord) -> None:
        await self._quietly(
            "PostCreateContainer",
            self.adaptation.post_create_container,
            self.pod_message(pod),
            convert.container(container),
        )

    async def container_starting(self, pod: PodRecord, container: ContainerRecord) -> None:
        await self.adaptation.start_container(self.pod_message(pod), convert.container(container))

    async def container_started(self, pod: PodRecord, container: ContainerRecord) -> None:
        await self._quietly(
            "PostStartContainer",
            self.adaptation.post_start_container,
            self.pod_message(pod),
            convert.container(container),
        )

    async def container_stopped(self, pod: PodRecord, container: ContainerRecord) -> None:
        await self._quietly(
            "StopContainer",
            self.adaptation.stop_container,
            self.pod_message(pod),
            convert.container(container),
        )

    async def container_removed(self, pod: PodRecord, container: ContainerRecord) -> None:
        await self._quietly(
            "RemoveContainer",
            self.adaptation.remove_container,
            self.pod_message(pod),
            convert.container(container),
        )

    # ------------------------------------------------------------------ sync
    def snapshot(
        self, pods: Sequence[PodRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[list[api.PodSandbox], list[api.Container]]:
        """Everything a newly registered plugin is synchronised with."""
        return [self.pod_message(p) for p in pods], [convert.container(c) for c in containers]

    @staticmethod
    async def _quietly(what: str, call: Callable[..., Awaitable[Any]], *args: object) -> None:
        """Post-events and teardown: a failing plugin is logged, the CRI call goes on."""
        try:
            await call(*args)
        except Exception as exc:
            log.warning("nri: %s failed: %s", what, exc)
