"""The `cni` and `native` NRI plugins driven through their Plugin methods with NRI messages
(no runtime needed): setup at RunPodSandbox, IPs from PodSandboxStatus, teardown, restart and
Synchronize-based garbage collection, both plugins on one pod."""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import subprocess
import sys
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
    http_server,
    link_names,
    named_netns,
    privileged,
    unique,
    wait_link_gone,
)

from podgate.nri import api_pb2 as api
from podgate.nri import netlink
from podgate.nri.ipam import IpamExhaustedError
from podgate.nri.plugins._netplugin import PluginConfigError, parse_config_text
from podgate.nri.plugins.cni import CniPlugin, CniSettings
from podgate.nri.plugins.native import NativePlugin, NativeSettings

SRC = Path(__file__).resolve().parents[2] / "src"


def pod_message(netns: Netns | None, name: str = "web") -> api.PodSandbox:
    pod = api.PodSandbox(
        id=secrets.token_hex(32), name=name, namespace="default", uid=f"uid-{name}"
    )
    if netns is not None:
        pod.linux.namespaces.add(type="ipc", path="/proc/1/ns/ipc")
        pod.linux.namespaces.add(type="network", path=netns.path)
    return pod


def leases(directory: Path) -> list[str]:
    out = []
    for path in directory.rglob("*") if directory.exists() else []:
        try:
            ipaddress.ip_address(path.name)
        except ValueError:
            continue
        out.append(path.name)
    return sorted(out)


@pytest.fixture
def bridges() -> Iterator[list[str]]:
    made: list[str] = []
    try:
        yield made
    finally:
        for name in made:
            delete_link(name)


# -- configuration (no root) ---------------------------------------------------------------


def test_config_text_forms() -> None:
    assert parse_config_text("") == {}
    assert parse_config_text('{"state-dir": "/s", "subnets": ["10.1.0.0/16"]}') == {
        "state_dir": "/s",
        "subnets": ["10.1.0.0/16"],
    }
    assert parse_config_text("# comment\n\nbridge = br7\nranges=10.2.0.0/24, fd00::/64\n") == {
        "bridge": "br7",
        "ranges": "10.2.0.0/24, fd00::/64",
    }
    with pytest.raises(PluginConfigError, match="line 1: expected key=value"):
        parse_config_text("just words")
    with pytest.raises(PluginConfigError, match="must be a JSON object"):
        parse_config_text("[1]")


async def test_native_config_then_command_line_wins(tmp_path: Path) -> None:
    plugin = NativePlugin()
    parser = argparse.ArgumentParser()
    plugin.add_arguments(parser)
    plugin.apply_arguments(parser.parse_args(["--bridge", "clibr", "--mtu", "1300"]))
    await plugin.configure(
        f"bridge=confbr\nranges=10.2.0.0/24,fd00:2::/64\nstate_dir={tmp_path}\n"
        "default_route=false\nifname=pod1",
        "podgate",
        "0.1",
    )
    assert plugin.settings == NativeSettings(
        bridge="clibr",
        ranges=("10.2.0.0/24", "fd00:2::/64"),
        state_dir=str(tmp_path),
        ifname="pod1",
        mtu=1300,
        default_route=False,
    )
    with pytest.raises(PluginConfigError, match="unknown config key 'colour'"):
        await plugin.configure("colour=blue", "podgate", "0.1")
    with pytest.raises(PluginConfigError, match="config key 'mtu': invalid value 'big'"):
        await plugin.configure('{"mtu": "big"}', "podgate", "0.1")
    with pytest.raises(
        PluginConfigError, match=r"ranges 10\.2\.0\.0/24 and 10\.2\.0\.0/16 overlap"
    ):
        await plugin.configure("ranges=10.2.0.0/24,10.2.0.0/16", "podgate", "0.1")


async def test_cni_config_inline_conflist_and_defaults(tmp_path: Path) -> None:
    conflist = {"cniVersion": "0.4.0", "name": "inline", "plugins": [{"type": "bridge"}]}
    plugin = CniPlugin()
    await plugin.configure(
        json.dumps({"conflist": conflist, "state_dir": str(tmp_path), "ip_pref": "ipv6"}),
        "podgate",
        "0.1",
    )
    assert plugin.cni.config.name == "inline"
    assert plugin.cni.ifname == "eth0"
    assert plugin.settings.ip_pref == "ipv6"

    path = tmp_path / "net.conflist"
    path.write_text(json.dumps(dict(conflist, name="fromfile")))
    await plugin.configure(f"conflist={path}\nstate_dir={tmp_path}\nloopback=no", "p", "1")
    assert plugin.cni.config.name == "fromfile"
    assert plugin.cni.loopback is None

    await plugin.configure(f"state_dir={tmp_path}", "p", "1")  # the default network
    bridge = plugin.cni.config.plugins[0]
    assert (bridge["type"], bridge["bridge"]) == ("bridge", "pgcni0")
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.88.0.0/16"}]]
    assert bridge["ipam"]["dataDir"] == str(tmp_path / "networks")
    # The two plugins' defaults do not collide on one pod.
    native = NativeSettings()
    assert native.ifname != plugin.settings.ifname
    assert native.bridge != plugin.settings.bridge
    assert not ipaddress.ip_network(native.ranges[0]).overlaps(
        ipaddress.ip_network(plugin.settings.subnets[0])
    )


def test_plugins_subscribe_to_the_pod_events() -> None:
    # Bits event-1: RunPodSandbox 1, StopPodSandbox 2, RemovePodSandbox 3, PodSandboxStatus 15.
    expected = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14
    assert CniPlugin().subscribed_events() == expected
    assert NativePlugin().subscribed_events() == expected


def test_plugins_run_as_modules() -> None:
    for name, option in (("cni", "--conflist"), ("native", "--range")):
        result = subprocess.run(
            [sys.executable, "-m", f"podgate.nri.plugins.{name}", "--help"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert option in result.stdout
        assert "--socket" in result.stdout


async def test_host_network_pods_are_left_alone(tmp_path: Path) -> None:
    native = NativePlugin(NativeSettings(state_dir=str(tmp_path / "n"), ranges=("10.3.0.0/24",)))
    cni = CniPlugin(CniSettings(state_dir=str(tmp_path / "c")))
    pod = pod_message(None)
    for plugin in (native, cni):
        await plugin.run_pod_sandbox(pod)
        assert await plugin.pod_sandbox_status(pod) is None
        await plugin.stop_pod_sandbox(pod)
        await plugin.remove_pod_sandbox(pod)
    assert native.ipam.allocations() == {}


# -- native --------------------------------------------------------------------------------


def native_plugin(tmp_path: Path, bridges: list[str], ranges: list[str]) -> NativePlugin:
    bridge = unique("pgn")
    bridges.append(bridge)
    return NativePlugin(
        NativeSettings(bridge=bridge, ranges=tuple(ranges), state_dir=str(tmp_path / "ipam"))
    )


@privileged
async def test_native_plugin_pod_lifecycle(tmp_path: Path, bridges: list[str]) -> None:
    subnet4, subnet6 = free_subnet_v4(), free_subnet_v6()
    net4, net6 = ipaddress.ip_network(subnet4), ipaddress.ip_network(subnet6)
    # IPv6 range first: the reported primary IP is still the IPv4 one.
    plugin = native_plugin(tmp_path, bridges, [subnet6, subnet4])
    with held_netns() as netns:
        pod = pod_message(netns)
        host = netlink.host_veth_name(pod.id)
        try:
            await plugin.run_pod_sandbox(pod)
            assert await plugin.pod_sandbox_status(pod) == (str(net4[2]), [str(net6[2])])
            assert host in link_names()
            assert "pg0" in netns.links()
            assert_routed_via(str(net4[2]), plugin.settings.bridge)
            with http_server(netns, "native-pod") as port:
                assert http_get(str(net4[2]), port) == "native-pod"
            await plugin.stop_pod_sandbox(pod)
            assert await plugin.pod_sandbox_status(pod) is None
            assert host not in link_names()
            assert "pg0" not in netns.links()
            assert leases(tmp_path / "ipam") == []
            await plugin.remove_pod_sandbox(pod)  # idempotent
            await plugin.remove_pod_sandbox(pod)
        finally:
            delete_link(host)


@privileged
async def test_native_plugin_failures_release_the_addresses(
    tmp_path: Path, bridges: list[str]
) -> None:
    # A /30 holds one pod address.
    net = ipaddress.ip_network(free_subnet_v4()).subnets(new_prefix=30)
    plugin = native_plugin(tmp_path, bridges, [str(next(net))])
    with named_netns() as first, named_netns() as second:
        one, two = pod_message(first, "one"), pod_message(second, "two")
        try:
            await plugin.run_pod_sandbox(one)
            with pytest.raises(IpamExhaustedError, match="all 1 addresses are allocated"):
                await plugin.run_pod_sandbox(two)
            assert netlink.host_veth_name(two.id) not in link_names()
            await plugin.remove_pod_sandbox(one)
            # The in-pod name is taken: setup fails, the address goes back.
            plugin.settings = NativeSettings(
                bridge=plugin.settings.bridge,
                ranges=plugin.settings.ranges,
                state_dir=plugin.settings.state_dir,
                ifname="lo",
            )
            with pytest.raises(netlink.LinkError):
                await plugin.run_pod_sandbox(two)
            assert plugin.ipam.allocations() == {}
            assert await plugin.pod_sandbox_status(two) is None
        finally:
            for pod in (one, two):
                delete_link(netlink.host_veth_name(pod.id))


@privileged
async def test_native_plugin_restart_and_synchronize_gc(tmp_path: Path, bridges: list[str]) -> None:
    subnet = free_subnet_v4()
    net = ipaddress.ip_network(subnet)
    settings = native_plugin(tmp_path, bridges, [subnet]).settings
    with ExitStack() as stack:
        netnses = [stack.enter_context(named_netns()) for _ in range(3)]
        pods = [pod_message(n, f"pod{i}") for i, n in enumerate(netnses)]
        hosts = [netlink.host_veth_name(p.id) for p in pods]
        stack.callback(lambda: [delete_link(h) for h in hosts])
        first = NativePlugin(settings)
        for pod in pods:
            await first.run_pod_sandbox(pod)
        assert await netlink.bridge_ports(settings.bridge) == sorted(hosts)
        del first  # the plugin process "crashes"

        restarted = NativePlugin(settings)
        # Before Synchronize the IPAM state answers for the pod.
        assert await restarted.pod_sandbox_status(pods[1]) == (str(net[3]), [])
        assert await restarted.synchronize([pods[1]], []) == []
        assert restarted.ipam.allocations() == {pods[1].id: [str(net[3])]}
        assert leases(tmp_path / "ipam") == [str(net[3])]
        assert await netlink.bridge_ports(settings.bridge) == [hosts[1]]
        assert hosts[0] not in link_names()
        assert hosts[2] not in link_names()
        assert "pg0" not in netnses[0].links()
        assert "pg0" in netnses[1].links()
        assert await restarted.pod_sandbox_status(pods[1]) == (str(net[3]), [])
        assert await restarted.pod_sandbox_status(pods[0]) is None
        # The survivor still works.
        assert_routed_via(str(net[3]), settings.bridge)
        with http_server(netnses[1], "survivor") as port:
            assert http_get(str(net[3]), port) == "survivor"


# -- cni -----------------------------------------------------------------------------------


def cni_plugin(tmp_path: Path, bridges: list[str], subnets: list[str]) -> CniPlugin:
    bridge = unique("pgc")
    bridges.append(bridge)
    return CniPlugin(
        CniSettings(
            state_dir=str(tmp_path / "cni"),
            network=unique("pgnet"),
            bridge=bridge,
            subnets=tuple(subnets),
        )
    )


@privileged
async def test_cni_plugin_pod_lifecycle_and_restart(tmp_path: Path, bridges: list[str]) -> None:
    subnet4, subnet6 = free_subnet_v4(), free_subnet_v6()
    net4, net6 = ipaddress.ip_network(subnet4), ipaddress.ip_network(subnet6)
    plugin = cni_plugin(tmp_path, bridges, [subnet6, subnet4])
    with held_netns() as netns:
        pod = pod_message(netns)
        try:
            await plugin.run_pod_sandbox(pod)
            assert await plugin.pod_sandbox_status(pod) == (str(net4[2]), [str(net6[2])])
            # A repeated RunPodSandbox starts clean (DEL, then ADD: host-local moves on).
            await plugin.run_pod_sandbox(pod)
            expected = (str(net4[3]), [str(net6[3])])
            assert await plugin.pod_sandbox_status(pod) == expected
            assert leases(tmp_path / "cni" / "networks") == sorted([str(net4[3]), str(net6[3])])
            assert "eth0" in netns.links()
            assert_routed_via(str(net4[3]), plugin.settings.bridge)
            with http_server(netns, "cni-pod") as port:
                assert http_get(str(net4[3]), port) == "cni-pod"
                assert http_get(str(net6[3]), port) == "cni-pod"
            # A restarted plugin answers from the stored result.
            restarted = CniPlugin(plugin.settings)
            assert await restarted.pod_sandbox_status(pod) == expected
            await restarted.stop_pod_sandbox(pod)
            assert await restarted.pod_sandbox_status(pod) is None
            assert "eth0" not in netns.links()
            assert leases(tmp_path / "cni" / "networks") == []
            await restarted.remove_pod_sandbox(pod)  # idempotent
        finally:
            for pod_id in plugin.cni.stored_ids():
                await plugin.cni.delete(pod_id, netns.path)


@privileged
async def test_cni_plugin_synchronize_gc(tmp_path: Path, bridges: list[str]) -> None:
    subnet = free_subnet_v4()
    net = ipaddress.ip_network(subnet)
    settings = cni_plugin(tmp_path, bridges, [subnet]).settings
    with ExitStack() as stack:
        holders = [stack.enter_context(ExitStack()) for _ in range(3)]
        netnses = [h.enter_context(held_netns()) for h in holders]
        pods = [pod_message(n, f"pod{i}") for i, n in enumerate(netnses)]
        first = CniPlugin(settings)
        host_veths = []
        try:
            for pod in pods:
                await first.run_pod_sandbox(pod)
                result = first.cni.stored_result(pod.id)
                assert result is not None
                host_veths.append(result.interfaces[1].name)
            del first
            # Pods 0 and 2 went away with their netns while the plugin was down.
            holders[0].close()
            holders[2].close()
            restarted = CniPlugin(settings)
            assert await restarted.synchronize([pods[1]], []) == []
            assert restarted.cni.stored_ids() == [pods[1].id]
            assert leases(tmp_path / "cni" / "networks") == [str(net[3])]
            assert await restarted.pod_sandbox_status(pods[1]) == (str(net[3]), [])
            assert await restarted.pod_sandbox_status(pods[0]) is None
            assert host_veths[1] in link_names()
            await wait_link_gone(host_veths[0])
            await wait_link_gone(host_veths[2])
        finally:
            cni = CniPlugin(settings).cni
            for pod_id in cni.stored_ids():
                await cni.delete(pod_id, "")
            for name in host_veths:
                delete_link(name)


# -- both on one pod -----------------------------------------------------------------------


@privileged
async def test_cni_and_native_on_one_pod(tmp_path: Path, bridges: list[str]) -> None:
    cni_subnet, native_subnet = free_subnet_v4(), free_subnet_v4()
    while ipaddress.ip_network(native_subnet).overlaps(ipaddress.ip_network(cni_subnet)):
        native_subnet = free_subnet_v4()
    cni = cni_plugin(tmp_path, bridges, [cni_subnet])
    native = native_plugin(tmp_path, bridges, [native_subnet])
    cni_ip = str(ipaddress.ip_network(cni_subnet)[2])
    native_ip = str(ipaddress.ip_network(native_subnet)[2])
    with named_netns() as netns:
        pod = pod_message(netns)
        try:
            await cni.run_pod_sandbox(pod)
            await native.run_pod_sandbox(pod)
            assert await cni.pod_sandbox_status(pod) == (cni_ip, [])
            assert await native.pod_sandbox_status(pod) == (native_ip, [])
            assert netns.links() == {"lo", "eth0", "pg0"}
            # Both default routes: CNI's (metric 0) leads, native's (1024) stands by.
            routes = json.loads(netns.run(["ip", "-j", "-4", "route", "show", "default"]).stdout)
            assert sorted((r["dev"], r.get("metric", 0)) for r in routes) == [
                ("eth0", 0),
                ("pg0", 1024),
            ]
            assert_routed_via(cni_ip, cni.settings.bridge)
            assert_routed_via(native_ip, native.settings.bridge)
            with http_server(netns, "two-networks") as port:
                assert http_get(cni_ip, port) == "two-networks"
                assert http_get(native_ip, port) == "two-networks"
            await native.stop_pod_sandbox(pod)
            await cni.stop_pod_sandbox(pod)
            assert netns.links() == {"lo"}
        finally:
            for pod_id in cni.cni.stored_ids():
                await cni.cni.delete(pod_id, netns.path)
            delete_link(netlink.host_veth_name(pod.id))


# -- over the wire: launched by podgate's NRI runtime side --------------------------------------


@privileged
async def test_both_plugins_launched_by_the_nri_runtime(tmp_path: Path, bridges: list[str]) -> None:
    """The plugin processes as a runtime starts them: config files, registration, events."""
    from podgate.nri.adaptation import Adaptation, NriConfig

    cni_subnet, native_subnet = free_subnet_v4(), free_subnet_v4()
    while ipaddress.ip_network(native_subnet).overlaps(ipaddress.ip_network(cni_subnet)):
        native_subnet = free_subnet_v4()
    cni_bridge, native_bridge = unique("pgc"), unique("pgn")
    bridges += [cni_bridge, native_bridge]
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "20-cni.conf").write_text(
        json.dumps(
            {
                "state_dir": str(tmp_path / "cni"),
                "network": unique("pgnet"),
                "bridge": cni_bridge,
                "subnets": [cni_subnet],
            }
        )
    )
    (conf_dir / "native.conf").write_text(
        f"bridge={native_bridge}\nranges={native_subnet}\nstate_dir={tmp_path / 'ipam'}\n"
    )
    config = NriConfig(
        plugin_path=str(tmp_path / "no-plugins"),
        plugin_config_path=str(conf_dir),
        disable_connections=True,
        plugin_log_dir=str(tmp_path),
        builtin=[
            ("20", "cni", [sys.executable, "-m", "podgate.nri.plugins.cni"]),
            ("21", "native", [sys.executable, "-m", "podgate.nri.plugins.native"]),
        ],
    )
    cni_ip = str(ipaddress.ip_network(cni_subnet)[2])
    native_ip = str(ipaddress.ip_network(native_subnet)[2])
    with named_netns() as netns:
        pod = pod_message(netns)
        try:
            async with Adaptation(
                config, runtime_name="test", runtime_version="0", sync=lambda: ([], [])
            ) as nri:
                assert [p.name for p in nri.plugins] == ["cni", "native"]
                await nri.run_pod_sandbox(pod)
                # First non-empty ip wins; the other plugin's ip is appended.
                assert await nri.pod_sandbox_status(pod) == (cni_ip, [native_ip])
                assert netns.links() == {"lo", "eth0", "pg0"}
                assert_routed_via(native_ip, native_bridge)
                with http_server(netns, "over-nri") as port:
                    assert http_get(native_ip, port) == "over-nri"
                    assert http_get(cni_ip, port) == "over-nri"
                await nri.stop_pod_sandbox(pod)
                assert await nri.pod_sandbox_status(pod) == ("", [])
                await nri.remove_pod_sandbox(pod)
            assert netns.links() == {"lo"}
            assert leases(tmp_path / "ipam") == []
            assert leases(tmp_path / "cni" / "networks") == []
        finally:
            delete_link(netlink.host_veth_name(pod.id))
