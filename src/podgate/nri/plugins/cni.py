"""The `cni` NRI plugin: CNI as an NRI plugin, running the real CNI plugin binaries.

At RunPodSandbox it sets up the loopback network and the configured network in the pod's
netns (CNI ADD, as containerd does), and answers PodSandboxStatus with the IPs of the
in-sandbox interface from the ADD result (first IPv4 first with `ip_pref=ipv4`). StopPodSandbox
runs DEL while the netns exists; RemovePodSandbox runs DEL without a netns if a result is still
stored (idempotent). Synchronize deletes what is stored for pods that no longer exist and
reloads the IPs of the others from the stored results.

Configuration: the Configure config text (one JSON object, or `key=value` lines), then the
command-line options, which win:

    conflist      path of a .conflist (or .conf), or the conflist itself inline (a JSON
                  object, or a key=value value starting with "{"); empty: the default below
    state_dir     stored results and the default network's host-local leases
                  [/var/lib/podgate/nri/cni]
    ifname        the in-sandbox interface [eth0]
    plugin_dirs   CNI plugin directories, CNI_PATH [/usr/lib/cni]
    loopback      set up "lo" with the loopback plugin first [true]
    ip_pref       ipv4 | ipv6 | cni: which IP leads the reported ones [ipv4]
    network       name of the default network [podgate-cni]
    bridge        bridge of the default network [pgcni0]
    subnets       subnets of the default network (comma-separated) [10.88.0.0/16]
    port_map      add the portmap plugin to the default network [false]
    mtu           MTU of the default network's interfaces [the kernel's default]

The default network is bridge (the bridge holds each subnet's gateway address; no
masquerading) + host-local (leases in `<state_dir>/networks`). podgate's `native` plugin
defaults to another interface (pg0), bridge (pgbr0) and subnet (10.89.0.0/16), so both can serve
one pod.

Run: `python -m podgate.nri.plugins.cni [--conflist PATH] [--state-dir DIR] ...`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from podgate.nri import api_pb2 as api
from podgate.nri.cni import (
    DEFAULT_PLUGIN_DIRS,
    Cni,
    CniConfig,
    CniConfigError,
    CniError,
    default_conflist,
    split_primary,
)
from podgate.nri.plugin import Plugin, run_plugin
from podgate.nri.plugins._netplugin import (
    PluginConfigError,
    apply_settings,
    netns_path,
    parse_config_text,
)

__all__ = ["CniPlugin", "CniSettings", "NoPodIpError", "main"]

log = logging.getLogger("podgate.nri.plugins.cni")

DEFAULT_STATE_DIR: Final = "/var/lib/podgate/nri/cni"
IP_PREFERENCES: Final = ("ipv4", "ipv6", "cni")


@dataclass(frozen=True, slots=True)
class CniSettings:
    conflist: str = ""
    state_dir: str = DEFAULT_STATE_DIR
    ifname: str = "eth0"
    plugin_dirs: tuple[str, ...] = DEFAULT_PLUGIN_DIRS
    loopback: bool = True
    ip_pref: str = "ipv4"
    network: str = "podgate-cni"
    bridge: str = "pgcni0"
    subnets: tuple[str, ...] = ("10.88.0.0/16",)
    port_map: bool = False
    mtu: int | None = None

    def network_config(self) -> CniConfig:
        text = self.conflist.strip()
        if text.startswith("{"):
            return CniConfig.from_json(text)
        if text:
            return CniConfig.from_file(text)
        return CniConfig.from_dict(
            default_conflist(
                self.network,
                self.bridge,
                self.subnets,
                state_dir=self.state_dir,
                port_map=self.port_map,
                mtu=self.mtu,
            )
        )

    def build(self) -> Cni:
        if self.ip_pref not in IP_PREFERENCES:
            raise PluginConfigError(f"ip_pref must be one of {', '.join(IP_PREFERENCES)}")
        return Cni(
            self.network_config(),
            state_dir=self.state_dir,
            plugin_dirs=self.plugin_dirs,
            ifname=self.ifname,
            loopback=self.loopback,
        )


class NoPodIpError(CniError):
    """ADD succeeded but gave no IP on the in-sandbox interface (containerd fails too)."""


def _pod_args(pod: api.PodSandbox) -> tuple[str, str, str]:
    return (pod.namespace, pod.name, pod.uid)


class CniPlugin(Plugin):
    name, index = "cni", "20"

    def __init__(self, settings: CniSettings | None = None) -> None:
        self.settings = settings or CniSettings()
        self._overrides: dict[str, Any] = {}
        self._cni: Cni | None = None
        # pod id -> (ip, additional_ips); PodSandboxStatus answers from here.
        self._ips: dict[str, tuple[str, list[str]]] = {}
        # After Synchronize the cache is complete; before it, stored results are consulted.
        self._synchronized = False

    @property
    def cni(self) -> Cni:
        if self._cni is None:
            self._cni = self.settings.build()
        return self._cni

    # -- configuration --------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("cni plugin (override the Configure config)")
        group.add_argument("--conflist", help="network config list: a path or inline JSON")
        group.add_argument("--state-dir", help=f"state directory [{DEFAULT_STATE_DIR}]")
        group.add_argument("--ifname", help="in-sandbox interface name [eth0]")
        group.add_argument(
            "--plugin-dir", dest="plugin_dirs", action="append", help="CNI plugin directory"
        )
        group.add_argument("--ip-pref", choices=IP_PREFERENCES, help="IP order [ipv4]")
        group.add_argument("--bridge", help="default network: bridge [pgcni0]")
        group.add_argument(
            "--subnet", dest="subnets", action="append", help="default network: subnet"
        )

    def apply_arguments(self, args: argparse.Namespace) -> None:
        for key in ("conflist", "state_dir", "ifname", "plugin_dirs", "ip_pref", "bridge"):
            value = getattr(args, key, None)
            if value is not None:
                self._overrides[key] = value
        if getattr(args, "subnets", None):
            self._overrides["subnets"] = args.subnets
        self.settings = apply_settings(self.settings, self._overrides)
        self._cni = None

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        try:
            settings = apply_settings(CniSettings(), parse_config_text(config))
            settings = apply_settings(settings, self._overrides)
            cni = settings.build()
        except (PluginConfigError, CniConfigError) as exc:
            log.error("cni: bad configuration: %s", exc)
            raise
        self.settings, self._cni = settings, cni
        log.info(
            "cni: network %s (%s) on %s, state in %s",
            cni.config.name,
            "+".join(cni.config.plugin_types),
            settings.ifname,
            settings.state_dir,
        )

    # -- pod events -----------------------------------------------------------------------

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        path = netns_path(pod)
        if not path:
            log.info("cni: pod %s/%s has no network namespace of its own", pod.namespace, pod.name)
            return
        if self.cni.has_record(pod.id):
            # Set up before (a retried event): start clean rather than ADD twice.
            await self.cni.delete(pod.id, path, pod=_pod_args(pod))
        result = await self.cni.add(pod.id, path, pod=_pod_args(pod))
        ips = result.ips_for(self.settings.ifname)
        if not ips:
            await self.cni.delete(pod.id, path, pod=_pod_args(pod))
            raise NoPodIpError(
                0,
                f"failed to find network info for sandbox {pod.id}: no IP on "
                f"{self.settings.ifname}",
            )
        self._ips[pod.id] = split_primary(ips, self.settings.ip_pref)
        log.info("cni: pod %s/%s (%s): %s", pod.namespace, pod.name, pod.id, ", ".join(ips))

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        cached = self._ips.get(pod.id)
        if cached is None and not self._synchronized:
            cached = self._reload(pod.id)
        if cached is None:
            return None
        ip, additional = cached
        return ip, list(additional)

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self._ips.pop(pod.id, None)
        if self.cni.has_record(pod.id):
            await self.cni.delete(pod.id, netns_path(pod), pod=_pod_args(pod))

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        # The netns is gone by now; its path may even name another process's netns.
        self._ips.pop(pod.id, None)
        if self.cni.has_record(pod.id):
            await self.cni.delete(pod.id, "", pod=_pod_args(pod))

    async def synchronize(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> list[api.ContainerUpdate]:
        live = {pod.id for pod in pods}
        self._ips = {k: v for k, v in self._ips.items() if k in live}
        for container_id in self.cni.stored_ids():
            if container_id in live:
                reloaded = self._reload(container_id)
                if reloaded is not None:
                    self._ips[container_id] = reloaded
                continue
            log.info("cni: pod %s is gone; deleting its network", container_id)
            try:
                await self.cni.delete(container_id, "")
            except CniError as exc:
                log.warning("cni: cleanup of %s failed (kept for a retry): %s", container_id, exc)
        self._synchronized = True
        return []

    def _reload(self, pod_id: str) -> tuple[str, list[str]] | None:
        try:
            result = self.cni.stored_result(pod_id)
        except CniConfigError:
            return None
        if result is None:
            return None
        ips = result.ips_for(self.settings.ifname)
        if not ips:
            return None
        entry = split_primary(ips, self.settings.ip_pref)
        self._ips[pod_id] = entry
        return entry


def main(argv: Sequence[str] | None = None) -> int:
    return run_plugin(CniPlugin(), argv)


if __name__ == "__main__":
    sys.exit(main())
