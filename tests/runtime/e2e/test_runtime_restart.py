"""Pods outlive the daemon: SIGKILL it, start another on the same state directory, carry on.

Holders and shims are not the daemon's children, so its death stops nothing: containers keep
running and logging, a container that exits meanwhile has its exit recorded by its shim, and
the new daemon finds all of it in the state directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from runtime_e2e_support import (
    Pods,
    RuntimeDaemon,
    Sink,
    mounts_under,
    parse_cri_log,
    running_daemon,
    state_root,
    stream_target,
    wait_for_log,
)

from podgate.cri import api_pb2 as pb
from podgate.linux.proc import is_alive, process_ref
from podgate.streaming.client import exec_spdy

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

COUNTER = "i=0; while true; do echo $i; i=$((i+1)); sleep 0.1; done"
EXITS_DURING_GAP = "sleep 2; exit 7"
# How long no daemon runs; the second container exits about 2 s after it starts.
GAP_SECONDS = 3.0
# The counter prints every 0.1 s; over the gap at least half of its lines must be there.
MIN_LINES_PER_SECOND = 5
SECOND = 1_000_000_000
# SIGTERM with nothing in flight: the daemon closes its servers and exits at once (well within
# its drain grace; generous for a loaded machine).
STOP_SECONDS = 20.0


async def test_pods_survive_a_killed_daemon() -> None:
    with state_root() as root:
        first = RuntimeDaemon.start(root / "s", root / "daemon.log")
        try:
            async with first.connect() as rt:
                made = Pods(rt)
                pod = await made.run("survivor", hostname="survivor")
                counter = await made.create(pod, "counter", ["sh", "-c", COUNTER])
                await wait_for_log(rt, counter, b" stdout F 2\n")
                exits = await made.create(pod, "exits", ["sh", "-c", EXITS_DURING_GAP])
                started_exits = time.time_ns()
        finally:
            killed_at = time.time_ns()
            first.kill()
        await asyncio.sleep(GAP_SECONDS)
        restarted_at = time.time_ns()
        assert restarted_at - started_exits > 2 * SECOND, "the gap must outlast `sleep 2`"

        with running_daemon(root) as second:
            assert second.process.pid != first.process.pid
            async with second.connect() as rt:
                pods = Pods(rt)
                request = pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id)
                assert (await rt.PodSandboxStatus(request)).status.state == pb.SANDBOX_READY

                # The counter kept writing its log while no daemon ran, without a gap.
                assert (await pods.status(counter)).state == pb.CONTAINER_RUNNING
                log = parse_cri_log(await wait_for_log(rt, counter, b"\n"))
                assert [entry[3] for entry in log] == [str(i).encode() for i in range(len(log))]
                assert {entry[1:3] for entry in log} == {("stdout", "F")}
                during_gap = [entry for entry in log if killed_at < entry[0] < restarted_at]
                gap = (restarted_at - killed_at) / SECOND
                assert len(during_gap) >= MIN_LINES_PER_SECOND * gap, (len(during_gap), gap)
                assert during_gap[0][0] - killed_at < SECOND
                assert restarted_at - during_gap[-1][0] < SECOND

                # And it keeps going after the restart.
                after = f" stdout F {len(log) + 2}\n".encode()
                await wait_for_log(rt, counter, after)

                # Exec still works in it, both kinds.
                response = await rt.ExecSync(
                    pb.ExecSyncRequest(container_id=counter, cmd=["echo", "alive"], timeout=10)
                )
                assert (response.stdout, response.exit_code) == (b"alive\n", 0)
                exec_request = pb.ExecRequest(
                    container_id=counter, cmd=["hostname"], stdout=True, stderr=True
                )
                endpoint, path = stream_target((await rt.Exec(exec_request)).url)
                stdout = Sink()
                result = await exec_spdy(endpoint, path, stdout=stdout, stderr=Sink())
                assert (result.exit_code, bytes(stdout.data)) == (0, b"survivor\n")

                # The container that exited during the gap: exit code 7, finished in the gap.
                exited = await pods.status(exits)
                assert exited.state == pb.CONTAINER_EXITED
                assert exited.exit_code == 7
                assert killed_at < exited.finished_at < restarted_at
                # `sleep 2` ran to its end (the start is taken once the process runs).
                assert exited.finished_at - exited.started_at > 1.5 * SECOND

                # The new daemon can stop and remove what the old one started.
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
                listed = await rt.ListPodSandbox(pb.ListPodSandboxRequest())
                assert [p.id for p in listed.items] == []
                assert mounts_under(root) == [], "the pod's pinned namespaces stayed mounted"


async def test_sigterm_stops_the_daemon_and_leaves_pods_running() -> None:
    with state_root() as root:
        first = RuntimeDaemon.start(root / "s", root / "daemon.log")
        try:
            async with first.connect() as rt:
                made = Pods(rt)
                pod = await made.run("sigterm")
                container = await made.create(pod, "main", ["sleep", "1000"])
                status = pb.ContainerStatusRequest(container_id=container, verbose=True)
                info = json.loads((await rt.ContainerStatus(status)).info["info"])
                main = process_ref(info["pid"])
        finally:
            started = time.monotonic()
            code = first.terminate()
        assert code == 0
        assert time.monotonic() - started < STOP_SECONDS
        assert not os.path.exists(first.cri_socket), "the CRI socket was left behind"
        assert is_alive(main), "stopping the daemon stopped a container"

        with running_daemon(root) as second:
            async with second.connect() as rt:
                pod_status = pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id)
                assert (await rt.PodSandboxStatus(pod_status)).status.state == pb.SANDBOX_READY
                assert (await Pods(rt).status(container)).state == pb.CONTAINER_RUNNING
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
        assert not is_alive(main)
