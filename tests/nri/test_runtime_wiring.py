"""The runtime's NRI wiring (podgate.runtime.nri) against a real adaptation and plugin peers:
what it does with merged adjustments it cannot apply, with container updates, and the order of
the update events."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nripeer import Peer
from test_adaptation import bit, join
from test_convert import make_container, make_pod

from podgate.model import ContainerState
from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import Adaptation, NriConfig, UpdatesNotSupportedError
from podgate.nri.adjust import Adjustment
from podgate.nri.merge import UnappliedAdjustmentError
from podgate.proto.ttrpc import Code, TtrpcError
from podgate.runtime.nri import RuntimeNri


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Adaptation, RuntimeNri, list[Peer]]]:
    path = tempfile.mkdtemp(prefix="nri-")
    config = NriConfig(
        socket_path=os.path.join(path, "nri.sock"),
        plugin_path=os.path.join(path, "plugins"),
        plugin_config_path=os.path.join(path, "conf.d"),
    )
    adaptation = Adaptation(
        config, runtime_name="podgate", runtime_version="t", sync=lambda: ([], [])
    )
    runtime_nri = RuntimeNri(adaptation, network=False)
    adaptation.update_handler = runtime_nri
    peers: list[Peer] = []
    await adaptation.start()
    try:
        yield adaptation, runtime_nri, peers
    finally:
        for peer in peers:
            await peer.aclose()
        await adaptation.stop()
        shutil.rmtree(path, ignore_errors=True)


def created() -> Any:
    container = make_container()
    container.state = ContainerState.CREATED
    return container


async def test_an_adjustment_the_runtime_cannot_apply_fails_create_by_name(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    device = api.LinuxDevice(path="/dev/nri-null", type="c", major=1, minor=3)
    adjust = api.ContainerAdjustment(
        env=[api.KeyValue(key="FOO", value="nri")],
        linux=api.LinuxContainerAdjustment(devices=[device]),
    )
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(adjust=adjust)}
    await join(
        adaptation, peers, Peer("devices", "20", events=bit(api.CREATE_CONTAINER), replies=replies)
    )
    container = created()
    with pytest.raises(UnappliedAdjustmentError) as info:
        await runtime_nri.container_creating(make_pod(), container)
    assert str(info.value) == (
        'plugin "20-devices" set Devices /dev/nri-null, which a container without a root of '
        "its own cannot take (it has no OCI spec)"
    )
    assert container.spec.envs["FOO"] == "1"  # nothing half-applied


async def test_applied_fields_still_reach_the_spec(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    adjust = api.ContainerAdjustment(env=[api.KeyValue(key="FOO", value="nri")])
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(adjust=adjust)}
    await join(
        adaptation, peers, Peer("env", "10", events=bit(api.CREATE_CONTAINER), replies=replies)
    )
    container = created()
    await runtime_nri.container_creating(make_pod(), container)
    assert container.spec.envs["FOO"] == "nri"


async def test_unsolicited_updates_reach_the_runtime_seam(wired: Any) -> None:
    adaptation, _, peers = wired
    peer = await join(adaptation, peers, Peer("updater", "10"))
    update = api.ContainerUpdate(container_id="ctr1")
    with pytest.raises(TtrpcError) as info:
        await peer.update_containers(api.UpdateContainersRequest(update=[update]))
    assert info.value.code == Code.UNIMPLEMENTED
    assert info.value.message == (
        "updating container resources (ctr1) is not supported by this runtime"
    )


async def test_container_update_events_in_upstream_order(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    journal: list[tuple[str, str]] = []
    events = bit(
        api.UPDATE_CONTAINER,
        api.POST_UPDATE_CONTAINER,
        api.UPDATE_POD_SANDBOX,
        api.POST_UPDATE_POD_SANDBOX,
    )
    await join(adaptation, peers, Peer("watch", "10", events=events, journal=journal))
    journal.clear()  # Configure, Synchronize
    resources = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))
    await runtime_nri.pod_updating(make_pod(), None, resources)
    await runtime_nri.pod_updated(make_pod())
    assert [method for _, method in journal] == ["UpdatePodSandbox", "PostUpdatePodSandbox"]
    journal.clear()
    container = make_container()
    container.state = ContainerState.RUNNING
    # Without a runtime to apply updates: UpdateContainer goes out, the update is refused
    # with the reason, and PostUpdateContainer (which reports an applied update) does not.
    with pytest.raises(UpdatesNotSupportedError, match="not supported by this runtime"):
        await runtime_nri.container_updating(make_pod(), container, resources)
    assert [method for _, method in journal] == ["UpdateContainer"]


async def test_post_update_follows_an_applied_update(wired: Any) -> None:
    adaptation, _, peers = wired

    class Applying(RuntimeNri):
        async def update_containers(self, updates: Any) -> list[api.ContainerUpdate]:
            self.applied = list(updates)
            return []

    applying = Applying(adaptation, network=False)
    journal: list[tuple[str, str]] = []
    events = bit(api.UPDATE_CONTAINER, api.POST_UPDATE_CONTAINER)
    await join(adaptation, peers, Peer("watch", "10", events=events, journal=journal))
    journal.clear()  # Configure, Synchronize
    resources = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))
    await applying.container_updating(make_pod(), make_container(), resources)
    assert [method for _, method in journal] == ["UpdateContainer", "PostUpdateContainer"]
    assert [u.linux.resources.cpu.quota.value for u in applying.applied] == [5000]


async def test_hooks_and_resources_are_merged_then_refused_by_name(wired: Any) -> None:
    adaptation, runtime_nri, peers = wired
    hook = Adjustment().add_hook("prestart", "/bin/true", ["true"]).message
    limit = Adjustment().add_hook("poststop", "/bin/true").set_memory_limit(1 << 26).message
    for name, index, adjust in (("hooker", "10", hook), ("limiter", "20", limit)):
        replies = {"CreateContainer": lambda _, a=adjust: api.CreateContainerResponse(adjust=a)}
        await join(
            adaptation, peers, Peer(name, index, events=bit(api.CREATE_CONTAINER), replies=replies)
        )
    result = await adaptation.create_container(make_pod_message(), api.Container(id="c"))
    assert [h.path for h in result.adjust.hooks.prestart] == ["/bin/true"]
    assert len(result.adjust.hooks.poststop) == 1
    assert result.adjust.linux.resources.memory.limit.value == 1 << 26
    owners = result.owners.owners["c"]
    assert owners.simple[api.OciHooks] == "10-hooker,20-limiter"  # hooks accumulate
    assert owners.simple[api.MemLimit] == "20-limiter"
    with pytest.raises(UnappliedAdjustmentError) as info:
        await runtime_nri.container_creating(make_pod(), created())
    assert str(info.value) == (
        'plugin "10-hooker" set OciHooks, which a container without a root of its own cannot '
        "take (it has no OCI spec) (and 2 more)"
    )
    assert [(c.plugin, c.field.upstream_name) for c in info.value.claims] == [
        ("10-hooker", "OciHooks"),
        ("20-limiter", "OciHooks"),
        ("20-limiter", "MemLimit"),
    ]


def make_pod_message() -> api.PodSandbox:
    return api.PodSandbox(id="p", name="web", namespace="default")
