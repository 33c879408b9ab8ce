"""NRI adjustments on containers that run through runc: a real `podgate runtime`, containers
from the sample busybox image in its image store (`podgate images import`, as the kubelet's
pods use images), and plugins written on podgate's SDK (plus the sample ulimits plugin) as
external plugins. Each effect is checked where the kernel shows it: inside the container, in
/proc/<pid>/limits, in the container's cgroup files on the host, or on the host's filesystem
for a hook. CRI UpdatePodSandboxResources is checked the same way: what subscribed plugins
see, and the pod's cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from runtime_e2e_support import POD_NAMESPACE, POLL_SECONDS, Pod, Pods, rpc_error, unknown_id
from test_runtime_images import import_images
from test_runtime_nri import NriRuntime, exec_in, external_plugin
from test_runtime_nri import nri_runtime as bare_nri_runtime
from test_runtime_runc import container, run_pod

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.demo.sample_images import BUSYBOX_IMAGE, SampleImageError, build_sample_images
from podgate.images.builder import write_oci_layout
from podgate.oci import features
from podgate.runtime.store import RUN_NAME_CHARS, run_root

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
# The image every container here runs from, imported into each runtime's store.
IMAGE = BUSYBOX_IMAGE
# How long a plugin may take to send its update once the container has started, seconds.
UPDATE_WAIT_SECONDS = 30.0
# A plugin on the SDK: argv[1] says what it adjusts, argv[2] the value.
ADJUST_PLUGIN = r"""
import sys
from podgate.nri.adjust import Adjustment, Update
from podgate.nri.plugin import Plugin, run_plugin
mode, value = sys.argv[1], sys.argv[2]
class Adjuster(Plugin):
    async def create_container(self, pod, container):
        adjust = Adjustment()
        if mode == "device":
            adjust.add_device(value, "c", 1, 3, file_mode=0o666)
        elif mode == "hook":
            adjust.add_hook("prestart", "/bin/sh", ["sh", "-c", "cat > " + value])
        elif mode == "memory":
            adjust.set_memory_limit(int(value))
        elif mode == "cdi":
            adjust.add_cdi_device(value)
        elif mode == "tmpfs":
            adjust.add_mount(value, "tmpfs", "tmpfs", ["nosuid", "nodev", "size=1m"])
        elif mode == "kernel-memory":
            adjust.set_memory_kernel(int(value))
        elif mode == "hugepages":
            adjust.message.linux.resources.hugepage_limits.add(page_size="2MB", limit=int(value))
        return adjust
    async def update_container(self, pod, container, resources):
        if mode == "quota":
            return [Update(container.id).set_cpu_quota(int(value))]
        return []
sys.exit(run_plugin(Adjuster(), sys.argv[3:]))
"""
# A plugin on the SDK that, once a container has started, asks on its own (UpdateContainers)
# for that container's CPU quota to become argv[1], and prints what the runtime failed.
UNSOLICITED_PLUGIN = r"""
import argparse, asyncio, sys
from podgate.nri.adjust import Update
from podgate.nri.plugin import Plugin, Stub
parser = argparse.ArgumentParser()
parser.add_argument("quota", type=int)
parser.add_argument("--socket")
parser.add_argument("--name")
parser.add_argument("--idx")
args = parser.parse_args()
class Started(Plugin):
    def __init__(self):
        self.started = asyncio.Queue()
    async def post_start_container(self, pod, container):
        self.started.put_nowait(container.id)
async def main():
    plugin = Started()
    stub = Stub(plugin, socket_path=args.socket, name=args.name, index=args.idx)
    async with asyncio.TaskGroup() as group:
        group.create_task(stub.run())
        container_id = await plugin.started.get()
        failed = await stub.update_containers([Update(container_id).set_cpu_quota(args.quota)])
        print("updated", container_id, "failed", len(failed), flush=True)
asyncio.run(main())
"""
ULIMITS_PLUGIN = (
    "import runpy; runpy.run_module('podgate.nri.plugins.ulimits', run_name='__main__')"
)
ULIMITS = (
    "- type: RLIMIT_NOFILE\n  hard: 4096\n  soft: 1024\n- type: nproc\n  hard: 9000\n  soft: 9000\n"
)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout holding the sample busybox image, built once for the module."""
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    try:
        built = build_sample_images()[BUSYBOX_IMAGE]
    except SampleImageError:
        pytest.skip("busybox-static is not installed")
    path = tmp_path_factory.mktemp("layout") / "images"
    write_oci_layout([(built, BUSYBOX_IMAGE)], path)
    return path


@contextlib.contextmanager
def nri_runtime(
    plugins: Sequence[str], extra: Sequence[str] = (), *, layout: Path
) -> Iterator[NriRuntime]:
    """The NRI runtime of test_runtime_nri with the busybox image imported into its store."""
    with bare_nri_runtime(plugins, extra) as run:
        import_images(run.daemon.state_dir, layout)
        yield run


async def cgroup_dir(rt: pb_grpc.RuntimeServiceStub, container_id: str, controller: str) -> Path:
    """The container's cgroup directory of a v1 controller (or the v2 one), on the host."""
    for line in (await exec_in(rt, container_id, ["cat", "/proc/self/cgroup"])).splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controllers == "" and controller == ""):
            base = CGROUP_ROOT / controller if controller else CGROUP_ROOT
            return base / path.lstrip("/")
    raise AssertionError(f"no {controller} cgroup for {container_id}")


def bundle_config(state: Path, container_id: str) -> dict[str, object]:
    config = run_root(state) / container_id[:RUN_NAME_CHARS] / "bundle" / "config.json"
    data: dict[str, object] = json.loads(config.read_text())
    return data


async def test_a_plugin_device_is_usable_inside_the_container(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "devices", "20", "device", "/dev/nri-null"),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "devices")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            listing = await exec_in(rt, ctr, ["ls", "-ln", "/dev/nri-null"])
            assert listing.startswith("crw-rw-rw-"), listing
            assert "1,   3" in listing or "1, 3" in listing, listing
            written = await exec_in(
                rt, ctr, ["sh", "-c", "echo data > /dev/nri-null && cat /dev/nri-null && echo ok"]
            )
            assert written == "ok"
            config = bundle_config(run.daemon.state_dir, ctr)
            rules = config["linux"]["resources"]["devices"]  # type: ignore[index]
            assert {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rw"} in rules
            if not (CGROUP_ROOT / "cgroup.controllers").exists():
                allowed = (await cgroup_dir(rt, ctr, "devices") / "devices.list").read_text()
                assert "c 1:3 rw" in allowed, allowed


async def test_a_plugin_cdi_device_comes_from_the_spec_directory(
    layout: Path, tmp_path: Path
) -> None:
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "example.yaml").write_text(
        "cdiVersion: 0.6.0\n"
        "kind: example.com/null\n"
        "containerEdits:\n"
        "  env: [EXAMPLE_VENDOR=yes]\n"
        "devices:\n"
        "  - name: one\n"
        "    containerEdits:\n"
        "      deviceNodes:\n"
        "        - path: /dev/cdi-null\n"
        "          hostPath: /dev/null\n"
    )
    with (
        nri_runtime(
            [], extra=["--network", "none", "--cdi-spec-dir", str(specs)], layout=layout
        ) as run,
        external_plugin(run, ADJUST_PLUGIN, "cdi", "20", "cdi", "example.com/null=one"),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "cdi")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            script = "echo data > /dev/cdi-null && cat /dev/cdi-null && echo $EXAMPLE_VENDOR"
            assert await exec_in(rt, ctr, ["sh", "-c", script]) == "yes"
            listing = await exec_in(rt, ctr, ["ls", "-ln", "/dev/cdi-null"])
            assert listing.startswith("c"), listing
            config = bundle_config(run.daemon.state_dir, ctr)
            rules = config["linux"]["resources"]["devices"]  # type: ignore[index]
            assert {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"} in rules


async def test_the_ulimits_plugin_sets_the_process_rlimits(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ULIMITS_PLUGIN, "ulimits", "30"),
    ):
        async with run.pods() as (pods, rt):
            annotations = {"ulimits.noderesource.dev/container.c": ULIMITS}
            pod = await run_pod(rt, pods, "ulimits", annotations=annotations)
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            # The container's own process (PID 1 of the pod's PID namespace is the pod's holder).
            limits = await exec_in(rt, ctr, ["sh", "-c", "cat /proc/$(pidof sleep)/limits"])
            [nofile] = [line for line in limits.splitlines() if line.startswith("Max open files")]
            assert nofile.split()[3:5] == ["1024", "4096"], nofile
            [nproc] = [line for line in limits.splitlines() if line.startswith("Max processes")]
            assert nproc.split()[2:4] == ["9000", "9000"], nproc


async def test_a_plugin_hook_runs(layout: Path, tmp_path: Path) -> None:
    state_file = tmp_path / "hook-state.json"
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "hooks", "20", "hook", str(state_file)),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "hooks")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            # runc ran the prestart hook on the host with the container's state on stdin.
            state = json.loads(state_file.read_text())
            assert state["id"] == ctr
            assert state["status"] == "creating"  # what runc 1.1 reports to prestart hooks
            assert state["pid"] > 0


async def test_a_plugin_tmpfs_mount_is_mounted(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "tmpfs", "20", "tmpfs", "/scratch"),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "tmpfs")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            mounts = await exec_in(rt, ctr, ["cat", "/proc/self/mounts"])
            [line] = [m for m in mounts.splitlines() if m.split()[1] == "/scratch"]
            assert line.split()[2] == "tmpfs"
            assert "size=1024k" in line and "nosuid" in line, line
            assert (
                await exec_in(rt, ctr, ["sh", "-c", "echo x > /scratch/f && cat /scratch/f"]) == "x"
            )


async def test_a_plugin_memory_limit_reaches_the_cgroup(layout: Path) -> None:
    limit = 48 * 1024 * 1024
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "memory", "20", "memory", str(limit)),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "memory")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            if (CGROUP_ROOT / "cgroup.controllers").exists():
                value = (await cgroup_dir(rt, ctr, "") / "memory.max").read_text()
            else:
                value = (await cgroup_dir(rt, ctr, "memory") / "memory.limit_in_bytes").read_text()
            assert int(value) == limit


async def test_an_adjustment_the_host_cannot_honour_fails_create(layout: Path) -> None:
    # Hugepage limits where the host has no hugetlb controller (as here); elsewhere the kernel
    # memory limit, which no host honours any more.
    if "hugetlb" in features.probe("runc").controllers:
        mode, field = "kernel-memory", "MemKernelLimit"
    else:
        mode, field = "hugepages", "HugepageLimits 2MB"
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "pages", "20", mode, str(1 << 21)),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "pages")
            error = await rpc_error(container(rt, pod, IMAGE, "c", ["sleep", "600"], start=False))
            assert f'plugin "20-pages" set {field}, which this ' in error.details()
            if mode == "hugepages":
                assert "no hugetlb cgroup controller" in error.details()
            listed = await rt.ListContainers(pb.ListContainersRequest())
            assert [c for c in listed.containers if c.pod_sandbox_id == pod.id] == []


async def test_a_plugin_update_changes_the_cpu_quota(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, ADJUST_PLUGIN, "quota", "20", "quota", "20000"),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "quota")
            resources = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=90000)
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"], resources=resources)
            v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
            directory = await cgroup_dir(rt, ctr, "" if v2 else "cpu")

            def quota() -> int:
                if v2:
                    return int((directory / "cpu.max").read_text().split()[0])
                return int((directory / "cpu.cfs_quota_us").read_text())

            assert quota() == 90000
            # The kubelet asks for 50000; the plugin's UpdateContainer answer makes it 20000.
            await rt.UpdateContainerResources(
                pb.UpdateContainerResourcesRequest(
                    container_id=ctr,
                    linux=pb.LinuxContainerResources(
                        cpu_period=100000, cpu_quota=50000, oom_score_adj=300
                    ),
                )
            )
            assert quota() == 20000
            config = bundle_config(run.daemon.state_dir, ctr)
            assert config["process"]["oomScoreAdj"] == 300  # type: ignore[index]
            assert config["linux"]["resources"]["cpu"]["quota"] == 20000  # type: ignore[index]
            assert await exec_in(rt, ctr, ["echo", "still running"]) == "still running"


async def test_an_unsolicited_plugin_update_changes_the_cpu_quota(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, UNSOLICITED_PLUGIN, "later", "20", "30000"),
    ):
        async with run.pods() as (pods, rt):
            pod = await run_pod(rt, pods, "unsolicited")
            resources = pb.LinuxContainerResources(cpu_period=100000, cpu_quota=90000)
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"], resources=resources)
            v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
            directory = await cgroup_dir(rt, ctr, "" if v2 else "cpu")
            output = run.state / "plugin-20-later.log"
            deadline = time.monotonic() + UPDATE_WAIT_SECONDS
            while "updated" not in output.read_text():
                assert time.monotonic() < deadline, output.read_text()
                await asyncio.sleep(POLL_SECONDS)
            assert f"updated {ctr} failed 0" in output.read_text()
            if v2:
                assert (directory / "cpu.max").read_text().split()[0] == "30000"
            else:
                assert int((directory / "cpu.cfs_quota_us").read_text()) == 30000
            config = bundle_config(run.daemon.state_dir, ctr)
            assert config["linux"]["resources"]["cpu"]["quota"] == 30000  # type: ignore[index]


# A plugin on the SDK that prints, one JSON line each, the pod events it is sent: the pod's id
# and pod-level resources, and for UpdatePodSandbox the overhead and resources beside the pod.
# argv[1]: "both" subscribes to UpdatePodSandbox and PostUpdatePodSandbox, "none" to neither
# (its methods print all the same if called), "fail" subscribes and fails UpdatePodSandbox.
POD_UPDATE_PLUGIN = r"""
import json, sys
from google.protobuf.json_format import MessageToDict
from podgate.nri import api_pb2 as api
from podgate.nri.plugin import Plugin, event_mask, run_plugin
mode = sys.argv[1]
def show(event, pod, **more):
    linux = pod.linux
    line = {"event": event, "pod": pod.id, "pod_resources": MessageToDict(linux.pod_resources),
            "pod_overhead": MessageToDict(linux.pod_overhead)}
    line.update({k: MessageToDict(v) for k, v in more.items()})
    print(json.dumps(line), flush=True)
class Watch(Plugin):
    events = event_mask(api.RUN_POD_SANDBOX) | (
        0 if mode == "none" else event_mask(api.UPDATE_POD_SANDBOX, api.POST_UPDATE_POD_SANDBOX)
    )
    async def run_pod_sandbox(self, pod):
        show("RunPodSandbox", pod)
    async def update_pod_sandbox(self, pod, overhead, resources):
        show("UpdatePodSandbox", pod, overhead=overhead, resources=resources)
        if mode == "fail":
            raise RuntimeError("no room on this node for the new size")
    async def post_update_pod_sandbox(self, pod):
        show("PostUpdatePodSandbox", pod)
sys.exit(run_plugin(Watch(), sys.argv[2:]))
"""
MIB = 1024 * 1024


def seen(run: NriRuntime, idx: str, name: str, pod_id: str) -> list[dict[str, object]]:
    """The pod events the POD_UPDATE_PLUGIN at `idx` printed for `pod_id`, in order."""
    text = (run.state / f"plugin-{idx}-{name}.log").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line["pod"] == pod_id]


def memory(limit: int) -> dict[str, object]:
    """LinuxResources with a memory limit, as MessageToDict shows it."""
    return {"memory": {"limit": {"value": str(limit)}}}


async def sized_pod(rt: pb_grpc.RuntimeServiceStub, pods: Pods, name: str) -> Pod:
    """A pod whose RunPodSandbox config carries pod-level resources (32 MiB), as the kubelet
    sends them."""
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=POD_NAMESPACE, uid=os.urandom(8).hex()),
        linux=pb.LinuxPodSandboxConfig(
            resources=pb.LinuxContainerResources(memory_limit_in_bytes=32 * MIB)
        ),
    )
    response = await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config))
    pods.created.append(response.pod_sandbox_id)
    return Pod(response.pod_sandbox_id, config)


def pod_cgroup(controller: str, pod_id: str) -> Path:
    """The cgroup podgate keeps for a pod without a cgroup_parent (v1 controller)."""
    return CGROUP_ROOT / controller / "podgate" / pod_id


def pod_record(run: NriRuntime, pod_id: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(
        (run.daemon.state_dir / "pods" / f"{pod_id}.json").read_text()
    )
    return data


def resize_request(pod_id: str) -> pb.UpdatePodSandboxResourcesRequest:
    """A resize: the containers' sum is 64 MiB and half a CPU, the overhead 16 MiB."""
    return pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod_id,
        overhead=pb.LinuxContainerResources(memory_limit_in_bytes=16 * MIB, cpu_shares=64),
        resources=pb.LinuxContainerResources(
            memory_limit_in_bytes=64 * MIB, cpu_period=100000, cpu_quota=50000, cpu_shares=512
        ),
    )


def require_cgroup_v1() -> None:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        pytest.skip("checks the pod cgroup in the v1 hierarchy (this host has v2)")


async def test_a_pod_resize_reaches_subscribed_plugins_and_the_pod_cgroup(layout: Path) -> None:
    require_cgroup_v1()
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, POD_UPDATE_PLUGIN, "watch", "10", "both"),
        external_plugin(run, POD_UPDATE_PLUGIN, "deaf", "20", "none"),
    ):
        async with run.pods() as (pods, rt):
            pod = await sized_pod(rt, pods, "resized")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            status = await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=ctr))
            assert status.status.image.image == IMAGE  # from the store, not a root directory
            # runc put the container under the pod's cgroup.
            assert (await cgroup_dir(rt, ctr, "memory")).parent == pod_cgroup("memory", pod.id)
            await rt.UpdatePodSandboxResources(resize_request(pod.id))
            # The pod cgroup: the containers' sum plus the overhead.
            limit = (pod_cgroup("memory", pod.id) / "memory.limit_in_bytes").read_text()
            assert int(limit) == 80 * MIB
            cpu = pod_cgroup("cpu", pod.id)
            assert int((cpu / "cpu.cfs_period_us").read_text()) == 100000
            assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50000
            assert int((cpu / "cpu.shares").read_text()) == 576
            assert await exec_in(rt, ctr, ["echo", "still running"]) == "still running"
            record = pod_record(run, pod.id)
            assert record["resources"] == {
                "memory_limit_in_bytes": 64 * MIB,
                "cpu_period": 100000,
                "cpu_quota": 50000,
                "cpu_shares": 512,
            }
            assert record["overhead"] == {"memory_limit_in_bytes": 16 * MIB, "cpu_shares": 64}
        new_resources = {
            "memory": {"limit": {"value": str(64 * MIB)}},
            "cpu": {
                "shares": {"value": "512"},
                "quota": {"value": "50000"},
                "period": {"value": "100000"},
            },
        }
        new_overhead = {
            "memory": {"limit": {"value": str(16 * MIB)}},
            "cpu": {"shares": {"value": "64"}},
        }
        # UpdatePodSandbox: the pod as it was, the new sizes beside it; then
        # PostUpdatePodSandbox with the pod as it now is.
        assert seen(run, "10", "watch", pod.id) == [
            {"event": "RunPodSandbox", "pod": pod.id, "pod_resources": memory(32 * MIB),
             "pod_overhead": {}},
            {"event": "UpdatePodSandbox", "pod": pod.id, "pod_resources": memory(32 * MIB),
             "pod_overhead": {}, "overhead": new_overhead, "resources": new_resources},
            {"event": "PostUpdatePodSandbox", "pod": pod.id, "pod_resources": new_resources,
             "pod_overhead": new_overhead},
        ]  # fmt: skip
        # The plugin that did not subscribe heard RunPodSandbox only.
        assert [e["event"] for e in seen(run, "20", "deaf", pod.id)] == ["RunPodSandbox"]


async def test_a_resize_of_an_unknown_pod_is_not_found(layout: Path) -> None:
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, POD_UPDATE_PLUGIN, "watch", "10", "both"),
    ):
        missing = unknown_id()
        async with run.pods() as (_, rt):
            error = await rpc_error(rt.UpdatePodSandboxResources(resize_request(missing)))
        assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
        assert missing in error.details()
        assert seen(run, "10", "watch", missing) == []


async def test_a_plugin_failing_a_resize_fails_it_and_changes_nothing(layout: Path) -> None:
    # containerd: the first plugin error ends the UpdatePodSandbox round (later plugins are not
    # asked), the call fails with it, nothing is recorded and PostUpdatePodSandbox is not sent.
    require_cgroup_v1()
    with (
        nri_runtime([], extra=["--network", "none"], layout=layout) as run,
        external_plugin(run, POD_UPDATE_PLUGIN, "veto", "10", "fail"),
        external_plugin(run, POD_UPDATE_PLUGIN, "watch", "20", "both"),
    ):
        async with run.pods() as (pods, rt):
            pod = await sized_pod(rt, pods, "vetoed")
            ctr = await container(rt, pod, IMAGE, "c", ["sleep", "600"])
            limit_file = pod_cgroup("memory", pod.id) / "memory.limit_in_bytes"
            before = limit_file.read_text()
            error = await rpc_error(rt.UpdatePodSandboxResources(resize_request(pod.id)))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
            assert "NRI UpdatePodSandbox failed" in error.details()
            assert "10-veto" in error.details()
            assert "no room on this node for the new size" in error.details()
            assert limit_file.read_text() == before
            record = pod_record(run, pod.id)
            assert record["resources"] == {"memory_limit_in_bytes": 32 * MIB}
            assert record["overhead"] == {}
            assert await exec_in(rt, ctr, ["echo", "still running"]) == "still running"
        assert [e["event"] for e in seen(run, "10", "veto", pod.id)] == [
            "RunPodSandbox",
            "UpdatePodSandbox",
        ]
        assert [e["event"] for e in seen(run, "20", "watch", pod.id)] == ["RunPodSandbox"]
