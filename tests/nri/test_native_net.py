"""Native pod networking (bridge + veth + own IPAM, no CNI binaries) in real namespaces."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from netns_support import (
    Netns,
    assert_routed_via,
    delete_link,
    free_subnet_v4,
    free_subnet_v6,
    held_netns,
    http_get,
    http_get_from,
    http_server,
    link_addresses,
    link_names,
    named_netns,
    privileged,
    unique,
)

from podgate.nri import netlink
from podgate.nri.ipam import Ipam
from podgate.nri.netlink import LinkError


def test_host_veth_name_is_pg_and_a_hash_of_the_pod_id() -> None:
    name = netlink.host_veth_name("0123abcd" * 8)
    assert name == "pg" + hashlib.sha256(("0123abcd" * 8).encode()).hexdigest()[:11]
    assert len(name) == 13  # within IFNAMSIZ - 1
    assert netlink.host_veth_name("pod-b") != netlink.host_veth_name("pod-c")


@pytest.mark.parametrize("bad", ["", "x" * 16, "a/b", ".."])
async def test_bad_interface_names_are_refused(bad: str) -> None:
    with pytest.raises(LinkError, match="invalid interface name"):
        await netlink.ensure_bridge(bad, [])


@pytest.fixture
def bridge() -> Iterator[str]:
    name = unique("pgn")
    try:
        yield name
    finally:
        delete_link(name)


def route_defaults(netns: Netns, family: str) -> list[tuple[str, str, int]]:
    """(gateway, dev, metric) of the default routes in `netns`."""
    text = netns.run(["ip", "-j", family, "route", "show", "default"]).stdout
    return [(r["gateway"], r["dev"], r.get("metric", 0)) for r in json.loads(text or "[]")]


def mtu_of(name: str, netns: Netns | None = None) -> int:
    argv = ["ip", "-j", "link", "show", "dev", name]
    if netns is not None:
        text = netns.run(argv).stdout
    else:
        text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return int(json.loads(text)[0]["mtu"])


@privileged
async def test_native_network_connects_two_pods(tmp_path: Path, bridge: str) -> None:
    subnet4, subnet6 = free_subnet_v4(), free_subnet_v6()
    net4, net6 = ipaddress.ip_network(subnet4), ipaddress.ip_network(subnet6)
    ipam = Ipam([subnet4, subnet6], tmp_path / "ipam")
    gateways = [g.ip for g in ipam.gateways]
    with ExitStack() as stack:
        left = stack.enter_context(named_netns())
        right = stack.enter_context(held_netns())
        pods = {"pod-left": left, "pod-right": right}
        stack.callback(lambda: [delete_link(netlink.host_veth_name(p)) for p in pods])
        await netlink.ensure_bridge(bridge, ipam.gateways)
        await netlink.ensure_bridge(bridge, ipam.gateways)  # idempotent
        assert link_addresses(bridge) == {f"{net4[1]}/24", f"{net6[1]}/64"}
        links = {}
        for pod, netns in pods.items():
            addresses = ipam.allocate(pod)
            links[pod] = await netlink.setup_pod_link(
                pod, netns.path, bridge=bridge, ifname="pg0", addresses=addresses, gateways=gateways
            )
        left4, right4 = str(net4[2]), str(net4[3])
        left6, right6 = str(net6[2]), str(net6[3])
        assert [str(a.ip) for a in links["pod-left"].addresses] == [left4, left6]
        assert link_addresses("pg0", left) == {f"{left4}/24", f"{left6}/64"}
        assert link_addresses("pg0", right) == {f"{right4}/24", f"{right6}/64"}
        assert "127.0.0.1/8" in link_addresses("lo", right, scope="all")
        assert route_defaults(left, "-4") == [(str(net4[1]), "pg0", 1024)]
        assert route_defaults(left, "-6") == [(str(net6[1]), "pg0", 1024)]
        assert await netlink.bridge_ports(bridge) == sorted(netlink.host_veth_name(p) for p in pods)
        for ip in (left4, right4, left6, right6):
            assert_routed_via(ip, bridge)

        with http_server(left, "left-body") as lport, http_server(right, "right-body") as rport:
            assert http_get(left4, lport) == "left-body"
            assert http_get(right4, rport) == "right-body"
            assert http_get(left6, lport) == "left-body"
            assert http_get(right6, rport) == "right-body"
            assert http_get_from(left, right4, rport) == "right-body"
            assert http_get_from(right, left4, lport) == "left-body"
            assert http_get_from(right, left6, lport) == "left-body"

        for pod in pods:
            assert await netlink.teardown_pod_link(pod) is True
            assert await netlink.teardown_pod_link(pod) is False  # idempotent
            ipam.release(pod)
        assert not {netlink.host_veth_name(p) for p in pods} & link_names()
        assert "pg0" not in left.links()
        assert "pg0" not in right.links()
        assert ipam.allocations() == {}
        assert await netlink.bridge_ports(bridge) == []


@privileged
async def test_setup_again_replaces_the_old_pair_and_sets_the_mtu(
    tmp_path: Path, bridge: str
) -> None:
    subnet = free_subnet_v4()
    ipam = Ipam([subnet], tmp_path / "ipam")
    await netlink.ensure_bridge(bridge, ipam.gateways)
    host = netlink.host_veth_name("pod-x")
    with named_netns() as netns:
        try:
            addresses = ipam.allocate("pod-x")
            gateways = [g.ip for g in ipam.gateways]
            await netlink.setup_pod_link(
                "pod-x",
                netns.path,
                bridge=bridge,
                ifname="pg0",
                addresses=addresses,
                gateways=gateways,
            )
            link = await netlink.setup_pod_link(
                "pod-x",
                netns.path,
                bridge=bridge,
                ifname="pg0",
                addresses=addresses,
                gateways=gateways,
                mtu=1280,
                default_route=False,
            )
            assert netns.links() == {"lo", "pg0"}
            assert mtu_of("pg0", netns) == 1280
            assert mtu_of(host) == 1280
            assert route_defaults(netns, "-4") == []
            assert link.host_ifname == host
            assert (
                link.mac
                == json.loads(netns.run(["ip", "-j", "link", "show", "pg0"]).stdout)[0]["address"]
            )
        finally:
            delete_link(host)


@privileged
async def test_failed_setup_leaves_no_veth(tmp_path: Path, bridge: str) -> None:
    subnet = free_subnet_v4()
    ipam = Ipam([subnet], tmp_path / "ipam")
    gateways = [g.ip for g in ipam.gateways]
    addresses = ipam.allocate("pod-y")
    host = netlink.host_veth_name("pod-y")
    with named_netns() as netns:
        try:
            with pytest.raises(LinkError, match=f"bridge {bridge} does not exist"):
                await netlink.setup_pod_link(
                    "pod-y",
                    netns.path,
                    bridge=bridge,
                    ifname="pg0",
                    addresses=addresses,
                    gateways=gateways,
                )
            await netlink.ensure_bridge(bridge, ipam.gateways)
            # "lo" already exists in the pod's netns: the peer cannot get that name.
            with pytest.raises(LinkError, match="an interface of that name exists"):
                await netlink.setup_pod_link(
                    "pod-y",
                    netns.path,
                    bridge=bridge,
                    ifname="lo",
                    addresses=addresses,
                    gateways=gateways,
                )
            assert host not in link_names()
            with pytest.raises(LinkError, match=r"network namespace .*: No such file"):
                await netlink.setup_pod_link(
                    "pod-y",
                    str(tmp_path / "no-such-netns"),
                    bridge=bridge,
                    ifname="pg0",
                    addresses=addresses,
                    gateways=gateways,
                )
            assert host not in link_names()
            assert netns.links() == {"lo"}
        finally:
            delete_link(host)


@privileged
async def test_ensure_bridge_refuses_a_non_bridge(bridge: str) -> None:
    # A veth (the kernel here may lack the dummy driver) under the bridge's name.
    subprocess.run(
        ["ip", "link", "add", bridge, "type", "veth", "peer", "name", unique("pgq")], check=True
    )
    with pytest.raises(LinkError, match=f"{bridge} exists and is not a bridge"):
        await netlink.ensure_bridge(bridge, [ipaddress.ip_interface("10.0.0.1/24")])
    assert link_addresses(bridge) == set()
