"""The sample adjusting plugin (podgate.nri.plugins.ulimits), built with the Python SDK: it
answers the captured CreateContainer with the very bytes containerd/nri's Go ulimit-adjuster
sent, and driven against podgate's runtime side its rlimits are merged, owned by it, and then
refused by name, since podgate does not apply rlimits to containers yet. Also the SDK's
adjustment builders against the merge, and UpdateContainer replies from the SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from capture_support import load
from nripeer import WAIT_SECONDS
from test_adaptation import make_runtime, names, short_dir, until, world  # noqa: F401
from test_convert import make_container, make_pod

from podgate.model import ContainerState
from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import Adaptation, NriError
from podgate.nri.adjust import Adjustment, Update
from podgate.nri.merge import UnappliedAdjustmentError, merge_adjustments
from podgate.nri.plugin import Plugin, Stub
from podgate.nri.plugins.ulimits import Ulimit, UlimitError, Ulimits, parse
from podgate.runtime.nri import RuntimeNri

ANNOTATION = "ulimits.noderesource.dev/container.ctr0"


def test_parse_normalises_types_like_the_go_plugin() -> None:
    text = (
        "- type: RLIMIT_NOFILE\n  hard: 4096\n  soft: 1024\n- type: nproc\n  hard: 9\n  soft: 9\n"
    )
    assert parse(text) == [Ulimit("RLIMIT_NOFILE", 4096, 1024), Ulimit("RLIMIT_NPROC", 9, 9)]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("- type: nofile\n  hard: 1\n  soft: 2\n", "soft limit 2 is above hard limit 1"),
        ("- type: bogus\n  hard: 1\n  soft: 1\n", "unknown rlimit 'bogus'"),
        ("- type: nofile\n  hard: 1\n", "needs type, hard and soft"),
        ("type: nofile", "must be a list"),
        ("- [", "not YAML"),
        ("- type: nofile\n  hard: -1\n  soft: -1\n", "non-negative integers"),
    ],
)
def test_parse_refuses_what_no_container_can_have(text: str, reason: str) -> None:
    with pytest.raises(UlimitError, match=reason):
        parse(text)


async def test_reply_is_byte_identical_to_the_go_ulimit_adjuster() -> None:
    capture = load("3-ulimit-adjuster")
    [request] = capture.requests("CreateContainer")
    [go_reply] = capture.replies("CreateContainer")
    stub = Stub(Ulimits(), socket_path="/nonexistent", reconnect=False)
    ours = await stub._create_container(request.envelope.payload, None)  # type: ignore[arg-type]
    assert ours == go_reply.envelope.payload


@pytest.fixture
async def ulimits_plugin(make_runtime: Any) -> AsyncIterator[Adaptation]:  # noqa: F811
    adaptation = await make_runtime()
    stub = Stub(Ulimits(), socket_path=adaptation.config.socket_path, reconnect=False)
    task = asyncio.get_running_loop().create_task(stub.run())
    try:
        await until(lambda: names(adaptation) == ["30-ulimits"])
        yield adaptation
    finally:
        await adaptation.stop()
        async with asyncio.timeout(WAIT_SECONDS):
            await task


async def test_rlimits_are_merged_owned_and_reach_containers_with_a_root(
    ulimits_plugin: Adaptation,
) -> None:
    adaptation = ulimits_plugin
    capture = load("3-ulimit-adjuster")
    [request] = capture.requests("CreateContainer")
    assert isinstance(request.message, api.CreateContainerRequest)
    result = await adaptation.create_container(request.message.pod, request.message.container)
    assert [(r.type, r.hard, r.soft) for r in result.adjust.rlimits] == [
        ("RLIMIT_NOFILE", 4096, 1024),
        ("RLIMIT_NPROC", 9000, 9000),
    ]
    owners = result.owners.owners[request.message.container.id].compound[api.Rlimits].owners
    assert dict(owners) == {"RLIMIT_NOFILE": "30-ulimits", "RLIMIT_NPROC": "30-ulimits"}
    # Through the runtime's wiring: CreateContainer fails naming the plugin and the field.
    pod = make_pod(annotations={ANNOTATION: "- type: nofile\n  hard: 64\n  soft: 32\n"})
    container = make_container()
    container.metadata.name, container.state = "ctr0", ContainerState.CREATED
    with pytest.raises(UnappliedAdjustmentError) as info:
        await RuntimeNri(adaptation, network=False).container_creating(pod, container)
    assert str(info.value) == (
        'plugin "30-ulimits" set Rlimits RLIMIT_NOFILE, which a container without a root of its '
        "own cannot take (it has no OCI spec)"
    )
    # A container with a root takes them into its OCI spec.
    container.spec.rootfs = ["/lower"]
    oci = await RuntimeNri(adaptation, network=False).container_creating(pod, container)
    assert oci["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 64, "soft": 32}]


async def test_a_bad_annotation_fails_create_with_the_reason(ulimits_plugin: Adaptation) -> None:
    pod = api.PodSandbox(id="p", annotations={ANNOTATION: "- type: nofile\n  hard: 1\n  soft: 5\n"})
    with pytest.raises(NriError) as info:
        await ulimits_plugin.create_container(pod, api.Container(id="c", name="ctr0"))
    assert "30-ulimits failed CreateContainer" in str(info.value)
    assert "soft limit 5 is above hard limit 1" in str(info.value)


async def test_no_annotation_no_adjustment(ulimits_plugin: Adaptation) -> None:
    result = await ulimits_plugin.create_container(
        api.PodSandbox(id="p"), api.Container(id="c", name="ctr0")
    )
    assert result.adjust == api.ContainerAdjustment() and result.claims == ()


def test_adjustment_builders_cover_every_field_and_merge() -> None:
    adjust = (
        Adjustment()
        .add_annotation("a", "1")
        .remove_annotation("gone")
        .add_mount("/mnt", "/src", options=["bind", "ro"])
        .remove_mount("/old")
        .add_env("FOO", "1")
        .remove_env("BAR")
        .replace_args(["/bin/true"])
        .add_hook("prestart", "/bin/hook", ["hook", "x"], env=["A=1"], timeout=5)
        .add_rlimit("RLIMIT_NOFILE", hard=8, soft=4)
        .add_cdi_device("vendor.com/dev=0")
        .add_device("/dev/nri-null", "c", 1, 3, file_mode=0o666, uid=0, gid=0)
        .remove_device("/dev/old")
        .set_cgroups_path("/pods/x")
        .set_oom_score_adj(100)
        .set_io_priority(api.IOPRIO_CLASS_BE, 4)
        .set_seccomp_policy(api.LinuxSeccomp(default_action="SCMP_ACT_ALLOW"))
        .add_namespace("network", "/proc/1/ns/net")
        .remove_namespace("ipc")
        .set_sysctl("net.core.somaxconn", "1024")
        .remove_sysctl("kernel.x")
        .add_net_device("eth1", "net1")
        .remove_net_device("eth9")
        .set_scheduler(api.LinuxScheduler(policy=api.SCHED_BATCH, nice=3))
        .set_rdt_clos_id("gold")
        .set_rdt_schemata(["L3:0=f"])
        .set_rdt_monitoring(True)
        .set_memory_policy(api.MPOL_BIND, "0", [api.MPOL_F_STATIC_NODES])
        .set_memory_limit(1 << 30)
        .set_memory_reservation(1 << 29)
        .set_memory_swap(1 << 31)
        .set_memory_swappiness(10)
        .set_memory_kernel(1 << 20)
        .set_memory_kernel_tcp(1 << 20)
        .set_memory_use_hierarchy(True)
        .set_memory_disable_oom_killer(False)
        .set_cpu_shares(512)
        .set_cpu_quota(50_000)
        .set_cpu_period(100_000)
        .set_cpu_realtime(950, 1000)
        .set_cpuset_cpus("0-1")
        .set_cpuset_mems("0")
        .add_hugepage_limit("2MB", 1 << 21)
        .set_blockio_class("slow")
        .set_rdt_class("gold")
        .set_unified("memory.high", "max")
        .set_pids_limit(100)
        .add_device_rule(allow=True, kind="c", major=1, minor=3, access="rw")
    ).message
    linux = adjust.linux
    assert getattr(linux.io_priority, "class") == api.IOPRIO_CLASS_BE
    assert list(adjust.args) == ["", "/bin/true"]
    assert adjust.hooks.prestart[0].timeout.value == 5
    assert linux.resources.devices[0].major.value == 1
    result = merge_adjustments(api.Container(id="c"), [("50-all", adjust)])
    fields = {claim.field.upstream_name for claim in result.claims}
    every_field = {v.name for v in api.Field.DESCRIPTOR.values if v.name != "None"}
    assert fields == every_field | {"LinuxResources.Devices"}
    assert result.adjust.linux.sysctl["-kernel.x"] == ""


async def test_update_container_replies_from_the_sdk(make_runtime: Any) -> None:  # noqa: F811
    class Capper(Plugin):
        name, index = "capper", "60"

        async def update_container(
            self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
        ) -> list[Update]:
            return [
                Update(container.id).set_memory_limit(1 << 20),
                Update("other").set_cpu_quota(1),
            ]

    adaptation = await make_runtime()
    stub = Stub(Capper(), socket_path=adaptation.config.socket_path, reconnect=False)
    task = asyncio.get_running_loop().create_task(stub.run())
    try:
        await until(lambda: names(adaptation) == ["60-capper"])
        quota = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=7)))
        updates = await adaptation.update_container(
            api.PodSandbox(id="p"), api.Container(id="c"), quota
        )
        assert [u.container_id for u in updates] == ["c", "other"]
        assert updates[0].linux.resources.memory.limit.value == 1 << 20
        assert updates[0].linux.resources.cpu.quota.value == 7
    finally:
        await adaptation.stop()
        async with asyncio.timeout(WAIT_SECONDS):
            await task
