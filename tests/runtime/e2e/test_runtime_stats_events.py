"""Pod sandbox stats and container events from a real `podgate runtime` daemon.

Stats are the kernel's: a container spinning in a loop grows the pod cgroup's CPU time, and
traffic sent inside the pod's network namespace (over a veth the test puts there, and over its
loopback) grows the interfaces' counters. Events arrive in lifecycle order on every stream, a
subscriber that never reads is dropped without holding up the runtime, and a daemon shutting
down ends the streams cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from runtime_e2e_support import (
    POD_NAMESPACE,
    POLL_SECONDS,
    WAIT_SECONDS,
    Pod,
    Pods,
    RuntimeDaemon,
    channel_options,
)

from busybox_rootfs import make_rootfs
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.runtime.events import SUBSCRIBER_QUEUE_EVENTS

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

EXEC_TIMEOUT = 30
# Pings sent each way; the counters must grow by at least their bytes.
PINGS = 3
# An ICMP echo of busybox ping (56 data bytes) on Ethernet: 98 bytes per frame.
PING_FRAME_BYTES = 98
CREATED, STARTED, STOPPED, DELETED = (
    pb.CONTAINER_CREATED_EVENT,
    pb.CONTAINER_STARTED_EVENT,
    pb.CONTAINER_STOPPED_EVENT,
    pb.CONTAINER_DELETED_EVENT,
)
# Containers made and removed while one subscriber never reads: three events each (removal
# stops a created container first: podgate records it as exited), enough to overflow its queue
# and what the transport buffers before it.
FLOOD_EVENTS = (CREATED, STOPPED, DELETED)
FLOOD_CONTAINERS = SUBSCRIBER_QUEUE_EVENTS // len(FLOOD_EVENTS) + 100
# The never-reading client's HTTP/2 window: tiny, so the daemon's queue holds the rest.
SMALL_WINDOW_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    yield str(make_rootfs(tmp_path_factory.mktemp("busybox") / "root"))


async def run_pod(cri: pb_grpc.RuntimeServiceStub, pods: Pods, name: str, **labels: str) -> Pod:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=POD_NAMESPACE, uid=os.urandom(8).hex()),
        labels=labels,
    )
    response = await cri.RunPodSandbox(pb.RunPodSandboxRequest(config=config))
    pods.created.append(response.pod_sandbox_id)
    return Pod(response.pod_sandbox_id, config)


async def container(
    cri: pb_grpc.RuntimeServiceStub, pod: Pod, rootfs: str, name: str, command: list[str]
) -> str:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=rootfs), command=command
    )
    response = await cri.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config)
    )
    await cri.StartContainer(pb.StartContainerRequest(container_id=response.container_id))
    return response.container_id


async def ok(cri: pb_grpc.RuntimeServiceStub, container_id: str, *cmd: str) -> str:
    response = await cri.ExecSync(
        pb.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=EXEC_TIMEOUT)
    )
    assert (response.exit_code, response.stderr) == (0, b""), response
    return response.stdout.decode()


async def pod_stats(cri: pb_grpc.RuntimeServiceStub, pod_id: str) -> pb.PodSandboxStats:
    return (await cri.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id=pod_id))).stats


async def pod_pid(cri: pb_grpc.RuntimeServiceStub, pod_id: str) -> int:
    status = await cri.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True)
    )
    return int(json.loads(status.info["info"])["pid"])


def ip(*args: str, netns_pid: int | None = None) -> None:
    prefix = ["nsenter", f"--net=/proc/{netns_pid}/ns/net"] if netns_pid else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def veth_into() -> Iterator[list[str]]:
    """Names of host-side veth ends made by the test; each is deleted (with its peer)."""
    made: list[str] = []
    yield made
    for name in made:
        # Gone already when the pod's netns went first (a veth pair dies with either end).
        subprocess.run(["ip", "link", "del", name], check=False, capture_output=True, timeout=30)


def interfaces(stats: pb.PodSandboxStats) -> dict[str, pb.NetworkInterfaceUsage]:
    network = stats.linux.network
    found = {i.name: i for i in network.interfaces}
    if network.HasField("default_interface"):
        found[network.default_interface.name] = network.default_interface
    return found


async def test_pod_sandbox_stats_are_the_kernels(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, veth_into: list[str]
) -> None:
    pod = await run_pod(cri, pods, "stats-pod", tier="stats")
    other = await run_pod(cri, pods, "stats-other", tier="other")
    spin = await container(cri, pod, rootfs, "spin", ["sh", "-c", "while :; do :; done"])
    idle = await container(cri, pod, rootfs, "idle", ["sleep", "1000"])

    # A veth into the pod's netns, named as a CNI plugin names it, with a /30 of its own.
    pid = await pod_pid(cri, pod.id)
    host_end = f"pgs{secrets.token_hex(4)}"
    veth_into.append(host_end)
    net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}.{random.randrange(64) * 4}"
    base = net.rsplit(".", 1)
    host_ip, pod_ip = f"{base[0]}.{int(base[1]) + 1}", f"{base[0]}.{int(base[1]) + 2}"
    ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", str(pid))
    ip("addr", "add", f"{host_ip}/30", "dev", host_end)
    ip("link", "set", host_end, "up")
    ip("addr", "add", f"{pod_ip}/30", "dev", "eth0", netns_pid=pid)
    ip("link", "set", "eth0", "up", netns_pid=pid)

    first = await pod_stats(cri, pod.id)
    assert first.attributes.id == pod.id
    assert first.attributes.metadata.name == "stats-pod"
    assert dict(first.attributes.labels) == {"tier": "stats"}
    linux = first.linux
    assert linux.cpu.timestamp > 0 and linux.memory.timestamp > 0
    assert linux.memory.working_set_bytes.value > 0
    assert linux.memory.usage_bytes.value >= linux.memory.working_set_bytes.value
    assert linux.process.process_count.value >= 2  # the spinning sh and sleep, at least
    assert {c.attributes.id for c in linux.containers} == {spin, idle}
    assert linux.network.default_interface.name == "eth0"
    assert "lo" in {i.name for i in linux.network.interfaces}
    before = interfaces(first)

    # Traffic inside the pod's netns: over eth0 to the host end, and over its loopback.
    await ok(cri, idle, "ping", "-c", str(PINGS), "-i", "0.2", host_ip)
    await ok(cri, idle, "ping", "-c", str(PINGS), "-i", "0.2", "127.0.0.1")

    # The spinning container keeps adding CPU time; wait (bounded) until a sample shows it.
    async with asyncio.timeout(WAIT_SECONDS):
        while True:
            second = await pod_stats(cri, pod.id)
            if (
                second.linux.cpu.usage_core_nano_seconds.value
                > linux.cpu.usage_core_nano_seconds.value
            ):
                break
            await asyncio.sleep(POLL_SECONDS)
    assert second.linux.cpu.HasField("usage_nano_cores")  # a rate needs two samples
    spin_before = {c.attributes.id: c for c in linux.containers}[spin]
    spin_after = {c.attributes.id: c for c in second.linux.containers}[spin]
    assert (
        spin_after.cpu.usage_core_nano_seconds.value > spin_before.cpu.usage_core_nano_seconds.value
    )
    # The pod cgroup holds its containers: at least the spinning one's time.
    assert (
        second.linux.cpu.usage_core_nano_seconds.value
        >= spin_after.cpu.usage_core_nano_seconds.value
    )
    after = interfaces(second)
    for name in ("eth0", "lo"):
        grown_rx = after[name].rx_bytes.value - before[name].rx_bytes.value
        grown_tx = after[name].tx_bytes.value - before[name].tx_bytes.value
        assert grown_rx >= PINGS * PING_FRAME_BYTES, (name, grown_rx)
        assert grown_tx >= PINGS * PING_FRAME_BYTES, (name, grown_tx)

    # ListPodSandboxStats: by id (a prefix, as other filters), by labels, all.
    by_id = await cri.ListPodSandboxStats(
        pb.ListPodSandboxStatsRequest(filter=pb.PodSandboxStatsFilter(id=pod.id[:12]))
    )
    assert [s.attributes.id for s in by_id.stats] == [pod.id]
    by_label = await cri.ListPodSandboxStats(
        pb.ListPodSandboxStatsRequest(
            filter=pb.PodSandboxStatsFilter(label_selector={"tier": "other"})
        )
    )
    assert [s.attributes.id for s in by_label.stats] == [other.id]
    none = await cri.ListPodSandboxStats(
        pb.ListPodSandboxStatsRequest(
            filter=pb.PodSandboxStatsFilter(label_selector={"tier": "nothing"})
        )
    )
    assert list(none.stats) == []
    every = await cri.ListPodSandboxStats(pb.ListPodSandboxStatsRequest())
    assert {pod.id, other.id} <= {s.attributes.id for s in every.stats}


async def test_unknown_pod_has_no_stats(cri: pb_grpc.RuntimeServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cri.PodSandboxStats(pb.PodSandboxStatsRequest(pod_sandbox_id="0" * 64))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------- events


async def subscribe(
    stub: pb_grpc.RuntimeServiceStub,
) -> grpc.aio.UnaryStreamCall[pb.GetEventsRequest, pb.ContainerEventResponse]:
    """A GetContainerEvents stream that is subscribed once this returns (its headers came)."""
    call = stub.GetContainerEvents(pb.GetEventsRequest(), timeout=None)
    await call.initial_metadata()
    return call


async def collect(
    call: grpc.aio.UnaryStreamCall[pb.GetEventsRequest, pb.ContainerEventResponse],
    ids: set[str],
    count: int,
) -> list[pb.ContainerEventResponse]:
    """The next `count` events about `ids` (others are skipped), bounded in time."""
    found: list[pb.ContainerEventResponse] = []
    async with asyncio.timeout(WAIT_SECONDS * 4):
        while len(found) < count:
            event = await call.read()
            assert event is not grpc.aio.EOF, f"stream ended after {found}"
            assert isinstance(event, pb.ContainerEventResponse)
            if event.container_id in ids:
                found.append(event)
    return found


@pytest.fixture
async def two_subscribers(
    runtime_daemon: RuntimeDaemon,
) -> AsyncIterator[list[grpc.aio.UnaryStreamCall[pb.GetEventsRequest, pb.ContainerEventResponse]]]:
    async with runtime_daemon.connect() as first, runtime_daemon.connect() as second:
        calls = [await subscribe(first), await subscribe(second)]
        yield calls
        for call in calls:
            call.cancel()


async def test_events_arrive_in_order_on_every_stream(
    cri: pb_grpc.RuntimeServiceStub,
    pods: Pods,
    rootfs: str,
    two_subscribers: list[grpc.aio.UnaryStreamCall[pb.GetEventsRequest, pb.ContainerEventResponse]],
) -> None:
    pod = await run_pod(cri, pods, "events")
    cid = await container(cri, pod, rootfs, "main", ["sleep", "1000"])
    await cri.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0))
    # One that exits by itself: nobody asks about it, yet STOPPED comes, with its exit code,
    # before anything else happens (the 8th event: pod 2, main 3, this one 3).
    exits = await container(cri, pod, rootfs, "exits", ["sh", "-c", "exit 3"])
    ids = {pod.id, cid, exits}
    first = await collect(two_subscribers[0], ids, 8)
    assert (first[-1].container_id, first[-1].container_event_type) == (exits, STOPPED)
    await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    await cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
    await cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))

    expected_pod = [CREATED, STARTED, STOPPED, DELETED]
    expected_main = [CREATED, STARTED, STOPPED, DELETED]
    expected_exits = [CREATED, STARTED, STOPPED, DELETED]  # removed with the pod
    total = len(expected_pod) + len(expected_main) + len(expected_exits)
    streams = [
        first + await collect(two_subscribers[0], ids, total - len(first)),
        await collect(two_subscribers[1], ids, total),
    ]
    assert [e.SerializeToString() for e in streams[0]] == [
        e.SerializeToString() for e in streams[1]
    ]
    events = streams[0]
    by_id = {key: [e for e in events if e.container_id == key] for key in (pod.id, cid, exits)}
    assert [e.container_event_type for e in by_id[pod.id]] == expected_pod
    assert [e.container_event_type for e in by_id[cid]] == expected_main
    assert [e.container_event_type for e in by_id[exits]] == expected_exits
    assert [e.created_at for e in events] == sorted(e.created_at for e in events)
    # The pod's lifecycle brackets its containers'.
    assert events[0].container_id == pod.id and events[-1].container_id == pod.id

    def state_of(event: pb.ContainerEventResponse, key: str) -> int | None:
        states = {s.id: s.state for s in event.containers_statuses}
        return states.get(key)

    created, started, stopped, deleted = by_id[cid]
    for event in (created, started, stopped, deleted):
        assert event.pod_sandbox_status.id == pod.id
        assert event.pod_sandbox_status.metadata.name == "events"
    assert created.pod_sandbox_status.state == pb.SANDBOX_READY
    assert state_of(created, cid) == pb.CONTAINER_CREATED
    assert state_of(started, cid) == pb.CONTAINER_RUNNING
    assert state_of(stopped, cid) == pb.CONTAINER_EXITED
    assert state_of(deleted, cid) is None  # gone from the pod's containers
    exit_stopped = by_id[exits][2]
    [status] = [s for s in exit_stopped.containers_statuses if s.id == exits]
    assert (status.state, status.exit_code) == (pb.CONTAINER_EXITED, 3)
    assert by_id[pod.id][2].pod_sandbox_status.state == pb.SANDBOX_NOTREADY


async def test_a_subscriber_that_never_reads_is_dropped_not_waited_for(
    runtime_daemon: RuntimeDaemon, cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    pod = await pods.run("events-flood")
    options = [*channel_options(), *SMALL_WINDOW_OPTIONS]
    async with grpc.aio.insecure_channel(runtime_daemon.cri_target, options=options) as slow_ch:
        slow = await subscribe(pb_grpc.RuntimeServiceStub(slow_ch))
        async with runtime_daemon.connect() as reader_stub:
            reader = await subscribe(reader_stub)
            made = []
            for n in range(FLOOD_CONTAINERS):
                cid = await pods.create(pod, f"flood-{n}", ["true"], start=False)
                await cri.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
                made.append(cid)
            # The reader saw every event, in order, although the other stream never moved.
            events = await collect(reader, set(made), len(FLOOD_EVENTS) * len(made))
            assert [(e.container_id, e.container_event_type) for e in events] == [
                (cid, kind) for cid in made for kind in FLOOD_EVENTS
            ]
            reader.cancel()
        # The slow stream: what the transport held, then RESOURCE_EXHAUSTED.
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(WAIT_SECONDS * 4):
                async for _ in slow:
                    received += 1
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "relist" in (caught.value.details() or "")
        assert received < len(FLOOD_EVENTS) * len(made)
    log = Path(runtime_daemon.output).read_text(errors="replace")
    assert "container event subscriber dropped" in log


async def test_event_streams_end_cleanly_when_the_daemon_stops(
    fresh_daemon: RuntimeDaemon,
) -> None:
    async with fresh_daemon.connect() as stub:
        call = await subscribe(stub)
        fresh_daemon.process.send_signal(15)
        async with asyncio.timeout(WAIT_SECONDS * 2):
            rest = [event async for event in call]
        assert rest == []
        assert await call.code() == grpc.StatusCode.OK
    assert fresh_daemon.terminate() == 0
