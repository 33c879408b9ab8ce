"""CNI invocation: the calling convention against recording fake plugins, then the real Debian
plugins (bridge + host-local + loopback) in real network namespaces."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from netns_support import (
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
    wait_link_gone,
)

from podgate.nri.cni import (
    Cni,
    CniConfig,
    CniConfigError,
    CniError,
    CniResult,
    default_conflist,
    split_primary,
)

REAL_PLUGIN_DIR = Path("/usr/lib/cni")
POD = ("ns1", "web", "uid-1")
CONTAINER = "0123456789abcdef"

# A plugin that logs what it was given (its config names the log) and does what its config
# says: print `result` (else pass prevResult on), fail, sleep, or print garbage.
FAKE_PLUGIN = r"""
import json, os, sys, time
conf = json.load(sys.stdin)
command = os.environ.get("CNI_COMMAND", "")
with open(conf["log"], "a") as log:
    log.write(json.dumps({"pid": os.getpid(), "type": conf["type"], "command": command,
                          "env": dict(os.environ), "stdin": conf}) + "\n")
if command in conf.get("sleep_on", []):
    time.sleep(30)
fail = conf.get("fail", {}).get(command)
if fail is not None:
    stream = sys.stderr if conf.get("fail_stream") == "stderr" else sys.stdout
    stream.write(json.dumps(fail))
    sys.exit(1)
if conf.get("garbage"):
    print("not json")
    sys.exit(0)
if command == "ADD":
    print(json.dumps(conf.get("result") or conf.get("prevResult")))
"""

# The bridge plugin's answer quoted in the reference (runtime-and-nri.md §9.2).
REFERENCE_RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "cni0", "mac": "0a:58:0a:fa:4d:01"},
        {"name": "veth1234", "mac": "0a:58:0a:fa:4d:02"},
        {"name": "eth0", "mac": "0a:58:0a:fa:4d:03", "sandbox": "/run/netns/x"},
    ],
    "ips": [{"interface": 2, "address": "10.250.77.2/24", "gateway": "10.250.77.1"}],
    "dns": {},
}


@pytest.fixture
def fake_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    for name in ("fake-a", "fake-b", "loopback"):
        path = directory / name
        path.write_text(f"#!{sys.executable}\n{FAKE_PLUGIN}")
        path.chmod(0o755)
    return directory


def calls(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def fake_conflist(log: Path, **extra_a: Any) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "testnet",
        "plugins": [
            {
                "type": "fake-a",
                "log": str(log),
                "result": REFERENCE_RESULT,
                "capabilities": {"portMappings": True, "bandwidth": True},
                **extra_a,
            },
            {"type": "fake-b", "log": str(log), "custom": {"kept": [1, 2]}},
        ],
    }


# -- the calling convention (fake plugins, no root) ----------------------------------------


async def test_add_runs_the_chain_with_prev_result_and_declared_capabilities(
    tmp_path: Path, fake_dir: Path
) -> None:
    log = tmp_path / "log"
    cni = Cni(
        fake_conflist(log),
        state_dir=tmp_path / "state",
        plugin_dirs=[str(tmp_path / "empty"), str(fake_dir)],
        loopback=False,
    )
    mappings = [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]
    result = await cni.add(
        CONTAINER,
        "/run/netns/x",
        pod=POD,
        capability_args={"portMappings": mappings, "dns": {"servers": ["10.0.0.10"]}},
    )
    assert result.ips_for("eth0") == ["10.250.77.2"]
    first, second = calls(log)
    assert (first["type"], first["command"]) == ("fake-a", "ADD")
    assert (second["type"], second["command"]) == ("fake-b", "ADD")
    # The first plugin: no prevResult, capabilities stripped, only declared+supplied config.
    assert "prevResult" not in first["stdin"]
    assert "capabilities" not in first["stdin"]
    assert first["stdin"]["runtimeConfig"] == {"portMappings": mappings}
    assert (first["stdin"]["cniVersion"], first["stdin"]["name"]) == ("1.0.0", "testnet")
    # The second: the first's result as prevResult, no runtimeConfig, unknown keys kept.
    assert second["stdin"]["prevResult"] == REFERENCE_RESULT
    assert "runtimeConfig" not in second["stdin"]
    assert second["stdin"]["custom"] == {"kept": [1, 2]}
    assert (second["stdin"]["cniVersion"], second["stdin"]["name"]) == ("1.0.0", "testnet")
    env = first["env"]
    assert env["CNI_COMMAND"] == "ADD"
    assert env["CNI_CONTAINERID"] == CONTAINER
    assert env["CNI_NETNS"] == "/run/netns/x"
    assert env["CNI_IFNAME"] == "eth0"
    assert env["CNI_ARGS"] == (
        "K8S_POD_NAMESPACE=ns1;K8S_POD_NAME=web;"
        "K8S_POD_INFRA_CONTAINER_ID=0123456789abcdef;K8S_POD_UID=uid-1;IgnoreUnknown=1"
    )
    assert env["CNI_PATH"] == f"{tmp_path / 'empty'}:{fake_dir}"
    # An explicit environment: nothing of ours leaks into the plugins (Python itself may add
    # LC_CTYPE when it coerces the C locale).
    assert set(env) - {"LC_CTYPE"} == {
        "CNI_COMMAND",
        "CNI_CONTAINERID",
        "CNI_NETNS",
        "CNI_IFNAME",
        "CNI_ARGS",
        "CNI_PATH",
        "PATH",
    }


async def test_result_is_stored_and_del_runs_in_reverse_with_it(
    tmp_path: Path, fake_dir: Path
) -> None:
    log = tmp_path / "log"
    state = tmp_path / "state"
    cni = Cni(fake_conflist(log), state_dir=state, plugin_dirs=[str(fake_dir)], loopback=False)
    mappings = [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]
    await cni.add(CONTAINER, "/run/netns/x", pod=POD, capability_args={"portMappings": mappings})
    record = json.loads((state / "results" / f"{CONTAINER}.json").read_text())
    assert record["result"] == REFERENCE_RESULT
    assert record["netns"] == "/run/netns/x"
    # After a restart: a new object reads the stored result.
    again = Cni(fake_conflist(log), state_dir=state, plugin_dirs=[str(fake_dir)], loopback=False)
    assert again.stored_ids() == [CONTAINER]
    stored = again.stored_result(CONTAINER)
    assert stored is not None and stored.ips_for("eth0") == ["10.250.77.2"]

    log.unlink()
    await again.delete(CONTAINER, "")
    first, second = calls(log)
    assert [(c["type"], c["command"]) for c in (first, second)] == [
        ("fake-b", "DEL"),
        ("fake-a", "DEL"),
    ]
    for call in (first, second):
        assert call["stdin"]["prevResult"] == REFERENCE_RESULT
        assert call["env"]["CNI_NETNS"] == ""
        # The pod's CNI_ARGS come from the record when the caller has no pod at hand.
        assert "K8S_POD_NAME=web" in call["env"]["CNI_ARGS"]
    assert second["stdin"]["runtimeConfig"] == {"portMappings": mappings}
    assert again.stored_ids() == []
    assert not (state / "results" / f"{CONTAINER}.json").exists()

    log.unlink()
    await again.delete(CONTAINER, "")  # idempotent: DEL again, without prevResult
    assert [("prevResult" in c["stdin"]) for c in calls(log)] == [False, False]


async def test_loopback_is_a_separate_network_set_up_first(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    (fake_dir / "loopback").write_text(
        f"#!{sys.executable}\nimport sys, json\n"
        "conf = json.load(sys.stdin)\n"
        f"open({str(log)!r}, 'a').write(json.dumps({{'ifname': __import__('os').environ"
        "['CNI_IFNAME'], 'command': __import__('os').environ['CNI_COMMAND'], "
        "'stdin': conf}) + '\\n')\n"
        "print(json.dumps({'cniVersion': '1.0.0', 'interfaces': [{'name': 'lo', "
        "'sandbox': '/x'}], 'ips': [{'interface': 0, 'address': '127.0.0.1/8'}]}))\n"
    )
    cni = Cni(fake_conflist(log), state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)])
    await cni.add(CONTAINER, "/run/netns/x", pod=POD)
    entries = calls(log)
    assert entries[0]["ifname"] == "lo"
    assert entries[0]["stdin"] == {
        "type": "loopback",
        "cniVersion": "1.0.0",
        "name": "cni-loopback",
    }
    assert [e.get("type") for e in entries[1:]] == ["fake-a", "fake-b"]
    assert entries[1]["env"]["CNI_IFNAME"] == "eth0"


async def test_plugin_error_on_stdout_fails_add_and_cleans_up(
    tmp_path: Path, fake_dir: Path
) -> None:
    log = tmp_path / "log"
    error = {"cniVersion": "1.0.0", "code": 7, "msg": "bad subnet", "details": "10.0.0.0/33"}
    conflist = fake_conflist(log)
    conflist["plugins"][1]["fail"] = {"ADD": error}
    cni = Cni(conflist, state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x", pod=POD)
    exc = info.value
    assert (exc.code, exc.msg, exc.details) == (7, "bad subnet", "10.0.0.0/33")
    assert (exc.plugin, exc.command) == ("fake-b", "ADD")
    assert str(exc) == "plugin type='fake-b' ADD: bad subnet (10.0.0.0/33) [code 7]"
    # The half-made setup was deleted (reverse order, no prevResult: ADD never finished).
    assert [(c["type"], c["command"]) for c in calls(log)] == [
        ("fake-a", "ADD"),
        ("fake-b", "ADD"),
        ("fake-b", "DEL"),
        ("fake-a", "DEL"),
    ]
    assert cni.stored_ids() == []


async def test_a_failed_rollback_keeps_the_record_for_a_retry(
    tmp_path: Path, fake_dir: Path
) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log, fail={"DEL": {"code": 5, "msg": "stuck"}})
    conflist["plugins"][1]["fail"] = {"ADD": {"code": 7, "msg": "bad"}}
    cni = Cni(conflist, state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert (info.value.code, info.value.msg) == (7, "bad")  # the ADD error, not the DEL one
    assert cni.stored_ids() == [CONTAINER]
    assert cni.stored_result(CONTAINER) is None


async def test_plugin_error_on_stderr_is_read_too(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log, fail={"ADD": {"code": 11, "msg": "try later"}})
    conflist["plugins"][0]["fail_stream"] = "stderr"
    cni = Cni(conflist, state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert (info.value.code, info.value.msg) == (11, "try later")


async def test_del_tries_every_plugin_and_keeps_the_record_on_failure(
    tmp_path: Path, fake_dir: Path
) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log)
    cni = Cni(conflist, state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)], loopback=False)
    await cni.add(CONTAINER, "/run/netns/x")
    conflist["plugins"][1]["fail"] = {"DEL": {"code": 5, "msg": "disk on fire"}}
    broken = Cni(
        conflist, state_dir=tmp_path / "state", plugin_dirs=[str(fake_dir)], loopback=False
    )
    log.unlink()
    with pytest.raises(CniError) as info:
        await broken.delete(CONTAINER, "/run/netns/x")
    assert (info.value.code, info.value.msg) == (5, "disk on fire")
    assert [(c["type"], c["command"]) for c in calls(log)] == [("fake-b", "DEL"), ("fake-a", "DEL")]
    assert broken.stored_ids() == [CONTAINER]  # kept, so a retry gets the same prevResult


async def test_check_runs_in_order_with_the_stored_result(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    cni = Cni(
        fake_conflist(log), state_dir=tmp_path / "s", plugin_dirs=[str(fake_dir)], loopback=False
    )
    with pytest.raises(CniError) as info:
        await cni.check(CONTAINER, "/run/netns/x")
    assert info.value.code == 3  # unknown container
    await cni.add(CONTAINER, "/run/netns/x")
    log.unlink()
    await cni.check(CONTAINER, "/run/netns/x")
    entries = calls(log)
    assert [(c["type"], c["command"]) for c in entries] == [
        ("fake-a", "CHECK"),
        ("fake-b", "CHECK"),
    ]
    assert all(c["stdin"]["prevResult"] == REFERENCE_RESULT for c in entries)


async def test_timeout_kills_the_plugin(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log, sleep_on=["ADD"])
    cni = Cni(
        conflist,
        state_dir=tmp_path / "state",
        plugin_dirs=[str(fake_dir)],
        loopback=False,
        timeout=1.0,
    )
    started = time.monotonic()
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert time.monotonic() - started < 30  # the 1 s timeout, not the plugin's hang
    assert (info.value.code, info.value.msg) == (0, "no answer within 1 s")
    pid = calls(log)[0]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("name", ["../../bin/sh", "/bin/sh", "sub/fake-a", "..", "."])
async def test_a_plugin_type_that_is_a_path_is_refused(
    tmp_path: Path, fake_dir: Path, name: str
) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log)
    conflist["plugins"][0]["type"] = name
    # Refused when the config is read, with libcni's reason ...
    with pytest.raises(CniConfigError, match=r"invalid plugin name .*not a path"):
        Cni(conflist, state_dir=tmp_path / "s", plugin_dirs=[str(fake_dir)], loopback=False)
    # ... and again when a config built in code reaches the plugin lookup: nothing runs.
    (fake_dir / "sub").mkdir(exist_ok=True)
    (fake_dir / "sub" / "fake-a").symlink_to(fake_dir / "fake-a")
    good = Cni(
        fake_conflist(log), state_dir=tmp_path / "s", plugin_dirs=[str(fake_dir)], loopback=False
    )
    bad_plugins = ({**good.config.plugins[0], "type": name}, *good.config.plugins[1:])
    good.config = CniConfig(good.config.name, good.config.cni_version, bad_plugins)
    with pytest.raises(CniError, match="not a path") as info:
        await good.add(CONTAINER, "/run/netns/x")
    assert info.value.plugin == name
    # Nothing was added; the failed ADD is rolled back by DEL on the plugins that exist.
    assert [(c["type"], c["command"]) for c in calls(log)] == [("fake-b", "DEL")]


async def test_missing_plugin_and_garbage_output(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    conflist = fake_conflist(log)
    conflist["plugins"][0]["type"] = "nope"
    cni = Cni(conflist, state_dir=tmp_path / "s1", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert info.value.msg == f"failed to find plugin 'nope' in path ['{fake_dir}']"

    bogus = {"cniVersion": "1.0.0", "ips": [{"address": "bogus"}]}
    cni = Cni(
        fake_conflist(log, result=bogus),
        state_dir=tmp_path / "s4",
        plugin_dirs=[str(fake_dir)],
        loopback=False,
    )
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert info.value.msg == (
        "unusable ADD result: 'bogus' does not appear to be an IPv4 or IPv6 interface"
    )
    assert cni.stored_ids() == []

    broken = fake_dir / "broken"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    conflist["plugins"][0]["type"] = "broken"
    cni = Cni(conflist, state_dir=tmp_path / "s3", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert info.value.msg == f"cannot run {broken}: No such file or directory"

    conflist = fake_conflist(log, garbage=True)
    cni = Cni(conflist, state_dir=tmp_path / "s2", plugin_dirs=[str(fake_dir)], loopback=False)
    with pytest.raises(CniError) as info:
        await cni.add(CONTAINER, "/run/netns/x")
    assert info.value.msg == "output is not JSON: 'not json'"
    assert cni.stored_ids() == []


async def test_invalid_container_ids_are_refused(tmp_path: Path, fake_dir: Path) -> None:
    cni = Cni(fake_conflist(tmp_path / "log"), state_dir=tmp_path, plugin_dirs=[str(fake_dir)])
    for bad in ("", "../etc", "-x", "a/b"):
        with pytest.raises(CniConfigError, match="invalid CNI container id"):
            await cni.add(bad, "/run/netns/x")
    assert not (tmp_path / "log").exists()


async def test_concurrent_add_for_two_pods(tmp_path: Path, fake_dir: Path) -> None:
    log = tmp_path / "log"
    cni = Cni(
        fake_conflist(log), state_dir=tmp_path / "s", plugin_dirs=[str(fake_dir)], loopback=False
    )
    await asyncio.gather(cni.add("pod1", "/run/netns/a"), cni.add("pod2", "/run/netns/b"))
    assert cni.stored_ids() == ["pod1", "pod2"]


# -- config and results (pure) ------------------------------------------------------------


def test_config_list_parsing() -> None:
    config = CniConfig.from_json(
        json.dumps({"cniVersion": "0.4.0", "name": "n", "plugins": [{"type": "bridge"}]})
    )
    assert (config.name, config.cni_version, config.plugin_types) == ("n", "0.4.0", ["bridge"])
    single = CniConfig.from_dict({"cniVersion": "1.0.0", "name": "one", "type": "bridge", "x": 1})
    assert single.plugins == ({"type": "bridge", "x": 1},)
    for bad, message in [
        ({"cniVersion": "1.0.0", "plugins": [{"type": "bridge"}]}, "has no name"),
        ({"name": "n", "plugins": [{"type": "bridge"}]}, "cniVersion is missing"),
        ({"name": "n", "cniVersion": "1.0.0", "plugins": []}, "non-empty list"),
        ({"name": "n", "cniVersion": "1.0.0", "plugins": [{}]}, "plugin 0 has no type"),
        ({"name": "n", "cniVersion": "1.0.0", "plugins": [{"type": "../x"}]}, "not a path"),
        ({"name": "n", "cniVersion": "0.2.0", "plugins": [{"type": "b"}]}, "use 0.3.0 or later"),
    ]:
        with pytest.raises(CniConfigError, match=message):
            CniConfig.from_dict(bad)
    with pytest.raises(CniConfigError, match="not JSON"):
        CniConfig.from_json("{")


def test_ips_for_follows_the_interface_index() -> None:
    result = CniResult.from_json(REFERENCE_RESULT)
    assert result.ips_for("eth0") == ["10.250.77.2"]
    assert result.ips_for("eth1") == []
    # An IP pointing at a host-side interface (no sandbox) does not count, even named eth0.
    tricky = CniResult.from_json(
        {
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0"}, {"name": "eth0", "sandbox": "/run/netns/p"}],
            "ips": [
                {"interface": 0, "address": "192.0.2.9/24"},
                {"interface": 1, "address": "fd00::5/64"},
                {"interface": 1, "address": "10.1.0.5/16"},
                {"address": "10.9.9.9/8"},
                {"interface": 7, "address": "10.7.7.7/8"},
            ],
        }
    )
    assert tricky.ips_for("eth0") == ["fd00::5", "10.1.0.5"]


def test_split_primary() -> None:
    assert split_primary(["fd00::5", "10.1.0.5", "10.1.0.6"]) == (
        "10.1.0.5",
        ["fd00::5", "10.1.0.6"],
    )
    assert split_primary(["10.1.0.5", "fd00::5"], "ipv6") == ("fd00::5", ["10.1.0.5"])
    assert split_primary(["fd00::5", "10.1.0.5"], "cni") == ("fd00::5", ["10.1.0.5"])
    assert split_primary(["fd00::5"]) == ("fd00::5", [])
    assert split_primary([]) == ("", [])


def test_default_conflist(tmp_path: Path) -> None:
    conf = default_conflist(
        "net1", "br9", ["10.4.0.0/16", "fd00:4::/64"], state_dir=tmp_path, port_map=True, mtu=1400
    )
    assert conf == {
        "cniVersion": "1.0.0",
        "name": "net1",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "br9",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "mtu": 1400,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "10.4.0.0/16"}], [{"subnet": "fd00:4::/64"}]],
                    "dataDir": str(tmp_path / "networks"),
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    own = default_conflist("n", "b", "10.4.0.0/16", state_dir=tmp_path, data_dir="/x")
    assert own["plugins"][0]["ipam"]["dataDir"] == "/x"
    assert len(own["plugins"]) == 1


# -- the real Debian plugins in real namespaces -------------------------------------------------

real_plugins = pytest.mark.skipif(
    not (REAL_PLUGIN_DIR / "bridge").exists(), reason="Debian containernetworking-plugins missing"
)


@pytest.fixture
def bridge_name() -> Iterator[str]:
    name = unique("pgc")
    try:
        yield name
    finally:
        delete_link(name)


def lease_files(data_dir: Path) -> list[str]:
    """host-local's per-address lease files (not its lock or last_reserved_ip.N)."""
    out = []
    for path in data_dir.rglob("*"):
        try:
            ipaddress.ip_address(path.name)
        except ValueError:
            continue
        out.append(path.name)
    return sorted(out)


@privileged
@real_plugins
async def test_real_plugins_connect_two_pods(tmp_path: Path, bridge_name: str) -> None:
    subnet4, subnet6 = free_subnet_v4(), free_subnet_v6()
    net4, net6 = ipaddress.ip_network(subnet4), ipaddress.ip_network(subnet6)
    network = unique("pgnet")
    conflist = default_conflist(network, bridge_name, [subnet4, subnet6], state_dir=tmp_path)
    cni = Cni(conflist, state_dir=tmp_path)
    with ExitStack() as stack:
        left = stack.enter_context(named_netns())
        right_holder = stack.enter_context(ExitStack())
        right = right_holder.enter_context(held_netns())
        results = {}
        host_veths = []
        try:
            for pod, netns in (("podleft", left), ("podright", right)):
                result = await cni.add(pod, netns.path, pod=("default", pod, f"uid-{pod}"))
                results[pod] = result
                host_veths += [
                    i.name for i in result.interfaces if not i.sandbox and i.name != bridge_name
                ]
            left4, left6 = results["podleft"].ips_for("eth0")
            right4, right6 = results["podright"].ips_for("eth0")
            # host-local hands out addresses in order after the gateway.
            assert (left4, right4) == (str(net4[2]), str(net4[3]))
            assert (left6, right6) == (str(net6[2]), str(net6[3]))
            assert link_addresses(bridge_name) == {f"{net4[1]}/24", f"{net6[1]}/64"}
            assert link_addresses("eth0", left) == {f"{left4}/24", f"{left6}/64"}
            assert "127.0.0.1/8" in link_addresses("lo", left, scope="all"), (
                "loopback did not set up lo"
            )
            for ip in (left4, right4, left6, right6):
                assert_routed_via(ip, bridge_name)

            with http_server(left, "left-body") as lport, http_server(right, "right-body") as rport:
                assert http_get(left4, lport) == "left-body"
                assert http_get(right4, rport) == "right-body"
                assert http_get(left6, lport) == "left-body"
                assert http_get(right6, rport) == "right-body"
                assert http_get_from(left, right4, rport) == "right-body"
                assert http_get_from(right, left4, lport) == "left-body"
                assert http_get_from(left, right6, rport) == "right-body"

            # A restarted runtime reads the stored results back.
            again = Cni(conflist, state_dir=tmp_path)
            stored = again.stored_result("podright")
            assert stored is not None and stored.ips_for("eth0") == [right4, right6]
            assert lease_files(tmp_path / "networks") == sorted([left4, left6, right4, right6])

            await again.delete("podleft", left.path)
            assert "eth0" not in left.links()
            assert results["podleft"].interfaces[1].name not in link_names()
            # The right pod's netns goes first (its holder exits), then DEL without a netns.
            right_holder.close()
            await wait_link_gone(results["podright"].interfaces[1].name)
            await again.delete("podright", "")
            assert lease_files(tmp_path / "networks") == []
            assert not set(host_veths) & link_names()
            assert again.stored_ids() == []
            await again.delete("podleft", left.path)  # idempotent
        finally:
            for name in host_veths:
                delete_link(name)
            for pod in cni.stored_ids():
                await cni.delete(pod, "")


@privileged
@real_plugins
async def test_real_plugin_errors(tmp_path: Path, bridge_name: str) -> None:
    with named_netns() as netns:
        bad_cidr = {
            "cniVersion": "1.0.0",
            "name": unique("pgbad"),
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": bridge_name,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(tmp_path / "leases"),
                        "ranges": [[{"subnet": "not-a-cidr"}]],
                    },
                }
            ],
        }
        cni = Cni(bad_cidr, state_dir=tmp_path)
        with pytest.raises(CniError) as info:
            await cni.add("podbad", netns.path)
        # What bridge 1.1.1 prints for this on stdout (seen with the Debian build).
        assert (info.value.code, info.value.msg) == (999, "invalid CIDR address: not-a-cidr")
        assert info.value.plugin == "bridge"
        # bridge made eth0 before its IPAM failed; the rollback DEL removed it, but failed
        # in its IPAM step too, so the record stays for a retry, and a retry says why.
        assert "eth0" not in netns.links()
        assert cni.stored_ids() == ["podbad"]
        with pytest.raises(CniError) as info:
            await cni.delete("podbad", netns.path)
        assert (info.value.code, info.value.msg, info.value.command) == (
            999,
            "invalid CIDR address: not-a-cidr",
            "DEL",
        )
        (tmp_path / "results" / "podbad.json").unlink()

        future = dict(bad_cidr, cniVersion="9.9.9")
        cni = Cni(future, state_dir=tmp_path)
        with pytest.raises(CniError) as info:
            await cni.add("podbad", netns.path)
        assert (info.value.code, info.value.msg) == (1, "incompatible CNI versions")
        assert '"9.9.9"' in info.value.details
        assert '"1.0.0"' in info.value.details
