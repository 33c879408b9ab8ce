"""NRI through the real runtime: `podgate runtime` with podgate's plugins and plugins written
here on the SDK, driven over CRI like the kubelet would.

Pod networks live in bridges and subnets unique to each test, on addresses inside the pods'
namespaces; before the host sends anything to a pod IP the test checks the route goes to the
test's own bridge, so nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_e2e_support import (
    POLL_SECONDS,
    Pod,
    Pods,
    RuntimeDaemon,
    rpc_error,
    running_daemon,
    state_root,
    wait_for_log,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from process_support import processes_mentioning

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# How long a plugin may take to connect and register after it starts.
REGISTER_SECONDS = 20.0
# Bound of one HTTP exchange with a pod.
HTTP_TIMEOUT_SECONDS = 5.0
HTTP_PORT = 8080
CHURN_PODS = 50

# A pod's HTTP server: answers every GET with the pod's name.
HTTP_SERVER = r"""
import http.server, sys
body = sys.argv[1].encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[2])), Handler)
print("listening", flush=True)
server.serve_forever()
"""
# Run inside a pod: GET http://<argv[1]>:<argv[2]>/ and print the body.
HTTP_GET = r"""
import http.client, sys
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=5)
conn.request("GET", "/")
print(conn.getresponse().read().decode())
"""
# An external plugin that sets env FOO=<argv[1]> on every container.
ENV_PLUGIN = r"""
import sys
from podgate.nri import api_pb2 as api
from podgate.nri.plugin import Plugin, run_plugin
class SetEnv(Plugin):
    async def create_container(self, pod, container):
        adjust = api.ContainerAdjustment()
        adjust.env.add(key="FOO", value=sys.argv[1])
        return adjust
sys.exit(run_plugin(SetEnv(), sys.argv[2:]))
"""
# An external plugin that bind-mounts argv[1] on /mnt and annotates every container.
MOUNT_PLUGIN = r"""
import sys
from podgate.nri import api_pb2 as api
from podgate.nri.plugin import Plugin, run_plugin
class AddMount(Plugin):
    async def create_container(self, pod, container):
        adjust = api.ContainerAdjustment()
        options = ["rbind", "ro"]
        adjust.mounts.add(destination="/mnt", type="bind", source=sys.argv[1], options=options)
        adjust.annotations["podgate.test/mounted"] = "yes"
        return adjust
sys.exit(run_plugin(AddMount(), sys.argv[2:]))
"""
# An external plugin that never answers RunPodSandbox.
HANG_PLUGIN = r"""
import asyncio, sys
from podgate.nri.plugin import Plugin, run_plugin
class Hang(Plugin):
    async def run_pod_sandbox(self, pod):
        await asyncio.sleep(3600)
sys.exit(run_plugin(Hang(), sys.argv[1:]))
"""


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the runtime creates namespaces and veths")


@dataclass(frozen=True)
class Net:
    """One test's private networks: a bridge and a /24 for each network plugin."""

    tag: str
    cni_bridge: str
    cni_subnet: ipaddress.IPv4Network
    native_bridge: str
    native_subnet: ipaddress.IPv4Network

    @classmethod
    def new(cls) -> Net:
        n = random.randrange(1, 250)
        tag = f"{os.getpid() % 4096:03x}{n:02x}"
        return cls(
            tag=tag,
            cni_bridge=f"pgc{tag}",
            cni_subnet=ipaddress.ip_network(f"10.213.{n}.0/24"),
            native_bridge=f"pgn{tag}",
            native_subnet=ipaddress.ip_network(f"10.214.{n}.0/24"),
        )

    def cni_conf(self, state: Path) -> dict[str, object]:
        return {
            "state_dir": str(state / "cni"),
            "network": f"pgtest{self.tag}",
            "bridge": self.cni_bridge,
            "subnets": str(self.cni_subnet),
        }

    def native_conf(self, state: Path) -> dict[str, object]:
        return {
            "state_dir": str(state / "native"),
            "bridge": self.native_bridge,
            "ranges": str(self.native_subnet),
        }

    def cleanup(self) -> None:
        for bridge in (self.cni_bridge, self.native_bridge):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


def links_on(bridge: str) -> list[str]:
    """Names of the interfaces enslaved to `bridge` (empty when it does not exist)."""
    out = subprocess.run(
        ["ip", "-j", "link", "show", "master", bridge], capture_output=True, text=True, check=False
    )
    if out.returncode != 0 or not out.stdout.strip():
        return []
    return [link["ifname"] for link in json.loads(out.stdout)]


def lease_files(directory: Path) -> list[str]:
    """host-local / native IPAM files named after addresses under `directory`."""
    found = []
    for path in directory.rglob("*") if directory.exists() else []:
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(path.name)
            found.append(str(path))
    return found


def route_device(ip: str) -> str:
    out = subprocess.run(
        ["ip", "-j", "route", "get", ip], capture_output=True, text=True, check=True
    )
    return str(json.loads(out.stdout)[0]["dev"])


def http_get_from_host(ip: str, bridge: str) -> str:
    # Only after the route check: the pod subnet must be served by the test's own bridge.
    assert route_device(ip) == bridge, f"{ip} is not routed to {bridge}: refusing to send"
    conn = http.client.HTTPConnection(ip, HTTP_PORT, timeout=HTTP_TIMEOUT_SECONDS)
    try:
        conn.request("GET", "/")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@dataclass
class NriRuntime:
    daemon: RuntimeDaemon
    state: Path
    net: Net

    @contextlib.asynccontextmanager
    async def pods(self) -> AsyncIterator[tuple[Pods, pb_grpc.RuntimeServiceStub]]:
        async with self.daemon.connect() as rt:
            pods = Pods(rt)
            try:
                yield pods, rt
            finally:
                await pods.remove_all()

    def log_text(self) -> str:
        return self.daemon.output.read_text(errors="replace")


@contextlib.contextmanager
def nri_runtime(plugins: Sequence[str], extra: Sequence[str] = ()) -> Iterator[NriRuntime]:
    """`podgate runtime --network nri` with podgate's plugins launched as pre-installed ones."""
    _require_root()
    net = Net.new()
    with state_root() as root:
        state = root
        confs = root / "conf.d"
        confs.mkdir(parents=True)
        (root / "plugins").mkdir()
        for n, name in enumerate(plugins):
            index = f"{10 + 10 * n:02d}"
            if name == "cni":
                text = json.dumps(net.cni_conf(state))
            elif name == "native":
                text = json.dumps(net.native_conf(state))
            else:
                text = f"events_file={root / 'events.jsonl'}"
            (confs / f"{index}-{name}.conf").write_text(text)
        args = [
            *("--network", "nri", "--nri-config-dir", str(confs)),
            *("--nri-plugin-dir", str(root / "plugins")),
            *(arg for name in plugins for arg in ("--nri-plugin", name)),
            *extra,
        ]
        try:
            with running_daemon(root, args) as daemon:
                yield NriRuntime(daemon, root, net)
        finally:
            net.cleanup()


async def pod_ips(rt: pb_grpc.RuntimeServiceStub, pod: Pod) -> list[str]:
    status = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id))).status
    return [status.network.ip, *(extra.ip for extra in status.network.additional_ips)]


async def exec_in(rt: pb_grpc.RuntimeServiceStub, container_id: str, argv: Sequence[str]) -> str:
    reply = await rt.ExecSync(
        pb.ExecSyncRequest(container_id=container_id, cmd=list(argv), timeout=10)
    )
    assert reply.exit_code == 0, reply.stderr.decode(errors="replace")
    return reply.stdout.decode().strip()


async def http_pod(pods: Pods, name: str, handler: str = "") -> tuple[Pod, str]:
    pod = await pods.run(name, runtime_handler=handler)
    argv = [sys.executable, "-c", HTTP_SERVER, name, str(HTTP_PORT)]
    container = await pods.create(pod, "http", argv)
    await wait_for_log(pods.rt, container, b"listening")
    return pod, container


async def check_two_pods(run: NriRuntime, network: str, handler: str = "") -> None:
    """Two pods get IPs from `network`'s plugin, reach each other and the host reaches both;
    after StopPodSandbox the addresses are free and the veths gone."""
    subnet = run.net.cni_subnet if network == "cni" else run.net.native_subnet
    bridge = run.net.cni_bridge if network == "cni" else run.net.native_bridge
    async with run.pods() as (pods, rt):
        (a, a_http), (b, _) = [await http_pod(pods, f"{network}-{x}", handler) for x in "ab"]
        ips = {pod.id: await pod_ips(rt, pod) for pod in (a, b)}
        for pod_ips_ in ips.values():
            assert len(pod_ips_) == 1, pod_ips_
            assert ipaddress.ip_address(pod_ips_[0]) in subnet
        a_ip, b_ip = ips[a.id][0], ips[b.id][0]
        assert a_ip != b_ip
        assert len(links_on(bridge)) == 2
        # Pod A reaches pod B's server by IP (and itself), the host reaches both.
        get = [sys.executable, "-c", HTTP_GET]
        assert await exec_in(rt, a_http, [*get, b_ip, str(HTTP_PORT)]) == f"{network}-b"
        assert await exec_in(rt, a_http, [*get, a_ip, str(HTTP_PORT)]) == f"{network}-a"
        assert await asyncio.to_thread(http_get_from_host, a_ip, bridge) == f"{network}-a"
        assert await asyncio.to_thread(http_get_from_host, b_ip, bridge) == f"{network}-b"
        assert len(lease_files(run.state / network)) == 2
        for pod in (a, b):
            await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
        assert links_on(bridge) == []
        assert lease_files(run.state / network) == []


async def test_cni_plugin_networks_two_pods() -> None:
    with nri_runtime(["cni"]) as run:
        await check_two_pods(run, "cni")


async def test_native_plugin_networks_two_pods() -> None:
    with nri_runtime(["native"]) as run:
        await check_two_pods(run, "native")


@pytest.mark.parametrize("network", ["cni", "native"])
async def test_network_plugins_configure_the_guest_of_sandboxed_pods(network: str) -> None:
    with nri_runtime([network]) as run:
        await check_two_pods(run, network, handler="sandboxed")


async def test_both_plugins_give_ips_in_index_order() -> None:
    with nri_runtime(["cni", "native"]) as run, contextlib.ExitStack():
        async with run.pods() as (pods, rt):
            pod, _ = await http_pod(pods, "both")
            ips = await pod_ips(rt, pod)
            # Documented policy: the first plugin's (index 10, cni) IP is the pod IP, the next
            # plugin's follows in additional_ips.
            assert len(ips) == 2, ips
            assert ipaddress.ip_address(ips[0]) in run.net.cni_subnet
            assert ipaddress.ip_address(ips[1]) in run.net.native_subnet
            assert await asyncio.to_thread(http_get_from_host, ips[0], run.net.cni_bridge) == "both"
            assert (
                await asyncio.to_thread(http_get_from_host, ips[1], run.net.native_bridge) == "both"
            )


async def test_a_plugin_after_the_network_plugin_sees_the_ips_at_run_pod_sandbox() -> None:
    # containerd hands every NRI plugin the CNI IPs at RunPodSandbox; here the network is an NRI
    # plugin (cni, index 10), and the logger (index 20) after it sees its IPs there too.
    with nri_runtime(["cni", "logger"]) as run:
        async with run.pods() as (pods, rt):
            pod = await pods.run("seen")
            ips = await pod_ips(rt, pod)
            lines = [
                json.loads(line) for line in (run.state / "events.jsonl").read_text().splitlines()
            ]
            [run_pod] = [
                e for e in lines if e["pod_id"] == pod.id and e["event"] == "RunPodSandbox"
            ]
            assert ips and run_pod["ips"] == ips


async def test_logger_sees_every_event_in_order() -> None:
    with nri_runtime(["logger"], extra=["--network", "none"]) as run:
        events_file = run.state / "events.jsonl"
        async with run.pods() as (pods, rt):
            pod = await pods.run("logged")
            first = await pods.create(pod, "one", ["sleep", "600"])
            second = await pods.create(pod, "two", ["sleep", "600"])
            await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
            await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
            pods.created.clear()
        lines = [json.loads(line) for line in events_file.read_text().splitlines()]
        seen = [(e["event"], e["container_id"][:12]) for e in lines if e["pod_id"] == pod.id]
        one, two = first[:12], second[:12]
        assert seen == [
            ("RunPodSandbox", ""),
            ("CreateContainer", one),
            ("PostCreateContainer", one),
            ("StartContainer", one),
            ("PostStartContainer", one),
            ("CreateContainer", two),
            ("PostCreateContainer", two),
            ("StartContainer", two),
            ("PostStartContainer", two),
            ("StopContainer", one),
            ("StopContainer", two),
            ("StopPodSandbox", ""),
            ("RemoveContainer", one),
            ("RemoveContainer", two),
            ("RemovePodSandbox", ""),
        ]
        assert all(e["pod"] == "e2e/logged" for e in lines if e["pod_id"] == pod.id)


@contextlib.contextmanager
def external_plugin(
    run: NriRuntime, script: str, name: str, idx: str, *args: str
) -> Iterator[subprocess.Popen[bytes]]:
    """An external plugin process on the runtime's NRI socket, registered before returning."""
    log_path = run.state / f"plugin-{idx}-{name}.log"
    mark = len(run.log_text())
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-c", script, *args),
                *("--socket", str(run.daemon.state_dir / "nri.sock"), "--name", name, "--idx", idx),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + REGISTER_SECONDS
        while (
            f"{idx}-{name}" not in run.log_text()[mark:]
            or "registered" not in run.log_text()[mark:]
        ):
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "plugin did not register"
            time.sleep(POLL_SECONDS)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


async def test_two_plugins_setting_one_env_variable_fail_create_container() -> None:
    with (
        nri_runtime([], extra=["--network", "none"]) as run,
        external_plugin(run, ENV_PLUGIN, "enva", "40", "a"),
        external_plugin(run, ENV_PLUGIN, "envb", "41", "b"),
    ):
        if True:
            async with run.pods() as (pods, rt):
                pod = await pods.run("conflict")
                error = await rpc_error(pods.create(pod, "c", ["sleep", "600"], start=False))
                # The plugin asking second is named first, as upstream words it.
                assert (
                    'plugins "41-envb" and "40-enva" both tried to set Env FOO' in error.details()
                )
                listed = await rt.ListContainers(pb.ListContainersRequest())
                assert [c for c in listed.containers if c.pod_sandbox_id == pod.id] == []


async def test_one_plugin_sets_env_seen_by_the_container() -> None:
    with (
        nri_runtime([], extra=["--network", "none"]) as run,
        external_plugin(run, ENV_PLUGIN, "enva", "40", "from-nri"),
    ):
        if True:
            async with run.pods() as (pods, rt):
                pod = await pods.run("adjusted")
                container = await pods.create(pod, "c", ["sleep", "600"])
                assert await exec_in(rt, container, ["sh", "-c", "echo $FOO"]) == "from-nri"


async def test_plugin_mount_and_annotation_reach_the_container(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "marker").write_text("from the host\n")
    with (
        nri_runtime([], extra=["--network", "none"]) as run,
        external_plugin(run, MOUNT_PLUGIN, "mount", "40", str(shared)),
    ):
        async with run.pods() as (pods, rt):
            pod = await pods.run("mounted")
            container = await pods.create(pod, "c", ["sleep", "600"])
            assert await exec_in(rt, container, ["cat", "/mnt/marker"]) == "from the host"
            # Read-only, as the plugin asked; and only inside the container's mount namespace.
            denied = await rt.ExecSync(
                pb.ExecSyncRequest(container_id=container, cmd=["touch", "/mnt/new"], timeout=10)
            )
            assert denied.exit_code != 0
            assert b"Read-only file system" in denied.stderr
            assert not Path("/mnt/marker").exists()
            status = (
                await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=container))
            ).status
            assert status.annotations["podgate.test/mounted"] == "yes"
            assert [(m.host_path, m.container_path, m.readonly) for m in status.mounts] == [
                (str(shared), "/mnt", True)
            ]


# The sample adjusting plugin built with the SDK, run as an external plugin.
ULIMITS_PLUGIN = r"""
import sys
from podgate.nri.plugins.ulimits import main
sys.exit(main(sys.argv[1:]))
"""


async def annotated_pod(pods: Pods, name: str, annotations: dict[str, str]) -> Pod:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="e2e", uid=f"{name}-uid"),
        annotations=annotations,
    )
    response = await pods.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config))
    pods.created.append(response.pod_sandbox_id)
    return Pod(response.pod_sandbox_id, config)


async def test_an_adjustment_podgate_cannot_apply_fails_create_naming_plugin_and_field() -> None:
    with (
        nri_runtime([], extra=["--network", "none"]) as run,
        external_plugin(run, ULIMITS_PLUGIN, "ulimits", "30"),
    ):
        async with run.pods() as (pods, rt):
            limits = "- type: nofile\n  hard: 4096\n  soft: 1024\n"
            key = "ulimits.noderesource.dev/container.c"
            pod = await annotated_pod(pods, "limited", {key: limits})
            error = await rpc_error(pods.create(pod, "c", ["sleep", "600"], start=False))
            # A container without a root has no OCI spec to carry rlimits (runc containers
            # take them: test_runtime_nri_runc.py).
            assert (
                'plugin "30-ulimits" set Rlimits RLIMIT_NOFILE, which a container without a root '
                "of its own cannot take" in error.details()
            )
            listed = await rt.ListContainers(pb.ListContainersRequest())
            assert [c for c in listed.containers if c.pod_sandbox_id == pod.id] == []
            # A container the plugin leaves alone is created as usual.
            other = await pods.create(pod, "other", ["sleep", "600"], start=False)
            assert other


async def test_plugin_that_never_answers_is_dropped() -> None:
    extra = ["--network", "none", "--nri-request-timeout", "1"]
    with nri_runtime(["logger"], extra=extra) as run:
        with external_plugin(run, HANG_PLUGIN, "hang", "50"):
            async with run.pods() as (pods, rt):
                started = time.monotonic()
                pod = await pods.run("survives")
                # Bounded by the request timeout, not by the plugin.
                assert time.monotonic() - started < 1 + REGISTER_SECONDS / 2
                status = await rt.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id)
                )
                assert status.status.state == pb.SANDBOX_READY
                assert "dropping plugin 50-hang" in run.log_text()
                await pods.run("after")
        events = (run.state / "events.jsonl").read_text()
        assert events.count('"RunPodSandbox"') == 2  # the logger got both pods


@pytest.mark.parametrize("network", ["native", "cni"])
async def test_plugin_crash_during_churn_leaks_nothing(network: str) -> None:
    """50 pods created and removed while the network plugin is killed and restarted."""
    with nri_runtime([], extra=["--network", "nri"]) as run:
        conf = (
            run.net.native_conf(run.state) if network == "native" else run.net.cni_conf(run.state)
        )
        bridge = run.net.native_bridge if network == "native" else run.net.cni_bridge
        module = f"podgate.nri.plugins.{network}"
        options = {"state_dir": "--state-dir", "bridge": "--bridge"}
        options |= {"ranges": "--range", "subnets": "--subnet"}
        args = [f"{options[key]}={value}" for key, value in conf.items() if key in options]
        script = f"import sys\nfrom {module} import main\nsys.exit(main())"
        async with run.pods() as (pods, rt):
            with external_plugin(run, script, network, "10", *args) as plugin:
                first = [await pods.run(f"churn-{n}") for n in range(25)]
                assert all([(await pod_ips(rt, p))[0] for p in first])
                plugin.send_signal(signal.SIGKILL)  # crash: no teardown
                plugin.wait()
            for pod in first[:12]:  # removed while the plugin is gone
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
                pods.created.remove(pod.id)
            with external_plugin(run, script, network, "10", *args):
                rest = [await pods.run(f"churn-{n}") for n in range(25, CHURN_PODS)]
                assert all([(await pod_ips(rt, p))[0] for p in rest])
                await pods.remove_all()
                assert links_on(bridge) == []
                assert lease_files(run.state / network) == []
        assert links_on(bridge) == []
        assert lease_files(run.state / network) == []
        pods_dir = run.daemon.state_dir / "pods"
        assert list(pods_dir.glob("*.json")) == []
        # No pod holder (the owner of a pod's namespaces) or shim outlives its pod.
        assert processes_mentioning(str(run.daemon.state_dir)) == [run.daemon.process.pid]
