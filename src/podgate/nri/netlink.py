"""Pod networking with netlink (pyroute2): a host bridge and one veth pair per pod.

The host end `pg<hash of the pod id>` is a port of the bridge, which carries each range's
gateway address, so traffic to the pod subnets stays on this host. The peer is created directly
inside the pod's netns under its final name, gets the pod's addresses (IPv6 without DAD, so
they work at once) and a default route per family via the gateway; `lo` is brought up.

pyroute2's synchronous API blocks, so every call runs in a worker thread. A netlink socket for
the pod's netns is made by a throw-away thread that enters the netns (setns changes only the
calling thread) and hands the socket back; the thread never runs anything else afterwards.
Deleting the host end deletes the peer too; when the netns goes away first, the kernel
removes the whole pair.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from podgate.linux import ns

__all__ = [
    "DEFAULT_ROUTE_METRIC",
    "HOST_VETH_PREFIX",
    "LinkError",
    "PodLink",
    "bridge_ports",
    "delete_bridge",
    "delete_link",
    "ensure_bridge",
    "host_veth_name",
    "link_exists",
    "setup_pod_link",
    "teardown_pod_link",
]

IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
T = TypeVar("T")

HOST_VETH_PREFIX: Final = "pg"
# Linux interface names hold at most 15 bytes (IFNAMSIZ 16 with the NUL).
MAX_IFNAME: Final = 15
# Hex digits of sha256(pod id) in the host veth name: 44 bits, collisions need ~4 million pods.
HOST_VETH_HASH_CHARS: Final = 11
# Metric of the default routes we add: below CNI's (0), so a pod on both networks keeps the
# CNI default route and our add does not collide with it.
DEFAULT_ROUTE_METRIC: Final = 1024
# <linux/if_addr.h>: the address is usable at once, no duplicate address detection.
IFA_F_NODAD: Final = 0x02


class LinkError(Exception):
    """A netlink operation for a pod or the bridge failed; the message says which."""


@dataclass(frozen=True, slots=True)
class PodLink:
    host_ifname: str
    ifname: str
    mac: str
    addresses: tuple[IPInterface, ...]


def host_veth_name(pod_id: str) -> str:
    """The host end's name: `pg` + hex of sha256(pod id), 13 bytes."""
    name = HOST_VETH_PREFIX + hashlib.sha256(pod_id.encode()).hexdigest()[:HOST_VETH_HASH_CHARS]
    assert len(name) <= MAX_IFNAME
    return name


def _check_ifname(name: str) -> None:
    if not name or len(name.encode()) > MAX_IFNAME or "/" in name or name in (".", ".."):
        raise LinkError(f"invalid interface name {name!r}")


async def _to_thread(func: Callable[..., T], *args: Any) -> T:
    try:
        return await asyncio.to_thread(func, *args)
    except NetlinkError as exc:
        raise LinkError(f"netlink: {exc.args[-1] if exc.args else exc}") from exc


def _lookup(ipr: Any, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return int(found[0]) if found else None


def _addr_kwargs(address: IPInterface) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"address": str(address.ip), "prefixlen": address.network.prefixlen}
    if address.version == 6:
        kwargs["flags"] = IFA_F_NODAD
    return kwargs


def _addresses_of(ipr: Any, index: int) -> set[tuple[str, int]]:
    out = set()
    for msg in ipr.get_addr(index=index):
        address = msg.get_attr("IFA_ADDRESS")
        if address is not None:
            out.add((str(ipaddress.ip_address(address)), int(msg["prefixlen"])))
    return out


# -- bridge ---------------------------------------------------------------------------------


def _ensure_bridge(name: str, gateways: Sequence[IPInterface], mtu: int | None) -> None:
    with IPRoute() as ipr:
        index = _lookup(ipr, name)
        if index is None:
            kwargs: dict[str, Any] = {"ifname": name, "kind": "bridge"}
            if mtu is not None:
                kwargs["mtu"] = mtu
            try:
                ipr.link("add", **kwargs)
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
            index = _lookup(ipr, name)
            if index is None:
                raise LinkError(f"bridge {name} vanished while being created")
        else:
            kinds = [m.get_attr("IFLA_LINKINFO") for m in ipr.get_links(index)]
            kind = kinds[0].get_attr("IFLA_INFO_KIND") if kinds and kinds[0] else None
            if kind != "bridge":
                raise LinkError(f"{name} exists and is not a bridge (kind {kind})")
        present = _addresses_of(ipr, index)
        for gateway in gateways:
            if (str(gateway.ip), gateway.network.prefixlen) in present:
                continue
            try:
                ipr.addr("add", index=index, **_addr_kwargs(gateway))
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
        ipr.link("set", index=index, state="up")


async def ensure_bridge(
    name: str, gateways: Sequence[IPInterface], *, mtu: int | None = None
) -> None:
    """Make sure bridge `name` exists, is up and carries every gateway address."""
    _check_ifname(name)
    await _to_thread(_ensure_bridge, name, list(gateways), mtu)


def _delete_link(name: str) -> bool:
    with IPRoute() as ipr:
        index = _lookup(ipr, name)
        if index is None:
            return False
        try:
            ipr.link("del", index=index)
        except NetlinkError as exc:
            if exc.code == errno.ENODEV:
                return False
            raise
        return True


async def delete_link(name: str) -> bool:
    """Delete interface `name` in the host netns; False if it did not exist."""
    _check_ifname(name)
    return await _to_thread(_delete_link, name)


async def delete_bridge(name: str) -> bool:
    return await delete_link(name)


def _link_exists(name: str) -> bool:
    with IPRoute() as ipr:
        return _lookup(ipr, name) is not None


async def link_exists(name: str) -> bool:
    return await _to_thread(_link_exists, name)


def _bridge_ports(bridge: str, prefix: str) -> list[str]:
    with IPRoute() as ipr:
        index = _lookup(ipr, bridge)
        if index is None:
            return []
        out = []
        for msg in ipr.get_links():
            name = msg.get_attr("IFLA_IFNAME")
            if msg.get_attr("IFLA_MASTER") == index and str(name).startswith(prefix):
                out.append(str(name))
        return sorted(out)


async def bridge_ports(bridge: str, prefix: str = HOST_VETH_PREFIX) -> list[str]:
    """Names of the bridge's ports that start with `prefix` (our host veth ends)."""
    return await _to_thread(_bridge_ports, bridge, prefix)


# -- pod link ---------------------------------------------------------------------------------


def _socket_in_netns_thread(path: str) -> socket.socket:
    return ns.socket_in_netns(path, socket.AF_NETLINK, socket.SOCK_DGRAM)


async def _netlink_socket_in(path: str) -> socket.socket:
    # A fresh thread per call: should it fail to leave the pod's netns, it runs nothing else.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns-netlink")
    try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, _socket_in_netns_thread, path)
    except ns.NamespaceError as exc:
        raise LinkError(f"network namespace {path}: {exc.strerror}") from exc
    finally:
        executor.shutdown(wait=False)


def _create_veth(host: str, ifname: str, netns_path: str, bridge: str, mtu: int | None) -> None:
    with IPRoute() as ipr:
        bridge_index = _lookup(ipr, bridge)
        if bridge_index is None:
            raise LinkError(f"bridge {bridge} does not exist")
        stale = _lookup(ipr, host)
        if stale is not None:
            ipr.link("del", index=stale)  # a retried setup: its old pair goes first
        try:
            netns = open(netns_path, "rb", buffering=0)  # noqa: SIM115 - `with` below
        except OSError as exc:
            raise LinkError(f"network namespace {netns_path}: {exc.strerror}") from exc
        with netns:
            peer: dict[str, Any] = {"ifname": ifname, "net_ns_fd": netns.fileno()}
            extra: dict[str, Any] = {}
            if mtu is not None:
                peer["mtu"] = mtu
                extra["mtu"] = mtu
            try:
                ipr.link("add", ifname=host, kind="veth", peer=peer, **extra)
            except NetlinkError as exc:
                if exc.code == errno.EEXIST:
                    raise LinkError(
                        f"cannot create veth {host} with peer {ifname}: an interface of that "
                        "name exists (on the host or in the pod's netns)"
                    ) from exc
                raise
        index = _lookup(ipr, host)
        if index is None:
            raise LinkError(f"veth {host} vanished after creation")
        try:
            ipr.link("set", index=index, master=bridge_index, state="up")
        except BaseException:
            ipr.link("del", index=index)
            raise


def _configure_inside(
    fd: int,
    ifname: str,
    addresses: Sequence[IPInterface],
    gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
    default_route: bool,
    metric: int,
) -> str:
    try:
        ipr = IPRoute(fileno=fd)
    except BaseException:
        os.close(fd)
        raise
    with ipr:
        lo = _lookup(ipr, "lo")
        if lo is not None:
            ipr.link("set", index=lo, state="up")
        index = _lookup(ipr, ifname)
        if index is None:
            raise LinkError(f"{ifname} did not arrive in the pod's netns")
        present = _addresses_of(ipr, index)
        for address in addresses:
            if (str(address.ip), address.network.prefixlen) not in present:
                ipr.addr("add", index=index, **_addr_kwargs(address))
        ipr.link("set", index=index, state="up")
        if default_route:
            for gateway in gateways:
                family = socket.AF_INET if gateway.version == 4 else socket.AF_INET6
                dst = "0.0.0.0/0" if gateway.version == 4 else "::/0"
                try:
                    ipr.route(
                        "add",
                        dst=dst,
                        family=family,
                        gateway=str(gateway),
                        oif=index,
                        priority=metric,
                    )
                except NetlinkError as exc:
                    if exc.code != errno.EEXIST:
                        raise
        links = ipr.get_links(index)
        return str(links[0].get_attr("IFLA_ADDRESS") or "") if links else ""


async def setup_pod_link(
    pod_id: str,
    netns_path: str,
    *,
    bridge: str,
    ifname: str,
    addresses: Sequence[IPInterface],
    gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
    mtu: int | None = None,
    default_route: bool = True,
    route_metric: int = DEFAULT_ROUTE_METRIC,
) -> PodLink:
    """Create the pod's veth pair on `bridge`, configure the in-netns end `ifname`.

    `gateways` holds one gateway per address family for the default routes. On failure the
    pair is deleted again (the addresses stay with the caller's IPAM).
    """
    _check_ifname(bridge)
    _check_ifname(ifname)
    host = host_veth_name(pod_id)
    await _to_thread(_create_veth, host, ifname, netns_path, bridge, mtu)
    try:
        sock = await _netlink_socket_in(netns_path)
        fd = sock.detach()  # IPRoute owns and closes it from here
        mac = await _to_thread(
            _configure_inside,
            fd,
            ifname,
            list(addresses),
            list(gateways),
            default_route,
            route_metric,
        )
    except BaseException:
        await asyncio.shield(_to_thread(_delete_link, host))
        raise
    return PodLink(host_ifname=host, ifname=ifname, mac=mac, addresses=tuple(addresses))


async def teardown_pod_link(pod_id: str) -> bool:
    """Delete the pod's host veth end (and so its peer); False if it was already gone."""
    return await delete_link(host_veth_name(pod_id))
