"""The adaptation against real plugin peers over its real unix socket: registration,
Configure, Synchronize (split too), event fan-out, StateChange fallback, drops and errors,
adjustment merging and validation, PodSandboxStatus."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from nripeer import WAIT_SECONDS, Peer

from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import (
    Adaptation,
    ConflictError,
    NriConfig,
    NriError,
    UpdatesNotSupportedError,
)
from podgate.proto.ttrpc import MAX_MESSAGE_LENGTH, Code, TtrpcError
from podgate.proto.ttrpc.frames import encode_request

POD = api.PodSandbox(id="pod1", name="web", namespace="default", uid="u1", ips=["192.0.2.1"])
CONTAINER = api.Container(id="ctr1", pod_sandbox_id="pod1", name="app", env=["PATH=/bin"])
# Bytes of one test pod's annotation for the split-Synchronize test: 100 of them are ~2.4x the
# 4 MiB ttrpc limit, so the sync needs three chunks.
BIG_ANNOTATION = 100_000
SHORT_TIMEOUT = 0.3  # seconds: the request timeout where a test waits for one to pass


def bit(*events: int) -> int:
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


@dataclass
class World:
    """What the runtime knows, for Synchronize."""

    pods: list[api.PodSandbox] = field(default_factory=list)
    containers: list[api.Container] = field(default_factory=list)

    def __call__(self) -> tuple[list[api.PodSandbox], list[api.Container]]:
        return list(self.pods), list(self.containers)


@pytest.fixture
def short_dir() -> Iterator[str]:
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="nri-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
async def make_runtime(short_dir: str, world: World) -> AsyncIterator[Callable[..., Any]]:
    started: list[Adaptation] = []

    async def make(**changes: Any) -> Adaptation:
        config = NriConfig(
            socket_path=os.path.join(short_dir, "run", "nri.sock"),
            plugin_path=os.path.join(short_dir, "plugins"),
            plugin_config_path=os.path.join(short_dir, "conf.d"),
            **changes,
        )
        adaptation = Adaptation(config, runtime_name="podgate", runtime_version="1.2.3", sync=world)
        started.append(adaptation)
        await adaptation.start()
        return adaptation

    try:
        yield make
    finally:
        for adaptation in started:
            await adaptation.stop()


@pytest.fixture
async def peers() -> AsyncIterator[list[Peer]]:
    made: list[Peer] = []
    try:
        yield made
    finally:
        for peer in made:
            await peer.aclose()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_SECONDS):
        while not condition():  # noqa: ASYNC110 - polls state the runtime keeps, no event
            await asyncio.sleep(0.01)


def names(adaptation: Adaptation) -> list[str]:
    return [plugin.full_name for plugin in adaptation.plugins]


async def join(adaptation: Adaptation, peers: list[Peer], peer: Peer) -> Peer:
    """Connect, register, and wait until the runtime lists the plugin."""
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    await peer.register()
    await until(lambda: peer.full_name in names(adaptation))
    return peer


# ----------------------------------------------------------------------------- registration


async def test_stale_socket_is_replaced_and_removed_on_stop(
    make_runtime: Any, short_dir: str
) -> None:
    run_dir = os.path.join(short_dir, "run")
    os.makedirs(run_dir, mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(os.path.join(run_dir, "nri.sock"))  # left behind by a previous run
    stale.close()
    adaptation = await make_runtime()
    assert os.stat(adaptation.config.socket_path).st_mode & 0o777 == 0o600
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(adaptation.config.socket_path)  # a live listener now
    finally:
        probe.close()
    await adaptation.stop()
    assert not os.path.exists(adaptation.config.socket_path)


async def test_socket_directory_is_created_0700(make_runtime: Any, short_dir: str) -> None:
    await make_runtime()
    assert os.stat(os.path.join(short_dir, "run")).st_mode & 0o777 == 0o700


async def test_registration_configure_and_synchronize(
    make_runtime: Any, peers: list[Peer], world: World
) -> None:
    world.pods = [POD, api.PodSandbox(id="pod2", name="db")]
    world.containers = [CONTAINER]
    adaptation = await make_runtime()
    peer = await join(adaptation, peers, Peer("logger", "10", events=bit(api.RUN_POD_SANDBOX)))

    (configure,) = peer.received("Configure")
    assert configure == api.ConfigureRequest(
        config="",
        runtime_name="podgate",
        runtime_version="1.2.3",
        registration_timeout=5000,
        request_timeout=2000,
        NRI_version="v0.12.0",
    )
    (sync,) = peer.received("Synchronize")
    assert list(sync.pods) == world.pods
    assert list(sync.containers) == world.containers
    assert sync.more is False
    # Configure before Synchronize, nothing else yet.
    assert [method for _, method in peer.journal] == ["Configure", "Synchronize"]

    (plugin,) = adaptation.plugins
    assert (plugin.idx, plugin.name, plugin.events) == ("10", "logger", 0x0001)
    assert plugin.external
    assert plugin.pid == os.getpid()  # SO_PEERCRED of the peer, this very process


async def test_mask_zero_subscribes_to_everything(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    await join(adaptation, peers, Peer("all", "10", events=0))
    assert adaptation.plugins[0].events == 0x7FFF


async def test_invalid_event_mask_fails_registration(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime()
    peer = Peer("future", "10", events=0x8001)
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await peer.register()
        await peer.wait_closed()
    assert names(adaptation) == []
    assert "invalid plugin events: 0x8000" in caplog.text


@pytest.mark.parametrize(
    ("name", "idx"),
    [("bad name", "10"), ("", "10"), ("ok", "1"), ("ok", "100"), ("ok", "x1"), ("ok/", "10")],
)
async def test_invalid_name_or_index_is_refused(
    make_runtime: Any, peers: list[Peer], name: str, idx: str
) -> None:
    adaptation = await make_runtime()
    peer = Peer("x", "10")
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    with pytest.raises(TtrpcError) as info:
        await peer.register(name=name, idx=idx)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message == (f"invalid plugin name/index: name {name!r}, index {idx!r}")
    await peer.wait_closed()
    assert names(adaptation) == []
    assert peer.received("Configure") == []


async def test_registration_timeout_closes_external_plugin(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime(registration_timeout=SHORT_TIMEOUT)
    peer = Peer("silent", "10")
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await peer.wait_closed()  # never registered: the runtime hangs up
    assert SHORT_TIMEOUT * 0.9 <= loop.time() - started < SHORT_TIMEOUT + 2
    assert names(adaptation) == []


async def test_second_registration_is_refused(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    peer = await join(adaptation, peers, Peer("once", "10"))
    with pytest.raises(TtrpcError) as info:
        await peer.register()
    assert (info.value.code, info.value.message) == (
        Code.FAILED_PRECONDITION,
        "plugin already registered",
    )
    assert names(adaptation) == ["10-once"]


UPDATES = [
    api.ContainerUpdate(container_id="ctr1", ignore_failure=True),
    api.ContainerUpdate(
        container_id="ctr2",
        linux=api.LinuxContainerUpdate(
            resources=api.LinuxResources(
                memory=api.LinuxMemory(limit=api.OptionalInt64(value=1 << 20))
            )
        ),
    ),
]


class RecordingUpdates:
    """An update handler that records what reaches the runtime and fails `failing` ids."""

    def __init__(self, failing: set[str] | None = None) -> None:
        self.failing = failing or set()
        self.updates: list[list[api.ContainerUpdate]] = []
        self.evictions: list[list[api.ContainerEviction]] = []

    async def update_containers(self, updates: Any) -> list[api.ContainerUpdate]:
        self.updates.append(list(updates))
        return [u for u in updates if u.container_id in self.failing]

    async def evict_containers(self, evictions: Any) -> None:
        self.evictions.append(list(evictions))


async def test_unsolicited_updates_without_runtime_support_are_refused_with_the_reason(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    peer = await join(adaptation, peers, Peer("updater", "10"))
    with pytest.raises(TtrpcError) as info:
        await peer.update_containers(api.UpdateContainersRequest(update=UPDATES))
    assert info.value.code == Code.UNIMPLEMENTED
    assert "container updates are not supported by this runtime" in info.value.message


async def test_unsolicited_updates_reach_the_runtime_merged(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    handler = RecordingUpdates(failing={"ctr2"})
    adaptation.update_handler = handler
    peer = await join(adaptation, peers, Peer("updater", "10"))
    evict = [api.ContainerEviction(container_id="ctr3", reason="too big")]
    reply = await peer.update_containers(api.UpdateContainersRequest(update=UPDATES, evict=evict))
    [applied] = handler.updates
    assert [u.container_id for u in applied] == ["ctr1", "ctr2"]
    assert applied[1].linux.resources.memory.limit.value == 1 << 20
    assert applied[0].ignore_failure and not applied[1].ignore_failure
    assert [u.container_id for u in reply.failed] == ["ctr2"]
    assert handler.evictions == [evict]


async def test_a_plugin_may_update_the_same_field_twice(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    adaptation.update_handler = RecordingUpdates()
    peer = await join(adaptation, peers, Peer("updater", "10"))
    quota = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))
    twice = [
        api.ContainerUpdate(container_id="ctr1", linux=api.LinuxContainerUpdate(resources=quota)),
        api.ContainerUpdate(container_id="ctr1", linux=api.LinuxContainerUpdate(resources=quota)),
    ]
    # one plugin owns what it set: setting it twice is no conflict
    reply = await peer.update_containers(api.UpdateContainersRequest(update=twice))
    assert list(reply.failed) == []


# ----------------------------------------------------------------------------- Synchronize


async def test_synchronize_is_split_when_too_big(
    make_runtime: Any, peers: list[Peer], world: World
) -> None:
    world.pods = [
        api.PodSandbox(id=f"pod{i:03d}", annotations={"blob": "x" * BIG_ANNOTATION})
        for i in range(100)
    ]
    world.containers = [api.Container(id=f"ctr{i:03d}", pod_sandbox_id="pod000") for i in range(20)]
    adaptation = await make_runtime()
    peer = await join(adaptation, peers, Peer("big", "10"))
    chunks = peer.received("Synchronize")
    assert len(chunks) == 3
    assert [chunk.more for chunk in chunks] == [True, True, False]
    # The reference's rule: scale the object counts by limit / rejected length (at most 0.9).
    whole = api.SynchronizeRequest(pods=world.pods, containers=world.containers)
    rejected = len(
        encode_request(
            "nri.pkg.api.v1alpha1.Plugin",
            "Synchronize",
            whole.SerializeToString(),
            timeout_nano=2_000_000_000,
        )
    )
    factor = min(MAX_MESSAGE_LENGTH / rejected, 0.9)
    pods, ctrs = int(100 * factor), int(20 * factor)
    assert (pods, ctrs) == (41, 8)  # the numbers the rule gives for this data
    assert [len(chunk.pods) for chunk in chunks] == [pods, pods, 100 - 2 * pods]
    assert [len(chunk.containers) for chunk in chunks] == [ctrs, ctrs, 20 - 2 * ctrs]
    assert all(chunk.ByteSize() < MAX_MESSAGE_LENGTH for chunk in chunks)
    assert [p.id for chunk in chunks for p in chunk.pods] == [p.id for p in world.pods]
    assert [c.id for chunk in chunks for c in chunk.containers] == [c.id for c in world.containers]


async def test_plugin_that_cannot_take_split_sync_is_closed(
    make_runtime: Any, peers: list[Peer], world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.pods = [
        api.PodSandbox(id=f"pod{i:03d}", annotations={"blob": "x" * BIG_ANNOTATION})
        for i in range(50)
    ]
    adaptation = await make_runtime()
    peer = Peer("oldsync", "10", replies={"Synchronize": lambda request: api.SynchronizeResponse()})
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await peer.register()
        await peer.wait_closed()
    assert names(adaptation) == []
    assert len(peer.received("Synchronize")) == 1  # the first chunk, answered wrongly
    assert "plugin does not handle split sync requests" in caplog.text


async def test_no_event_is_missed_while_a_plugin_synchronizes(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    release = asyncio.Event()
    peer = Peer("late", "10", events=bit(api.RUN_POD_SANDBOX), hold={"Synchronize": release})
    peers.append(peer)
    await peer.connect(adaptation.config.socket_path)
    await peer.register()
    await peer.wait_for("Synchronize")  # held by the plugin from here on
    event = asyncio.get_running_loop().create_task(adaptation.run_pod_sandbox(POD))
    await asyncio.sleep(0.1)
    assert not event.done()  # the event waits for the synchronization to finish
    release.set()
    async with asyncio.timeout(WAIT_SECONDS):
        await event
    assert [method for _, method in peer.journal] == [
        "Configure",
        "Synchronize",
        "RunPodSandbox",
    ]
    assert names(adaptation) == ["10-late"]


# ----------------------------------------------------------------------------- fan-out


async def test_events_go_in_index_order_to_subscribers_only(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    journal: list[tuple[str, str]] = []
    run, stop = bit(api.RUN_POD_SANDBOX), bit(api.STOP_POD_SANDBOX)
    # Registered out of order; the index string decides, then the name.
    await join(adaptation, peers, Peer("c", "30", events=0, journal=journal))
    await join(adaptation, peers, Peer("b", "20", events=stop, journal=journal))
    await join(adaptation, peers, Peer("z", "10", events=run | stop, journal=journal))
    await join(adaptation, peers, Peer("a", "10", events=run, journal=journal))
    assert names(adaptation) == ["10-a", "10-z", "20-b", "30-c"]
    journal.clear()

    await adaptation.run_pod_sandbox(POD)
    assert journal == [
        ("10-a", "RunPodSandbox"),
        ("10-z", "RunPodSandbox"),
        ("30-c", "RunPodSandbox"),
    ]
    journal.clear()
    await adaptation.stop_pod_sandbox(POD)
    assert journal == [
        ("10-z", "StopPodSandbox"),
        ("20-b", "StopPodSandbox"),
        ("30-c", "StopPodSandbox"),
    ]
    (request,) = peers[0].received("RunPodSandbox")
    assert request.pod == POD


async def test_every_event_reaches_a_plugin_subscribed_to_all(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    peer = await join(adaptation, peers, Peer("all", "10", events=0))
    peer.journal.clear()
    resources = api.LinuxResources(cpu=api.LinuxCPU(cpus="0"))
    await adaptation.run_pod_sandbox(POD)
    await adaptation.update_pod_sandbox(POD, resources, resources)
    await adaptation.post_update_pod_sandbox(POD)
    assert await adaptation.pod_sandbox_status(POD) == ("", [])
    await adaptation.create_container(POD, CONTAINER)
    await adaptation.post_create_container(POD, CONTAINER)
    await adaptation.start_container(POD, CONTAINER)
    await adaptation.post_start_container(POD, CONTAINER)
    await adaptation.update_container(POD, CONTAINER, resources)
    await adaptation.post_update_container(POD, CONTAINER)
    await adaptation.stop_container(POD, CONTAINER)
    await adaptation.remove_container(POD, CONTAINER)
    await adaptation.stop_pod_sandbox(POD)
    await adaptation.remove_pod_sandbox(POD)
    assert [method for _, method in peer.journal] == [
        "RunPodSandbox",
        "UpdatePodSandbox",
        "PostUpdatePodSandbox",
        "PodSandboxStatus",
        "CreateContainer",
        "ValidateContainerAdjustment",  # mask 0 includes the validator bit
        "PostCreateContainer",
        "StartContainer",
        "PostStartContainer",
        "UpdateContainer",
        "PostUpdateContainer",
        "StopContainer",
        "RemoveContainer",
        "StopPodSandbox",
        "RemovePodSandbox",
    ]
    (update,) = peer.received("UpdateContainer")
    assert (update.pod, update.container, update.linux_resources) == (POD, CONTAINER, resources)
    (update_pod,) = peer.received("UpdatePodSandbox")
    assert update_pod.overhead_linux_resources == resources
    (stop,) = peer.received("StopContainer")
    assert (stop.pod, stop.container) == (POD, CONTAINER)


async def test_unimplemented_event_rpc_falls_back_to_state_change(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime()
    # A plugin built with a pre-v0.12 stub: no dedicated RPCs for these events.
    old_style = {
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "PostUpdatePodSandbox",
        "PostCreateContainer",
        "StartContainer",
        "PostStartContainer",
        "PostUpdateContainer",
        "RemoveContainer",
        "PodSandboxStatus",
        "ValidateContainerAdjustment",
    }
    peer = await join(adaptation, peers, Peer("old", "10", events=0, missing=old_style))
    with caplog.at_level(logging.INFO, logger="podgate.nri.adaptation"):
        await adaptation.run_pod_sandbox(POD)
        await adaptation.start_container(POD, CONTAINER)
        await adaptation.remove_container(POD, CONTAINER)
        assert await adaptation.pod_sandbox_status(POD) == ("", [])
        await adaptation.create_container(POD, CONTAINER)  # validation: UNIMPLEMENTED = accept
    changes = peer.received("StateChange")
    assert [(c.event, c.pod, c.HasField("container")) for c in changes] == [
        (api.RUN_POD_SANDBOX, POD, False),
        (api.START_CONTAINER, POD, True),
        (api.REMOVE_CONTAINER, POD, True),
    ]
    assert changes[1].container == CONTAINER
    assert "plugin 10-old has no RunPodSandbox RPC; using the deprecated StateChange" in (
        caplog.text
    )


async def test_unimplemented_without_state_change_form_fails(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    await join(adaptation, peers, Peer("odd", "10", events=0, missing={"CreateContainer"}))
    with pytest.raises(NriError) as info:
        await adaptation.create_container(POD, CONTAINER)
    assert str(info.value) == (
        "plugin 10-odd failed CreateContainer: UNIMPLEMENTED: method CreateContainer"
    )


# ----------------------------------------------------------------------------- failures


async def test_a_plugin_that_never_answers_is_dropped(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime(request_timeout=SHORT_TIMEOUT)
    journal: list[tuple[str, str]] = []
    slow = await join(
        adaptation, peers, Peer("slow", "10", hang={"RunPodSandbox"}, journal=journal)
    )
    fast = await join(adaptation, peers, Peer("fast", "20", journal=journal))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await adaptation.run_pod_sandbox(POD)  # completes, without the slow plugin's answer
    elapsed = loop.time() - started
    assert SHORT_TIMEOUT * 0.9 <= elapsed < SHORT_TIMEOUT + 15  # generous under load
    assert fast.received("RunPodSandbox") == [api.RunPodSandboxRequest(pod=POD)]
    assert names(adaptation) == ["20-fast"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["nri: dropping plugin 10-slow: RunPodSandbox: no answer within 0.3 s"]
    await slow.wait_closed()
    # Later events go on without it.
    await adaptation.start_container(POD, CONTAINER)
    assert journal[-1] == ("20-fast", "StartContainer")


async def test_plugin_error_fails_the_event(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    journal: list[tuple[str, str]] = []
    await join(
        adaptation,
        peers,
        Peer(
            "bad",
            "10",
            journal=journal,
            fail={"RunPodSandbox": TtrpcError(Code.FAILED_PRECONDITION, "no room")},
        ),
    )
    later = await join(adaptation, peers, Peer("later", "20", journal=journal))
    with pytest.raises(NriError) as info:
        await adaptation.run_pod_sandbox(POD)
    assert str(info.value) == "plugin 10-bad failed RunPodSandbox: FAILED_PRECONDITION: no room"
    assert later.received("RunPodSandbox") == []  # the event stopped at the failure
    assert names(adaptation) == ["10-bad", "20-later"]  # an error is not a reason to drop


async def test_stop_pod_sandbox_errors_are_only_logged(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime()
    await join(
        adaptation,
        peers,
        Peer("bad", "10", fail={"StopPodSandbox": TtrpcError(Code.INTERNAL, "teardown failed")}),
    )
    later = await join(adaptation, peers, Peer("later", "20"))
    with caplog.at_level(logging.ERROR, logger="podgate.nri.adaptation"):
        await adaptation.stop_pod_sandbox(POD)
    assert later.received("StopPodSandbox") == [api.StopPodSandboxRequest(pod=POD)]
    assert "plugin 10-bad failed StopPodSandbox: INTERNAL: teardown failed" in caplog.text


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"\x00\x00\x00\x00\x00\x00\x00\x04junk", id="mux-reserved-conn"),
        pytest.param(b"\xff\xff\xff\xff\xff\xff\xff\xff", id="mux-oversized-frame"),
        # A frame for ConnID 2 holding a ttrpc header whose length has the reserved high
        # byte set: fatal for the runtime's ttrpc server on that connection.
        pytest.param(
            struct.pack(">II", 2, 10) + struct.pack(">IIBB", 0x7F000000, 1, 1, 0),
            id="ttrpc-garbage",
        ),
    ],
)
async def test_a_plugin_sending_garbage_is_disconnected(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    adaptation = await make_runtime()
    bad = await join(adaptation, peers, Peer("bad", "10"))
    good = await join(adaptation, peers, Peer("good", "20"))
    assert bad.stream is not None
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        bad.stream.write(garbage)
        await bad.wait_closed()
        await until(lambda: names(adaptation) == ["20-good"])
    assert "nri: dropping plugin 10-bad: connection closed" in caplog.text
    await adaptation.run_pod_sandbox(POD)
    assert good.received("RunPodSandbox") == [api.RunPodSandboxRequest(pod=POD)]
    assert bad.received("RunPodSandbox") == []


async def test_a_plugin_that_disconnects_is_dropped(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    gone = await join(adaptation, peers, Peer("gone", "10"))
    await gone.aclose()
    await until(lambda: names(adaptation) == [])
    await adaptation.run_pod_sandbox(POD)  # nobody left to ask


async def test_stop_closes_every_plugin(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    first = await join(adaptation, peers, Peer("a", "10"))
    second = await join(adaptation, peers, Peer("b", "20"))
    await adaptation.stop()
    await first.wait_closed()
    await second.wait_closed()
    assert adaptation.plugins == []


# ----------------------------------------------------------------------------- CreateContainer


def adjust_reply(adjust: api.ContainerAdjustment) -> Callable[[Any], Any]:
    return lambda request: api.CreateContainerResponse(adjust=adjust)


async def test_adjustments_are_merged_in_order(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    create = bit(api.CREATE_CONTAINER)
    await join(
        adaptation,
        peers,
        Peer(
            "env",
            "10",
            events=create,
            replies={
                "CreateContainer": adjust_reply(
                    api.ContainerAdjustment(env=[api.KeyValue(key="FOO", value="1")])
                )
            },
        ),
    )
    second = await join(
        adaptation,
        peers,
        Peer(
            "notes",
            "20",
            events=create,
            replies={
                "CreateContainer": adjust_reply(
                    api.ContainerAdjustment(
                        annotations={"seen": "yes"}, env=[api.KeyValue(key="BAR", value="2")]
                    )
                )
            },
        ),
    )
    adjust = (await adaptation.create_container(POD, CONTAINER)).adjust
    assert [(kv.key, kv.value) for kv in adjust.env] == [("FOO", "1"), ("BAR", "2")]
    assert dict(adjust.annotations) == {"seen": "yes"}
    # The second plugin saw the first one's change.
    (request,) = second.received("CreateContainer")
    assert list(request.container.env) == ["PATH=/bin", "FOO=1"]


async def test_conflicting_adjustments_fail_creation(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    foo = adjust_reply(api.ContainerAdjustment(env=[api.KeyValue(key="FOO", value="x")]))
    create = bit(api.CREATE_CONTAINER)
    await join(adaptation, peers, Peer("a", "10", events=create, replies={"CreateContainer": foo}))
    await join(adaptation, peers, Peer("b", "20", events=create, replies={"CreateContainer": foo}))
    with pytest.raises(ConflictError) as info:
        await adaptation.create_container(POD, CONTAINER)
    assert str(info.value) == 'plugins "20-b" and "10-a" both tried to set Env FOO'


async def test_validator_sees_owners_and_can_reject(make_runtime: Any, peers: list[Peer]) -> None:
    adaptation = await make_runtime()
    await join(
        adaptation,
        peers,
        Peer(
            "env",
            "10",
            events=bit(api.CREATE_CONTAINER),
            replies={
                "CreateContainer": adjust_reply(
                    api.ContainerAdjustment(env=[api.KeyValue(key="FOO", value="1")])
                )
            },
        ),
    )
    verdict = {"reject": True}
    validator = await join(
        adaptation,
        peers,
        Peer(
            "policy",
            "90",
            events=bit(api.VALIDATE_CONTAINER_ADJUSTMENT),
            replies={
                "ValidateContainerAdjustment": lambda request: (
                    api.ValidateContainerAdjustmentResponse(
                        reject=verdict["reject"], reason="FOO is not allowed"
                    )
                )
            },
        ),
    )
    with pytest.raises(NriError) as info:
        await adaptation.create_container(POD, CONTAINER)
    assert str(info.value) == (
        'validator "90-policy" rejected container adjustment, reason: FOO is not allowed'
    )
    (request,) = validator.received("ValidateContainerAdjustment")
    assert request.container == CONTAINER  # pristine, as it was asked for
    assert [(kv.key, kv.value) for kv in request.adjust.env] == [("FOO", "1")]
    assert dict(request.owners.owners["ctr1"].compound[6].owners) == {"FOO": "10-env"}
    assert [(p.index, p.name) for p in request.plugins] == [("10", "env"), ("90", "policy")]

    verdict["reject"] = False
    adjust = (await adaptation.create_container(POD, CONTAINER)).adjust
    assert [(kv.key, kv.value) for kv in adjust.env] == [("FOO", "1")]


# ----------------------------------------------------------------------------- PodSandboxStatus


async def test_pod_sandbox_status_aggregates_in_plugin_order(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    status = bit(api.POD_SANDBOX_STATUS)

    def answer(ip: str, *additional: str) -> dict[str, Callable[[Any], Any]]:
        reply = api.PodSandboxStatusResponse(ip=ip, additional_ips=list(additional))
        return {"PodSandboxStatus": lambda request: reply}

    second = await join(
        adaptation,
        peers,
        Peer("v6", "20", events=status, replies=answer("192.0.2.9", "2001:db8::5", "192.0.2.7")),
    )
    await join(
        adaptation,
        peers,
        Peer("v4", "10", events=status, replies=answer("192.0.2.5", "2001:db8::5")),
    )
    await join(adaptation, peers, Peer("quiet", "30", events=status))
    await join(adaptation, peers, Peer("other", "05", events=bit(api.RUN_POD_SANDBOX)))
    assert await adaptation.pod_sandbox_status(POD) == (
        "192.0.2.5",
        ["2001:db8::5", "192.0.2.9", "192.0.2.7"],
    )
    assert second.received("PodSandboxStatus") == [api.PodSandboxStatusRequest(pod=POD)]


async def test_pod_sandbox_status_error_fails_the_call(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    await join(
        adaptation,
        peers,
        Peer(
            "ipam",
            "10",
            events=bit(api.POD_SANDBOX_STATUS),
            fail={"PodSandboxStatus": TtrpcError(Code.NOT_FOUND, "no such pod")},
        ),
    )
    with pytest.raises(NriError) as info:
        await adaptation.pod_sandbox_status(POD)
    assert str(info.value) == "plugin 10-ipam failed PodSandboxStatus: NOT_FOUND: no such pod"


async def test_disabled_adaptation_does_nothing(make_runtime: Any, short_dir: str) -> None:
    adaptation = await make_runtime(enabled=False)
    assert not os.path.exists(adaptation.config.socket_path)
    await adaptation.run_pod_sandbox(POD)
    assert (await adaptation.create_container(POD, CONTAINER)).adjust == api.ContainerAdjustment()


async def test_disable_connections_means_no_listener(make_runtime: Any) -> None:
    adaptation = await make_runtime(disable_connections=True)
    assert not os.path.exists(adaptation.config.socket_path)


# ----------------------------------------------------------------------------- the SDK


async def test_a_plugin_built_with_the_sdk_works_end_to_end(make_runtime: Any) -> None:
    from podgate.nri.plugin import Plugin, Stub

    seen: list[str] = []

    class Tagger(Plugin):
        name, index = "tagger", "40"

        async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
            seen.append(pod.id)

        async def create_container(self, pod: api.PodSandbox, container: api.Container) -> Any:
            return api.ContainerAdjustment(annotations={"tagged-by": "tagger"})

        async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]]:
            return "192.0.2.40", ["2001:db8::40"]

    adaptation = await make_runtime()
    stub = Stub(Tagger(), socket_path=adaptation.config.socket_path, reconnect=False)
    task = asyncio.get_running_loop().create_task(stub.run())
    try:
        await until(lambda: names(adaptation) == ["40-tagger"])
        assert adaptation.plugins[0].events == bit(
            api.RUN_POD_SANDBOX, api.CREATE_CONTAINER, api.POD_SANDBOX_STATUS
        )
        await adaptation.run_pod_sandbox(POD)
        adjust = (await adaptation.create_container(POD, CONTAINER)).adjust
        assert dict(adjust.annotations) == {"tagged-by": "tagger"}
        assert await adaptation.pod_sandbox_status(POD) == ("192.0.2.40", ["2001:db8::40"])
        assert seen == ["pod1"]
        await adaptation.stop()
        async with asyncio.timeout(WAIT_SECONDS):
            await task  # the runtime went away: a non-reconnecting stub returns
    finally:
        task.cancel()
        await asyncio.wait([task])


# ----------------------------------------------------------------------------- updates


def update_of(container_id: str, *, ignore_failure: bool = False) -> api.ContainerUpdate:
    return api.ContainerUpdate(
        container_id=container_id,
        ignore_failure=ignore_failure,
        linux=api.LinuxContainerUpdate(
            resources=api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))
        ),
    )


async def test_updates_asked_on_create_fail_it_when_the_runtime_cannot_update(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(update=[update_of("old")])}
    await join(adaptation, peers, Peer("updater", "10", events=0, replies=replies))
    with pytest.raises(UpdatesNotSupportedError) as info:
        await adaptation.create_container(POD, CONTAINER)
    assert str(info.value) == (
        "CreateContainer: container updates are not supported by this runtime"
    )


async def test_updates_that_may_fail_do_not_fail_create(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime()
    soft = update_of("old", ignore_failure=True)
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(update=[soft])}
    await join(adaptation, peers, Peer("updater", "10", events=0, replies=replies))
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await adaptation.create_container(POD, CONTAINER)
    assert "ignoring 1 container updates on CreateContainer" in caplog.text


async def test_updates_asked_on_create_reach_validators_then_the_runtime(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    handler = RecordingUpdates()
    adaptation.update_handler = handler
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(update=[update_of("old")])}
    await join(
        adaptation, peers, Peer("updater", "10", events=bit(api.CREATE_CONTAINER), replies=replies)
    )
    validator = await join(
        adaptation,
        peers,
        Peer("validator", "20", events=bit(api.VALIDATE_CONTAINER_ADJUSTMENT)),
    )
    await adaptation.create_container(POD, CONTAINER)
    [request] = validator.received("ValidateContainerAdjustment")
    assert [u.container_id for u in request.update] == ["old"]
    assert request.owners.owners["old"].simple[api.CPUQuota] == "10-updater"
    assert [[u.container_id for u in batch] for batch in handler.updates] == [["old"]]


async def test_a_plugin_may_not_update_the_container_being_created(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    replies = {
        "CreateContainer": lambda r: api.CreateContainerResponse(update=[update_of(r.container.id)])
    }
    await join(adaptation, peers, Peer("updater", "10", events=0, replies=replies))
    with pytest.raises(
        NriError, match='plugin "10-updater" asked update of "ctr1" during creation'
    ):
        await adaptation.create_container(POD, CONTAINER)


async def test_update_container_merges_the_request_with_plugins_updates(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    limit = api.LinuxResources(memory=api.LinuxMemory(limit=api.OptionalInt64(value=1 << 20)))
    replies = {
        "UpdateContainer": lambda r: api.UpdateContainerResponse(
            update=[
                api.ContainerUpdate(
                    container_id=r.container.id, linux=api.LinuxContainerUpdate(resources=limit)
                ),
                update_of("other"),
            ]
        )
    }
    peer = await join(adaptation, peers, Peer("updater", "10", events=0, replies=replies))
    quota = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=7000)))
    updates = await adaptation.update_container(POD, CONTAINER, quota)
    [request] = peer.received("UpdateContainer")
    assert request.linux_resources == quota
    assert [u.container_id for u in updates] == ["ctr1", "other"]
    assert updates[0].linux.resources.cpu.quota.value == 7000  # the runtime's request
    assert updates[0].linux.resources.memory.limit.value == 1 << 20  # the plugin's addition


# ----------------------------------------------------------------------------- pod IPs


async def test_plugins_after_the_network_plugin_see_the_ips_at_run_pod_sandbox(
    make_runtime: Any, peers: list[Peer]
) -> None:
    """As containerd, which runs CNI before NRI's RunPodSandbox: a network plugin's IPs are
    in the pod every later plugin gets (network-logger would print them)."""
    adaptation = await make_runtime()
    run = bit(api.RUN_POD_SANDBOX)
    status = {"PodSandboxStatus": lambda _: api.PodSandboxStatusResponse(ip="10.88.0.5")}
    early = await join(adaptation, peers, Peer("early", "05", events=run))
    await join(
        adaptation,
        peers,
        Peer("net", "10", events=run | bit(api.POD_SANDBOX_STATUS), replies=status),
    )
    late = await join(adaptation, peers, Peer("netlogger", "20", events=run))
    pod = api.PodSandbox(id="pod9", name="web")
    assert await adaptation.run_pod_sandbox(pod, network=True) == ("10.88.0.5", [])
    assert [list(p.pod.ips) for p in early.received("RunPodSandbox")] == [[]]
    assert [list(p.pod.ips) for p in late.received("RunPodSandbox")] == [["10.88.0.5"]]
    assert list(pod.ips) == []  # the caller's message is left alone
    # Without NRI networking every plugin gets the pod as the runtime made it.
    await adaptation.run_pod_sandbox(POD)
    assert list(late.received("RunPodSandbox")[1].pod.ips) == ["192.0.2.1"]


async def test_evictions_asked_on_create_fail_it_when_the_runtime_cannot_evict(
    make_runtime: Any, peers: list[Peer]
) -> None:
    adaptation = await make_runtime()
    evict = [api.ContainerEviction(container_id="old", reason="make room")]
    replies = {"CreateContainer": lambda _: api.CreateContainerResponse(evict=evict)}
    await join(adaptation, peers, Peer("evictor", "10", events=0, replies=replies))
    with pytest.raises(UpdatesNotSupportedError, match="container eviction is not supported"):
        await adaptation.create_container(POD, CONTAINER)


async def test_a_plugin_whose_sync_asks_for_updates_is_refused_with_the_reason(
    make_runtime: Any, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    adaptation = await make_runtime()
    replies = {"Synchronize": lambda _: api.SynchronizeResponse(update=[update_of("ctr1")])}
    peer = Peer("syncer", "10", replies=replies)
    peers.append(peer)
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await peer.connect(adaptation.config.socket_path)
        await peer.register()
        await peer.wait_closed()
    assert names(adaptation) == []
    assert "container updates are not supported by this runtime" in caplog.text
