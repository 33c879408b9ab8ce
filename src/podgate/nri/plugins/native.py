"""The `native` NRI plugin: pod networking without CNI binaries (veth + bridge + own IPAM).

At RunPodSandbox it allocates one address per configured range (`podgate.nri.ipam`), makes sure
the bridge exists with each range's gateway address, and creates a veth pair: the host end
`pg<hash of the pod id>` on the bridge, the other end inside the pod's netns as `ifname` with
the addresses, `lo` up and a default route per family via the gateway (metric 1024, so a CNI
default route on the same pod wins and does not collide). PodSandboxStatus answers from memory
(first IPv4 first). StopPodSandbox and RemovePodSandbox delete the host end and release the
addresses (idempotent). Synchronize releases the addresses of pods that no longer exist,
deletes their leftover host veths from the bridge and reloads the IPs of the others.

Configuration: the Configure config text (one JSON object, or `key=value` lines), then the
command-line options, which win:

    bridge         host bridge [pgbr0]
    ranges         IPv4 and/or IPv6 CIDRs, comma-separated [10.89.0.0/16]; the first host
                   address of each is the gateway, on the bridge
    state_dir      IPAM state (one file per allocated address) [/var/lib/podgate/nri/native]
    ifname         the in-sandbox interface [pg0]
    mtu            MTU of the veth pair [the kernel's default]
    default_route  add default routes via the gateways [true]

podgate's `cni` plugin defaults to eth0, bridge pgcni0 and 10.88.0.0/16, so both can serve one
pod. Run: `python -m podgate.nri.plugins.native [--bridge NAME] [--range CIDR] ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from podgate.nri import api_pb2 as api
from podgate.nri import netlink
from podgate.nri.cni import split_primary
from podgate.nri.ipam import Ipam, IpamError
from podgate.nri.plugin import Plugin, run_plugin
from podgate.nri.plugins._netplugin import (
    PluginConfigError,
    apply_settings,
    netns_path,
    parse_config_text,
)

__all__ = ["NativePlugin", "NativeSettings", "main"]

log = logging.getLogger("podgate.nri.plugins.native")

DEFAULT_STATE_DIR: Final = "/var/lib/podgate/nri/native"


@dataclass(frozen=True, slots=True)
class NativeSettings:
    bridge: str = "pgbr0"
    ranges: tuple[str, ...] = ("10.89.0.0/16",)
    state_dir: str = DEFAULT_STATE_DIR
    ifname: str = "pg0"
    mtu: int | None = None
    default_route: bool = True

    def build(self) -> Ipam:
        try:
            return Ipam(self.ranges, self.state_dir)
        except IpamError as exc:
            raise PluginConfigError(str(exc)) from exc


class NativePlugin(Plugin):
    name, index = "native", "21"

    def __init__(self, settings: NativeSettings | None = None) -> None:
        self.settings = settings or NativeSettings()
        self._overrides: dict[str, Any] = {}
        self._ipam: Ipam | None = None
        # pod id -> (ip, additional_ips); PodSandboxStatus answers from here.
        self._ips: dict[str, tuple[str, list[str]]] = {}
        self._synchronized = False

    @property
    def ipam(self) -> Ipam:
        if self._ipam is None:
            self._ipam = self.settings.build()
        return self._ipam

    # -- configuration --------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("native plugin (override the Configure config)")
        group.add_argument("--bridge", help="host bridge [pgbr0]")
        group.add_argument(
            "--range", dest="ranges", action="append", help="address range (CIDR), repeatable"
        )
        group.add_argument("--state-dir", help=f"IPAM state directory [{DEFAULT_STATE_DIR}]")
        group.add_argument("--ifname", help="in-sandbox interface name [pg0]")
        group.add_argument("--mtu", type=int, help="MTU of the veth pair")

    def apply_arguments(self, args: argparse.Namespace) -> None:
        for key in ("bridge", "ranges", "state_dir", "ifname", "mtu"):
            value = getattr(args, key, None)
            if value is not None:
                self._overrides[key] = value
        self.settings = apply_settings(self.settings, self._overrides)
        self._ipam = None

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        try:
            settings = apply_settings(NativeSettings(), parse_config_text(config))
            settings = apply_settings(settings, self._overrides)
            ipam = settings.build()
        except PluginConfigError as exc:
            log.error("native: bad configuration: %s", exc)
            raise
        self.settings, self._ipam = settings, ipam
        log.info(
            "native: bridge %s, ranges %s, %s in pods, state in %s",
            settings.bridge,
            ", ".join(settings.ranges),
            settings.ifname,
            settings.state_dir,
        )

    # -- pod events -----------------------------------------------------------------------

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        path = netns_path(pod)
        if not path:
            log.info(
                "native: pod %s/%s has no network namespace of its own", pod.namespace, pod.name
            )
            return
        ipam, settings = self.ipam, self.settings
        addresses = await asyncio.to_thread(ipam.allocate, pod.id)
        try:
            await netlink.ensure_bridge(settings.bridge, ipam.gateways, mtu=settings.mtu)
            await netlink.setup_pod_link(
                pod.id,
                path,
                bridge=settings.bridge,
                ifname=settings.ifname,
                addresses=addresses,
                gateways=[gateway.ip for gateway in ipam.gateways],
                mtu=settings.mtu,
                default_route=settings.default_route,
            )
        except BaseException:
            await asyncio.shield(asyncio.to_thread(ipam.release, pod.id))
            raise
        ips = [str(address.ip) for address in addresses]
        self._ips[pod.id] = split_primary(ips)
        log.info("native: pod %s/%s (%s): %s", pod.namespace, pod.name, pod.id, ", ".join(ips))

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        cached = self._ips.get(pod.id)
        if cached is None and not self._synchronized:
            # Restarted and not synchronized yet: the IPAM state still knows.
            ips = [str(a.ip) for a in await asyncio.to_thread(self.ipam.lookup, pod.id)]
            if ips:
                cached = self._ips[pod.id] = split_primary(ips)
        if cached is None:
            return None
        ip, additional = cached
        return ip, list(additional)

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await self._release(pod.id)

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await self._release(pod.id)

    async def _release(self, pod_id: str) -> None:
        self._ips.pop(pod_id, None)
        await netlink.teardown_pod_link(pod_id)
        freed = await asyncio.to_thread(self.ipam.release, pod_id)
        if freed:
            log.info("native: pod %s released %s", pod_id, ", ".join(freed))

    async def synchronize(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> list[api.ContainerUpdate]:
        live = {pod.id for pod in pods}
        ipam = self.ipam
        freed = await asyncio.to_thread(ipam.gc, live)
        for pod_id, ips in freed.items():
            log.info("native: pod %s is gone; released %s", pod_id, ", ".join(ips))
        keep = {netlink.host_veth_name(pod_id) for pod_id in live}
        for port in await netlink.bridge_ports(self.settings.bridge):
            if port not in keep:
                log.info("native: deleting leftover veth %s", port)
                await netlink.delete_link(port)
        allocations = await asyncio.to_thread(ipam.allocations)
        self._ips = {
            pod_id: split_primary(ips) for pod_id, ips in allocations.items() if pod_id in live
        }
        self._synchronized = True
        return []


def main(argv: Sequence[str] | None = None) -> int:
    return run_plugin(NativePlugin(), argv)


if __name__ == "__main__":
    sys.exit(main())
