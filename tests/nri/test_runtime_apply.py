"""The runtime's NRI side applying adjustments and updates (podgate.runtime.nri) against a real
adaptation and plugin peers: what a container with a root gets, what the host refuses (by
plugin and field), CDI devices from a spec directory, and container updates and evictions
handed to the runtime. The runtime itself is replaced by a recorder (this layer's unit test);
the end-to-end tests run the real one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nripeer import Peer
from test_adaptation import bit, join
from test_convert import make_container, make_pod
from test_runtime_wiring import wired

from podgate.model import ContainerState
from podgate.nri import api_pb2 as api
from podgate.nri.adjust import Adjustment, Update
from podgate.nri.merge import NriError, UnappliedAdjustmentError
from podgate.oci.adjust import HostSupport
from podgate.runtime.nri import RuntimeNri, UnsupportedAdjustmentError

__all__ = ["wired"]

HOST = HostSupport(
    controllers=frozenset({"cpu", "cpuset", "memory", "pids", "devices"}),
    runtime="runc 1.1.5",
)


class Recorder:
    def __init__(self) -> None:
        self.applied: list[tuple[str, dict[str, Any]]] = []
        self.evicted: list[tuple[str, str]] = []

    async def apply_resources(self, container_id: str, resources: dict[str, Any]) -> None:
        if container_id == "gone":
            raise LookupError("container gone not found")
        self.applied.append((container_id, resources))

    async def evict_container(self, container_id: str, reason: str) -> None:
        self.evicted.append((container_id, reason))


def rooted() -> Any:
    container = make_container()
    container.state = ContainerState.CREATED
    container.spec.rootfs = ["/lower"]
    return container


async def plugin(wired: Any, name: str, index: str, adjust: Any) -> None:
    adaptation, _, peers = wired
    message = adjust.message if isinstance(adjust, Adjustment) else adjust
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(adjust=message)}
    await join(
        adaptation, peers, Peer(name, index, events=bit(api.CREATE_CONTAINER), replies=replies)
    )


def supported(runtime_nri: RuntimeNri) -> RuntimeNri:
    runtime_nri._support = HOST  # the host this unit test describes
    return runtime_nri


async def test_a_rooted_container_gets_the_whole_adjustment(wired: Any) -> None:
    adjust = (
        Adjustment()
        .add_device("/dev/nri-null", "c", 1, 3)
        .add_rlimit("RLIMIT_NOFILE", hard=4096, soft=1024)
        .add_hook("prestart", "/bin/true")
        .set_memory_limit(1 << 26)
        .add_env("FOO", "nri")
    )
    await plugin(wired, "all", "20", adjust)
    runtime_nri = supported(wired[1])
    container = rooted()
    oci = await runtime_nri.container_creating(make_pod(), container)
    assert oci["devices"] == [{"path": "/dev/nri-null", "type": "c", "major": 1, "minor": 3}]
    assert oci["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 1024}]
    assert oci["hooks"] == {"prestart": [{"path": "/bin/true"}]}
    assert oci["resources"] == {"memory": {"limit": 1 << 26}}
    assert container.spec.envs["FOO"] == "nri"


async def test_what_the_host_cannot_honour_fails_by_plugin_and_field(wired: Any) -> None:
    adjust = Adjustment().set_io_priority(api.IOPRIO_CLASS_BE, 4)
    await plugin(wired, "env", "10", Adjustment().add_env("A", "1"))
    await plugin(wired, "ioprio", "30", adjust)
    container = rooted()
    with pytest.raises(UnsupportedAdjustmentError) as info:
        await supported(wired[1]).container_creating(make_pod(), container)
    assert str(info.value) == (
        'plugin "30-ioprio" set IoPriority, which this host cannot honour: '
        "runc 1.1.5 does not support process.ioPriority"
    )
    assert "A" not in container.spec.envs  # nothing half-applied


async def test_a_container_without_a_root_takes_only_spec_fields(wired: Any) -> None:
    await plugin(wired, "limits", "20", Adjustment().add_rlimit("RLIMIT_NPROC", hard=9, soft=9))
    container = make_container()
    container.state = ContainerState.CREATED
    with pytest.raises(UnappliedAdjustmentError) as info:
        await supported(wired[1]).container_creating(make_pod(), container)
    assert str(info.value) == (
        'plugin "20-limits" set Rlimits RLIMIT_NPROC, which a container without a root of its '
        "own cannot take (it has no OCI spec)"
    )


async def test_non_bind_mounts_go_to_the_oci_spec_only(wired: Any) -> None:
    adjust = Adjustment().add_mount("/scratch", "tmpfs", "tmpfs", ["nosuid", "size=1m"])
    await plugin(wired, "tmpfs", "20", adjust)
    container = rooted()
    oci = await supported(wired[1]).container_creating(make_pod(), container)
    assert oci["mounts"] == [
        {
            "destination": "/scratch",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "size=1m"],
        }
    ]
    assert "/scratch" not in [m["container_path"] for m in container.spec.mounts]
    rootless = make_container()
    rootless.state = ContainerState.CREATED
    with pytest.raises(UnsupportedAdjustmentError, match="takes bind mounts only, not tmpfs"):
        await wired[1].container_creating(make_pod(), rootless)


async def test_cdi_devices_come_from_the_spec_directory(wired: Any, tmp_path: Path) -> None:
    spec = {
        "cdiVersion": "0.6.0",
        "kind": "example.com/null",
        "containerEdits": {"env": ["VENDOR=example"]},
        "devices": [
            {"name": "one", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}},
        ],
    }
    (tmp_path / "example.json").write_text(json.dumps(spec))
    (tmp_path / "other.yaml").write_text(
        "cdiVersion: 0.6.0\nkind: example.com/yaml\ndevices:\n  - name: two\n"
        "    containerEdits:\n      env: [TWO=2]\n"
    )
    await plugin(wired, "cdi", "20", Adjustment().add_cdi_device("example.com/null=one"))
    runtime_nri = supported(wired[1])
    runtime_nri.cdi_spec_dirs = (str(tmp_path),)
    oci = await runtime_nri.container_creating(make_pod(), rooted())
    common, device = oci["cdiEdits"]
    assert common["env"] == ["VENDOR=example"]
    [node] = device["deviceNodes"]
    assert (node["path"], node["type"], node["major"], node["minor"]) == ("/dev/null", "c", 1, 3)


async def test_an_unknown_cdi_device_is_refused_by_plugin(wired: Any, tmp_path: Path) -> None:
    await plugin(wired, "cdi", "20", Adjustment().add_cdi_device("example.com/none=x"))
    runtime_nri = supported(wired[1])
    runtime_nri.cdi_spec_dirs = (str(tmp_path),)
    with pytest.raises(UnsupportedAdjustmentError) as info:
        await runtime_nri.container_creating(make_pod(), rooted())
    assert str(info.value) == (
        'plugin "20-cdi" set CdiDevices, which this host cannot honour: '
        "unresolvable CDI devices example.com/none=x"
    )


async def test_a_cdi_hook_of_unknown_kind_is_refused_by_plugin(wired: Any, tmp_path: Path) -> None:
    spec = {
        "kind": "example.com/hooked",
        "devices": [
            {"name": "h", "containerEdits": {"hooks": [{"hookName": "later", "path": "/x"}]}}
        ],
    }
    (tmp_path / "hooked.json").write_text(json.dumps(spec))
    await plugin(wired, "cdi", "20", Adjustment().add_cdi_device("example.com/hooked=h"))
    runtime_nri = supported(wired[1])
    runtime_nri.cdi_spec_dirs = (str(tmp_path),)
    with pytest.raises(UnsupportedAdjustmentError, match="unknown hook name 'later'") as info:
        await runtime_nri.container_creating(make_pod(), rooted())
    assert str(info.value).startswith('plugin "20-cdi" set CdiDevices')


async def test_updates_reach_the_runtime_and_failures_are_reported(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    supported(runtime_nri)
    recorder = Recorder()
    runtime_nri.updater = recorder
    peer = await join(adaptation, peers, Peer("updater", "10"))
    updates = [
        Update("ctr1").set_cpu_quota(20000).message,
        Update("gone").set_cpu_quota(1).message,
        Update("ctr2").set_memory_limit(1 << 26).message,
    ]
    updates[2].linux.resources.hugepage_limits.add(page_size="2MB", limit=1 << 21)
    reply = await peer.update_containers(api.UpdateContainersRequest(update=updates))
    assert [u.container_id for u in reply.failed] == ["gone", "ctr2"]  # unknown; no hugetlb
    assert recorder.applied == [("ctr1", {"cpu": {"quota": 20000}})]


async def test_evictions_stop_containers(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    recorder = Recorder()
    runtime_nri.updater = recorder
    peer = await join(adaptation, peers, Peer("evictor", "10"))
    eviction = api.ContainerEviction(container_id="ctr1", reason="over budget")
    await peer.update_containers(api.UpdateContainersRequest(evict=[eviction]))
    assert recorder.evicted == [("ctr1", "over budget")]


async def test_a_plugin_changes_the_requested_update(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    supported(runtime_nri)
    recorder = Recorder()
    runtime_nri.updater = recorder

    def answer(request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        update = Update(request.container.id).set_cpu_quota(20000).message
        return api.UpdateContainerResponse(update=[update])

    events = bit(api.UPDATE_CONTAINER, api.POST_UPDATE_CONTAINER)
    journal: list[tuple[str, str]] = []
    await join(
        adaptation,
        peers,
        Peer("quota", "10", events=events, replies={"UpdateContainer": answer}, journal=journal),
    )
    journal.clear()
    container = rooted()
    container.state = ContainerState.RUNNING
    requested = api.LinuxResources(
        cpu=api.LinuxCPU(
            quota=api.OptionalInt64(value=50000), period=api.OptionalUInt64(value=100000)
        )
    )
    await runtime_nri.container_updating(make_pod(), container, requested)
    assert recorder.applied == [("ctr1", {"cpu": {"quota": 20000, "period": 100000}})]
    assert [method for _, method in journal] == ["UpdateContainer", "PostUpdateContainer"]


async def test_a_failed_update_fails_the_cri_call_with_the_reason(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    supported(runtime_nri)
    runtime_nri.updater = Recorder()
    events = bit(api.UPDATE_CONTAINER, api.POST_UPDATE_CONTAINER)
    journal: list[tuple[str, str]] = []
    await join(adaptation, peers, Peer("watch", "10", events=events, journal=journal))
    journal.clear()
    container = rooted()
    container.id = "gone"
    requested = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))
    with pytest.raises(NriError) as info:
        await runtime_nri.container_updating(make_pod(), container, requested)
    assert str(info.value) == "failed to update containers (gone: container gone not found)"
    assert [method for _, method in journal] == ["UpdateContainer"]  # no PostUpdateContainer
