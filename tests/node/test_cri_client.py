"""CriClient and CriPodSource against a real `podgate runtime` over real gRPC.

The runtime helpers here are shared with test_upstream.py (imported by module name).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.node.cri_client import (
    KUBELET_PORTS_ANNOTATION,
    PODGATE_PORTS_ANNOTATION,
    STATUS_CACHE_SECONDS,
    CriClient,
    CriError,
    CriNotFound,
    CriPodSource,
    CriUnavailable,
    container_ports,
    pod_phase,
)
from podgate.node.kubeapi import PodView
from podgate.node.upstream import CriTarget

# sun_path is 108 bytes and the runtime keeps sockets deep under its state directory, so the
# state lives in a short directory right under /tmp rather than pytest's tmp_path.
STATE_PARENT = "/tmp"
# Interpreter start, state load and both servers, on a loaded machine.
READY_TIMEOUT_SECONDS = 30.0
# The runtime gives in-flight calls 5 s after SIGTERM.
STOP_TIMEOUT_SECONDS = 15.0
# Removing a pod stops its containers (with grace periods) and its holder.
REMOVE_TIMEOUT_SECONDS = 60.0
# Bound on each wait for a container to get going or to finish.
WAIT_SECONDS = 15.0
POLL_SECONDS = 0.05
NAMESPACE = "pg-node"
ECHO_PORT = 7070

READY_LINE = re.compile(
    r"^podgate runtime ready cri=unix://(?P<cri>\S+) streaming=(?P<streaming>\S+) ", re.MULTILINE
)

# A TCP echo server on the pod's own 127.0.0.1; prints "listening" once it accepts.
ECHO_SERVER = r"""
import socket, sys, threading
server = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=64)
print("listening", flush=True)

def serve(conn):
    with conn:
        while data := conn.recv(1 << 20):
            conn.sendall(data)

while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@dataclass
class RuntimeProcess:
    """A `podgate runtime` child process and the pods made on it."""

    root: Path
    process: subprocess.Popen[bytes]
    cri_socket: str
    streaming: str
    pods: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, *extra: str) -> RuntimeProcess:
        log = root / "runtime.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "podgate",
                    "runtime",
                    "--state-dir",
                    str(root / "s"),
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            text = log.read_text(errors="replace")
            if (found := READY_LINE.search(text)) is not None:
                return cls(root, process, found["cri"], found["streaming"])
            if process.poll() is not None or time.monotonic() > deadline:
                if process.poll() is None:
                    process.kill()
                process.wait()
                raise RuntimeError(f"podgate runtime did not get ready:\n{text[-4000:]}")
            time.sleep(POLL_SECONDS)

    def stub(self, channel: grpc.Channel) -> pb_grpc.RuntimeServiceStub:
        return pb_grpc.RuntimeServiceStub(channel)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.cri_socket}")

    def run_pod(
        self, name: str, *, uid: str = "", attempt: int = 0, log_directory: str = ""
    ) -> tuple[str, pb.PodSandboxConfig]:
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=NAMESPACE, uid=uid or f"uid-{name}", attempt=attempt
            ),
            log_directory=log_directory,
        )
        with self.channel() as channel:
            pod_id = self.stub(channel).RunPodSandbox(pb.RunPodSandboxRequest(config=config))
        self.pods.append(pod_id.pod_sandbox_id)
        return pod_id.pod_sandbox_id, config

    def create(
        self,
        pod: tuple[str, pb.PodSandboxConfig],
        name: str,
        command: Sequence[str],
        *,
        annotations: dict[str, str] | None = None,
        start: bool = True,
        log_path: str = "",
    ) -> str:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            command=list(command),
            annotations=annotations or {},
            log_path=log_path,
        )
        with self.channel() as channel:
            stub = self.stub(channel)
            request = pb.CreateContainerRequest(
                pod_sandbox_id=pod[0], config=config, sandbox_config=pod[1]
            )
            container_id: str = stub.CreateContainer(request).container_id
            if start:
                stub.StartContainer(pb.StartContainerRequest(container_id=container_id))
        return container_id

    def echo_server(self, pod: tuple[str, pb.PodSandboxConfig], name: str, port: int) -> str:
        """A container running ECHO_SERVER on `port`, declared in podgate's annotation."""
        container_id = self.create(
            pod,
            name,
            [sys.executable, "-c", ECHO_SERVER, str(port)],
            annotations={PODGATE_PORTS_ANNOTATION: json.dumps([port])},
            log_path=f"{name}.log",
        )
        self.wait_log(container_id, b"listening")
        return container_id

    def status(self, container_id: str) -> pb.ContainerStatus:
        with self.channel() as channel:
            request = pb.ContainerStatusRequest(container_id=container_id)
            status: pb.ContainerStatus = self.stub(channel).ContainerStatus(request).status
            return status

    def wait_log(self, container_id: str, needle: bytes) -> None:
        path = Path(self.status(container_id).log_path)
        deadline = time.monotonic() + WAIT_SECONDS
        while not (path.exists() and needle in path.read_bytes()):
            assert time.monotonic() < deadline, f"{needle!r} never appeared in {path}"
            time.sleep(POLL_SECONDS)

    def wait_exited(self, container_id: str) -> int:
        deadline = time.monotonic() + WAIT_SECONDS
        while (status := self.status(container_id)).state != pb.CONTAINER_EXITED:
            assert time.monotonic() < deadline, f"{container_id} did not exit"
            time.sleep(POLL_SECONDS)
        return status.exit_code

    def stop_pod(self, pod_id: str) -> None:
        with self.channel() as channel:
            self.stub(channel).StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def stop_container(self, container_id: str) -> None:
        with self.channel() as channel:
            request = pb.StopContainerRequest(container_id=container_id, timeout=1)
            self.stub(channel).StopContainer(request)

    def shutdown(self) -> None:
        """Remove every pod made here, then SIGTERM the runtime (SIGKILL if it hangs)."""
        try:
            if self.process.poll() is None:
                with self.channel() as channel:
                    stub = self.stub(channel)
                    for pod_id in self.pods:
                        with contextlib.suppress(grpc.RpcError):
                            stub.RemovePodSandbox(
                                pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id),
                                timeout=REMOVE_TIMEOUT_SECONDS,
                            )
        finally:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(STOP_TIMEOUT_SECONDS)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()


@contextlib.contextmanager
def podgate_runtime(*, stream_socket: bool = False) -> Iterator[RuntimeProcess]:
    """A runtime in a fresh short state directory, removed with its pods afterwards; with
    `stream_socket`, its streaming server listens on a unix socket instead of TCP."""
    root = Path(tempfile.mkdtemp(prefix="pgn", dir=STATE_PARENT))
    extra = ["--stream-socket", str(root / "stream.sock")] if stream_socket else []
    try:
        runtime = RuntimeProcess.start(root, *extra)
        try:
            yield runtime
        finally:
            runtime.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the runtime creates namespaces")


# --------------------------------------------------------------------------- unit


def test_ports_from_podgate_annotation() -> None:
    assert container_ports({PODGATE_PORTS_ANNOTATION: "[8080, 9090]"}) == (8080, 9090)


def test_ports_from_kubelet_annotation() -> None:
    # The kubelet's shape: []v1.ContainerPort marshalled with its JSON field names.
    value = json.dumps(
        [
            {"name": "http", "containerPort": 80, "protocol": "TCP"},
            {"containerPort": 53, "protocol": "UDP"},
        ]
    )
    assert container_ports({KUBELET_PORTS_ANNOTATION: value}) == (80, 53)


def test_podgate_annotation_wins_over_kubelet_annotation() -> None:
    annotations = {
        PODGATE_PORTS_ANNOTATION: "[1]",
        KUBELET_PORTS_ANNOTATION: '[{"containerPort": 2}]',
    }
    assert container_ports(annotations) == (1,)


@pytest.mark.parametrize(
    "annotations",
    [
        {},
        {PODGATE_PORTS_ANNOTATION: "not json"},
        {PODGATE_PORTS_ANNOTATION: '{"a": 1}'},
        {PODGATE_PORTS_ANNOTATION: '[0, 65536, true, "80", 1.5]'},
        {KUBELET_PORTS_ANNOTATION: '[{"hostPort": 80}, 5, {"containerPort": "80"}]'},
    ],
)
def test_malformed_ports_are_no_ports(annotations: dict[str, str]) -> None:
    assert container_ports(annotations) == ()


RUNNING, CREATED, EXITED, UNKNOWN = (
    pb.CONTAINER_RUNNING,
    pb.CONTAINER_CREATED,
    pb.CONTAINER_EXITED,
    pb.CONTAINER_UNKNOWN,
)


@pytest.mark.parametrize(
    ("ready", "states", "codes", "phase"),
    [
        (True, [RUNNING, RUNNING], [None, None], "Running"),
        (True, [RUNNING, EXITED], [None, 0], "Running"),
        (True, [RUNNING, CREATED], [None, None], "Pending"),
        (True, [], [], "Pending"),
        (True, [EXITED, EXITED], [0, 0], "Succeeded"),
        (True, [EXITED, EXITED], [0, 2], "Failed"),
        (False, [EXITED], [0], "Succeeded"),
        (False, [EXITED], [137], "Failed"),
        (False, [EXITED], [None], "Failed"),
        (True, [RUNNING, UNKNOWN], [None, None], "Unknown"),
        (False, [RUNNING], [None], "Unknown"),
    ],
)
def test_pod_phase(ready: bool, states: list[int], codes: list[int | None], phase: str) -> None:
    assert pod_phase(ready, states, codes) == phase


async def test_unreachable_runtime_is_unavailable(tmp_path: Path) -> None:
    client = CriClient(str(tmp_path / "missing.sock"), timeout=5.0)
    try:
        with pytest.raises(CriUnavailable) as info:
            await client.list_pods()
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert "missing.sock" in str(info.value)
    finally:
        await client.close()


# --------------------------------------------------------------------------- real runtime


@dataclass
class Pods:
    runtime: RuntimeProcess
    web: str
    echo: str
    side: str
    waiting: str
    waiting_container: str
    done_ok: str
    done_bad: str
    twin_old: str
    twin_new: str
    log_dir: Path
    started: datetime


@pytest.fixture(scope="module")
def pods() -> Iterator[Pods]:
    require_root()
    started = datetime.now(UTC)
    with podgate_runtime() as runtime:
        log_dir = runtime.root / "podlogs"
        web = runtime.run_pod("web", log_directory=str(log_dir))
        echo = runtime.echo_server(web, "echo", ECHO_PORT)
        side = runtime.create(
            web,
            "side",
            ["sleep", "600"],
            annotations={KUBELET_PORTS_ANNOTATION: '[{"containerPort":8081,"protocol":"TCP"}]'},
        )
        waiting = runtime.run_pod("waiting")
        waiting_container = runtime.create(waiting, "later", ["true"], start=False)
        done_ok = runtime.run_pod("done-ok")
        runtime.wait_exited(runtime.create(done_ok, "main", ["true"]))
        done_bad = runtime.run_pod("done-bad")
        assert runtime.wait_exited(runtime.create(done_bad, "main", ["sh", "-c", "exit 4"])) == 4
        # The kubelet's restart of a pod: the old sandbox stays, stopped, under the same name.
        twin_old = runtime.run_pod("twin", uid="uid-twin", attempt=0)
        runtime.stop_pod(twin_old[0])
        twin_new = runtime.run_pod("twin", uid="uid-twin", attempt=1)
        yield Pods(
            runtime,
            web[0],
            echo,
            side,
            waiting[0],
            waiting_container,
            done_ok[0],
            done_bad[0],
            twin_old[0],
            twin_new[0],
            log_dir,
            started,
        )


def by_sandbox(views: list[PodView]) -> dict[str, PodView]:
    return {v.sandbox_id: v for v in views}


async def test_version(pods: Pods) -> None:
    client = CriClient(pods.runtime.cri_socket)
    try:
        version = await client.version()
    finally:
        await client.close()
    # CRI runtime.v1; podgate names itself.
    assert version.runtime_name == "podgate"
    assert version.runtime_api_version == "v1"


async def test_list_pods(pods: Pods) -> None:
    client = CriClient(pods.runtime.cri_socket)
    try:
        views = by_sandbox(await client.list_pods())
    finally:
        await client.close()
    ours = {
        pods.web,
        pods.waiting,
        pods.done_ok,
        pods.done_bad,
        pods.twin_old,
        pods.twin_new,
    }
    assert set(views) == ours

    web = views[pods.web]
    assert (web.namespace, web.name, web.uid, web.phase) == (NAMESPACE, "web", "uid-web", "Running")
    assert [(c.name, c.id, tuple(c.ports), c.ready) for c in web.containers] == [
        ("echo", pods.echo, (ECHO_PORT,), True),
        ("side", pods.side, (8081,), True),
    ]
    assert pods.started - timedelta(seconds=1) <= web.created <= datetime.now(UTC)
    assert web.ref.sandbox_id == pods.web

    waiting = views[pods.waiting]
    assert waiting.phase == "Pending"
    assert [(c.name, c.id, c.ready) for c in waiting.containers] == [
        ("later", pods.waiting_container, False)
    ]
    assert views[pods.done_ok].phase == "Succeeded"
    assert views[pods.done_bad].phase == "Failed"
    assert views[pods.twin_new].phase == "Pending"  # ready, no containers yet
    assert views[pods.twin_old].phase == "Failed"  # stopped


async def test_pod_source_one_view_per_name(pods: Pods) -> None:
    client = CriClient(pods.runtime.cri_socket)
    target = CriTarget(client)
    source = CriPodSource(client, target, node="node-a")
    try:
        views = await source.list_pods()
    finally:
        await target.aclose()
        await client.close()
    names = sorted(v.name for v in views)
    assert names == ["done-bad", "done-ok", "twin", "waiting", "web"]
    twin = next(v for v in views if v.name == "twin")
    assert twin.sandbox_id == pods.twin_new
    assert {v.node for v in views} == {"node-a"}
    assert source.target is target

    web = next(v for v in views if v.name == "web")
    assert source.stream_container(web, "side") == pods.side
    assert source.stream_container(web, None) == pods.echo
    assert source.stream_container(web, "nope") is None
    assert source.stream_container(twin, None) is None


async def test_sandbox_status_is_cached_briefly(pods: Pods) -> None:
    now = [1000.0]
    client = CriClient(pods.runtime.cri_socket, clock=lambda: now[0])
    calls: list[str] = []
    status_call = client._rt.PodSandboxStatus

    def counting(request: pb.PodSandboxStatusRequest, **kwargs: object) -> object:
        calls.append(request.pod_sandbox_id)
        return status_call(request, **kwargs)

    client._rt.PodSandboxStatus = counting  # type: ignore[method-assign]
    ready = {pods.web, pods.waiting, pods.done_ok, pods.done_bad, pods.twin_new}
    try:
        await client.list_pods()
        assert sorted(calls) == sorted(ready)
        now[0] += STATUS_CACHE_SECONDS / 2
        await client.list_pods()
        assert len(calls) == len(ready)
        now[0] += STATUS_CACHE_SECONDS
        await client.list_pods()
        assert len(calls) == 2 * len(ready)
    finally:
        await client.close()


async def test_urls_and_log_path(pods: Pods) -> None:
    client = CriClient(pods.runtime.cri_socket)
    try:
        streaming = pods.runtime.streaming
        exec_url = await client.exec_url(pods.side, ["true"], stdout=True, stderr=True)
        attach_url = await client.attach_url(pods.side, stdout=True)
        pf_url = await client.port_forward_url(pods.web)
        for url, kind in ((exec_url, "exec"), (attach_url, "attach"), (pf_url, "portforward")):
            assert re.fullmatch(rf"{re.escape(streaming)}/{kind}/[\w-]+", url), url
        assert len({exec_url, attach_url, pf_url}) == 3
        # CRI: a container's log_path is relative to its sandbox's log_directory.
        assert await client.container_log_path(pods.echo) == str(pods.log_dir / "echo.log")
    finally:
        await client.close()


async def test_errors_carry_the_runtime_message(pods: Pods) -> None:
    client = CriClient(pods.runtime.cri_socket)
    unknown = "f" * 64
    try:
        with pytest.raises(CriNotFound) as info:
            await client.exec_url(unknown, ["true"])
        assert info.value.code is grpc.StatusCode.NOT_FOUND
        assert unknown in str(info.value)
        with pytest.raises(CriNotFound):
            await client.port_forward_url(unknown)
        with pytest.raises(CriNotFound):
            await client.container_log_path(unknown)
        with pytest.raises(CriError) as bad:
            await client.exec_url(pods.side, [])  # CRI: cmd must not be empty
        assert not isinstance(bad.value, CriNotFound | CriUnavailable)
        assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await client.close()
