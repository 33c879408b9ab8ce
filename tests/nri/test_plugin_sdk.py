"""The NRI plugin SDK against a minimal runtime side built here from the ttrpc driver and the
mux: registration, the event mask, dedicated RPCs and the StateChange path, split Synchronize,
reconnecting, and the `logger` plugin as a pre-launched (fd 3) and an external process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from google.protobuf.message import Message

from podgate.aio.nrimux import Mux
from podgate.aio.streams import SocketStream, Wire, start_unix_server
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcServer
from podgate.nri import api_pb2 as api
from podgate.nri.plugin import Plugin, RegistrationError, Stub
from podgate.proto.ttrpc import Code, TtrpcError

PLUGIN = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME = "nri.pkg.api.v1alpha1.Runtime"
M = TypeVar("M", bound=Message)

POD = api.PodSandbox(id="pod-1", name="web", namespace="default", uid="u1")
CTR = api.Container(id="ctr-1", pod_sandbox_id="pod-1", name="nginx")


# ----------------------------------------------------------------------------- runtime side
@dataclass
class PluginConn:
    """One registered plugin, as the runtime sees it."""

    name: str
    index: str
    client: TtrpcClient
    mux: Mux

    async def call(self, method: str, request: Message, reply: type[M]) -> M:
        async with asyncio.timeout(5):
            payload = await self.client.call(PLUGIN, method, request.SerializeToString(), timeout=2)
        return reply.FromString(payload)


async def serve_plugin_connection(
    wire: Wire, registered: asyncio.Queue[PluginConn], *, reject: str | None = None
) -> None:
    """The runtime's half of one plugin connection: serve conn 2, call on conn 1."""
    mux = Mux(wire, name="runtime")
    server = TtrpcServer(name="runtime")
    got: asyncio.Future[api.RegisterPluginRequest] = asyncio.get_running_loop().create_future()

    async def register(payload: bytes, ctx: RequestContext) -> bytes:
        if reject is not None:
            raise TtrpcError(Code.UNKNOWN, reject)
        got.set_result(api.RegisterPluginRequest.FromString(payload))
        return b""

    server.register(RUNTIME, {"RegisterPlugin": register})
    serving = asyncio.create_task(server.serve(mux.conn(2)))
    client = TtrpcClient(mux.conn(1), name="runtime client")
    mux.start()
    try:
        async with asyncio.timeout(5):
            request = await got
        await registered.put(PluginConn(request.plugin_name, request.plugin_idx, client, mux))
        await mux.wait_closed()
    except TimeoutError:
        pass
    finally:
        await client.aclose()
        await mux.aclose()
        await server.aclose()
        await asyncio.wait([serving])


@dataclass
class FakeRuntime:
    path: str
    reject: str | None = None
    registered: asyncio.Queue[PluginConn] = field(default_factory=asyncio.Queue)
    listener: asyncio.Server | None = None
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        async def handle(stream: SocketStream) -> None:
            task = asyncio.current_task()
            assert task is not None
            self.handlers.add(task)
            try:
                await serve_plugin_connection(stream, self.registered, reject=self.reject)
            finally:
                self.handlers.discard(task)

        self.listener = await start_unix_server(handle, self.path)

    async def next_plugin(self) -> PluginConn:
        async with asyncio.timeout(10):
            return await self.registered.get()

    async def stop(self) -> None:
        """Like a runtime exiting: stop listening and drop every plugin connection."""
        if self.listener is not None:
            self.listener.close()
            await self.listener.wait_closed()
            self.listener = None
        for task in list(self.handlers):
            task.cancel()
        if self.handlers:
            await asyncio.wait(list(self.handlers), timeout=5)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    # Short on purpose: unix socket paths are limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="nri") as directory:
        yield directory


@pytest.fixture
async def runtime(socket_dir: str) -> AsyncIterator[FakeRuntime]:
    fake = FakeRuntime(str(Path(socket_dir) / "nri.sock"))
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NRI_PLUGIN_SOCKET", "NRI_PLUGIN_NAME", "NRI_PLUGIN_IDX"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    """Stub tasks started by a test; cancelled at the end."""
    tasks: list[asyncio.Task[None]] = []
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)


def start_stub(tasks: list[asyncio.Task[None]], stub: Stub) -> asyncio.Task[None]:
    task = asyncio.create_task(stub.run())
    tasks.append(task)
    return task


# ----------------------------------------------------------------------------- plugins
class Recorder(Plugin):
    """Overrides run_pod_sandbox and create_container (and records what arrives)."""

    name, index = "recorder", "42"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.configured: tuple[str, str, str] | None = None

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        self.configured = (config, runtime_name, runtime_version)

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self.calls.append(("run_pod_sandbox", pod.id, ""))

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.ContainerAdjustment:
        self.calls.append(("create_container", pod.id, container.id))
        return api.ContainerAdjustment(annotations={"seen-by": "recorder"}, args=["/bin/true"])


class Everything(Recorder):
    """Recorder plus the remaining event methods, with results where the RPC has them."""

    name, index = "everything", "43"

    async def synchronize(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> list[api.ContainerUpdate]:
        self.calls.append(("synchronize", ",".join(p.id for p in pods), str(len(containers))))
        return [api.ContainerUpdate(container_id=c.id) for c in containers]

    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.calls.append(("start_container", pod.id, container.id))

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.calls.append(("remove_container", pod.id, container.id))

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self.calls.append(("stop_pod_sandbox", pod.id, ""))

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> list[api.ContainerUpdate]:
        self.calls.append(("update_container", container.id, str(resources.pids.limit)))
        return [api.ContainerUpdate(container_id="other", ignore_failure=True)]

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> list[api.ContainerUpdate]:
        self.calls.append(("stop_container", pod.id, container.id))
        return [api.ContainerUpdate(container_id="sibling")]

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        self.calls.append(("pod_sandbox_status", pod.id, ""))
        return "10.88.0.5", ["fd00::5"]


class StatusOnly(Plugin):
    name, index = "status", "50"

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        return None


class Explicit(Plugin):
    name, index = "explicit", "51"
    events = 0x0002 | 0x0400  # STOP_POD_SANDBOX | REMOVE_CONTAINER, set by hand


# ----------------------------------------------------------------------------- tests
async def configure(conn: PluginConn, config: str = "") -> int:
    request = api.ConfigureRequest(
        config=config,
        runtime_name="podgate",
        runtime_version="0.1.0",
        registration_timeout=5000,
        request_timeout=2000,
    )
    reply = await conn.call("Configure", request, api.ConfigureResponse)
    return reply.events


async def test_registers_with_the_plugin_name_and_index(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    stub = Stub(Recorder(), socket_path=runtime.path)
    start_stub(running, stub)
    conn = await runtime.next_plugin()
    assert (conn.name, conn.index) == ("recorder", "42")
    async with asyncio.timeout(5):
        await stub.registered.wait()


async def test_explicit_name_and_index_win_over_environment(
    runtime: FakeRuntime, running: list[asyncio.Task[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NRI_PLUGIN_NAME", "from-env")
    monkeypatch.setenv("NRI_PLUGIN_IDX", "77")
    start_stub(running, Stub(Recorder(), socket_path=runtime.path))
    conn = await runtime.next_plugin()
    assert (conn.name, conn.index) == ("from-env", "77")
    start_stub(running, Stub(Recorder(), socket_path=runtime.path, name="cli", index="05"))
    conn = await runtime.next_plugin()
    assert (conn.name, conn.index) == ("cli", "05")


@pytest.mark.parametrize(
    ("plugin", "mask"),
    [(Recorder(), 0x0009), (StatusOnly(), 0x4000), (Explicit(), 0x0402), (Everything(), 0x46AB)],
    ids=["run+create", "pod-sandbox-status", "explicit", "everything"],
)
async def test_configure_returns_the_event_mask(
    runtime: FakeRuntime, running: list[asyncio.Task[None]], plugin: Plugin, mask: int
) -> None:
    # Everything: run 0x1, stop pod 0x2, create 0x8, start 0x20, update 0x80, stop ctr 0x200,
    # remove ctr 0x400, pod sandbox status 0x4000.
    start_stub(running, Stub(plugin, socket_path=runtime.path))
    conn = await runtime.next_plugin()
    assert await configure(conn) == mask


async def test_configure_passes_config_and_runtime(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    plugin = Recorder()
    stub = Stub(plugin, socket_path=runtime.path)
    start_stub(running, stub)
    conn = await runtime.next_plugin()
    await configure(conn, "key=value\n")
    assert plugin.configured == ("key=value\n", "podgate", "0.1.0")
    assert stub.request_timeout == 2.0


async def test_dedicated_rpcs_reach_the_methods(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    plugin = Everything()
    start_stub(running, Stub(plugin, socket_path=runtime.path))
    conn = await runtime.next_plugin()
    await configure(conn)

    await conn.call("RunPodSandbox", api.RunPodSandboxRequest(pod=POD), api.Empty)
    created = await conn.call(
        "CreateContainer",
        api.CreateContainerRequest(pod=POD, container=CTR),
        api.CreateContainerResponse,
    )
    assert dict(created.adjust.annotations) == {"seen-by": "recorder"}
    assert list(created.adjust.args) == ["/bin/true"]
    assert list(created.update) == []
    await conn.call("StartContainer", api.StartContainerRequest(pod=POD, container=CTR), api.Empty)
    resources = api.LinuxResources(pids=api.LinuxPids(limit=99))
    updated = await conn.call(
        "UpdateContainer",
        api.UpdateContainerRequest(pod=POD, container=CTR, linux_resources=resources),
        api.UpdateContainerResponse,
    )
    assert [(u.container_id, u.ignore_failure) for u in updated.update] == [("other", True)]
    stopped = await conn.call(
        "StopContainer",
        api.StopContainerRequest(pod=POD, container=CTR),
        api.StopContainerResponse,
    )
    assert [u.container_id for u in stopped.update] == ["sibling"]
    status = await conn.call(
        "PodSandboxStatus",
        api.PodSandboxStatusRequest(pod=POD),
        api.PodSandboxStatusResponse,
    )
    assert (status.ip, list(status.additional_ips)) == ("10.88.0.5", ["fd00::5"])
    # Methods the plugin does not override answer with an empty reply, never UNIMPLEMENTED.
    assert (
        await conn.client.call(
            PLUGIN,
            "PostUpdateContainer",
            api.PostUpdateContainerRequest(pod=POD, container=CTR).SerializeToString(),
        )
        == b""
    )
    assert (
        await conn.client.call(
            PLUGIN,
            "ValidateContainerAdjustment",
            api.ValidateContainerAdjustmentRequest(pod=POD, container=CTR).SerializeToString(),
        )
        == b""
    )
    assert await conn.client.call(PLUGIN, "Shutdown", b"") == b""
    assert plugin.calls == [
        ("run_pod_sandbox", "pod-1", ""),
        ("create_container", "pod-1", "ctr-1"),
        ("start_container", "pod-1", "ctr-1"),
        ("update_container", "ctr-1", "99"),
        ("stop_container", "pod-1", "ctr-1"),
        ("pod_sandbox_status", "pod-1", ""),
    ]


async def test_create_container_may_return_adjustment_and_updates(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    class Both(Plugin):
        name, index = "both", "60"

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> tuple[api.ContainerAdjustment | None, list[api.ContainerUpdate]]:
            return api.ContainerAdjustment(env=[api.KeyValue(key="A", value="1")]), [
                api.ContainerUpdate(container_id="x")
            ]

    start_stub(running, Stub(Both(), socket_path=runtime.path))
    conn = await runtime.next_plugin()
    reply = await conn.call(
        "CreateContainer",
        api.CreateContainerRequest(pod=POD, container=CTR),
        api.CreateContainerResponse,
    )
    assert [(kv.key, kv.value) for kv in reply.adjust.env] == [("A", "1")]
    assert [u.container_id for u in reply.update] == ["x"]


async def test_state_change_reaches_the_same_methods(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    plugin = Everything()
    start_stub(running, Stub(plugin, socket_path=runtime.path))
    conn = await runtime.next_plugin()
    events = [
        api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD),
        api.StateChangeEvent(event=api.START_CONTAINER, pod=POD, container=CTR),
        # An event with results never travelled as StateChange: ignored, still answered.
        api.StateChangeEvent(event=api.CREATE_CONTAINER, pod=POD, container=CTR),
        api.StateChangeEvent(event=api.REMOVE_CONTAINER, pod=POD, container=CTR),
        api.StateChangeEvent(event=api.STOP_POD_SANDBOX, pod=POD),
    ]
    for event in events:
        await conn.call("StateChange", event, api.Empty)
    assert plugin.calls == [
        ("run_pod_sandbox", "pod-1", ""),
        ("start_container", "pod-1", "ctr-1"),
        ("remove_container", "pod-1", "ctr-1"),
        ("stop_pod_sandbox", "pod-1", ""),
    ]


async def test_split_synchronize_is_collected(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    plugin = Everything()
    start_stub(running, Stub(plugin, socket_path=runtime.path))
    conn = await runtime.next_plugin()
    first = await conn.call(
        "Synchronize",
        api.SynchronizeRequest(pods=[POD], containers=[CTR], more=True),
        api.SynchronizeResponse,
    )
    assert first.more is True
    assert list(first.update) == []
    pod2 = api.PodSandbox(id="pod-2")
    ctr2 = api.Container(id="ctr-2", pod_sandbox_id="pod-2")
    final = await conn.call(
        "Synchronize",
        api.SynchronizeRequest(pods=[pod2], containers=[ctr2], more=False),
        api.SynchronizeResponse,
    )
    assert final.more is False
    assert [u.container_id for u in final.update] == ["ctr-1", "ctr-2"]
    assert plugin.calls == [("synchronize", "pod-1,pod-2", "2")]


async def test_reconnects_after_the_runtime_restarts(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    plugin = Recorder()
    stub = Stub(plugin, socket_path=runtime.path)
    task = start_stub(running, stub)
    first = await runtime.next_plugin()
    assert await configure(first) == 0x0009
    await runtime.stop()
    async with asyncio.timeout(5):
        await first.mux.wait_closed()
    await asyncio.sleep(0.3)  # a few failed dials against the missing socket
    assert not task.done()
    await runtime.start()
    second = await runtime.next_plugin()
    assert (second.name, second.index) == ("recorder", "42")
    await second.call("RunPodSandbox", api.RunPodSandboxRequest(pod=POD), api.Empty)
    assert plugin.calls == [("run_pod_sandbox", "pod-1", "")]


async def test_without_reconnect_run_returns_when_the_runtime_goes(
    runtime: FakeRuntime, running: list[asyncio.Task[None]]
) -> None:
    task = start_stub(running, Stub(Recorder(), socket_path=runtime.path, reconnect=False))
    await runtime.next_plugin()
    await runtime.stop()
    async with asyncio.timeout(5):
        await task


async def test_rejected_registration_ends_run(socket_dir: str) -> None:
    fake = FakeRuntime(str(Path(socket_dir) / "nri.sock"), reject="invalid plugin index")
    await fake.start()
    try:
        with pytest.raises(RegistrationError, match="invalid plugin index"):
            async with asyncio.timeout(5):
                await Stub(Recorder(), socket_path=fake.path).run()
    finally:
        await fake.stop()


def test_invalid_identity_or_no_events_is_refused() -> None:
    with pytest.raises(RegistrationError):
        Stub(Recorder(), name="bad name")
    with pytest.raises(RegistrationError):
        Stub(Recorder(), index="7")
    with pytest.raises(RegistrationError):
        Stub(Plugin(), name="idle", index="01")


# ----------------------------------------------------------------------------- logger plugin
LIFECYCLE = [
    ("RunPodSandbox", "dedicated"),
    ("CreateContainer", "dedicated"),
    ("StartContainer", "state-change"),
    ("PostStartContainer", "dedicated"),
    ("PodSandboxStatus", "dedicated"),
    ("StopContainer", "dedicated"),
    ("RemoveContainer", "dedicated"),
    ("StopPodSandbox", "dedicated"),
    ("RemovePodSandbox", "state-change"),
]
_STATE_CHANGE_EVENTS = {
    "StartContainer": api.START_CONTAINER,
    "RemovePodSandbox": api.REMOVE_POD_SANDBOX,
}
_POD_EVENTS = {"RunPodSandbox", "PodSandboxStatus", "StopPodSandbox", "RemovePodSandbox"}


async def drive_lifecycle(conn: PluginConn) -> None:
    for method, path in LIFECYCLE:
        container = None if method in _POD_EVENTS else CTR
        if path == "state-change":
            event = api.StateChangeEvent(event=_STATE_CHANGE_EVENTS[method], pod=POD)
            if container is not None:
                event.container.CopyFrom(container)
            await conn.call("StateChange", event, api.Empty)
            continue
        request_type = getattr(api, f"{method}Request")
        request = request_type(pod=POD, container=container) if container else request_type(pod=POD)
        await conn.call(method, request, api.Empty)


def expected_lines() -> list[dict[str, object]]:
    return [
        {
            "event": method,
            "pod": "default/web",
            "pod_id": "pod-1",
            "container": "" if method in _POD_EVENTS else "nginx",
            "container_id": "" if method in _POD_EVENTS else "ctr-1",
            "ips": list(POD.ips),
        }
        for method, _ in LIFECYCLE
    ]


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_logger_launched_on_fd_3_with_only_the_nri_environment(tmp_path: Path) -> None:
    events_file = tmp_path / "events.jsonl"
    ours, theirs = socket.socketpair()
    env = {"NRI_PLUGIN_NAME": "logger", "NRI_PLUGIN_IDX": "07", "NRI_PLUGIN_SOCKET": "3"}
    child_fd = theirs.fileno()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "podgate.nri.plugins.logger",
        env=env,
        close_fds=False,
        preexec_fn=lambda: os.dup2(child_fd, 3),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    theirs.close()
    registered: asyncio.Queue[PluginConn] = asyncio.Queue()
    serving = asyncio.create_task(
        serve_plugin_connection(await SocketStream.from_socket(ours), registered)
    )
    try:
        async with asyncio.timeout(20):
            conn = await registered.get()
        assert (conn.name, conn.index) == ("logger", "07")
        # Every event but ValidateContainerAdjustment, PodSandboxStatus included.
        assert await configure(conn, f"events_file={events_file}\n") == 0x5FFF
        synced = await conn.call("Synchronize", api.SynchronizeRequest(), api.SynchronizeResponse)
        assert list(synced.update) == []
        await drive_lifecycle(conn)
        assert read_lines(events_file) == expected_lines()
        # The runtime closes the connection: a launched plugin exits on its own.
        await conn.mux.aclose()
        async with asyncio.timeout(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        assert process.stderr is not None
        await process.stderr.read()
        await asyncio.wait([serving], timeout=5)


async def test_logger_external_with_events_file_option_stops_on_sigterm(
    runtime: FakeRuntime, tmp_path: Path
) -> None:
    events_file = tmp_path / "events.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "podgate.nri.plugins.logger",
        "--socket",
        runtime.path,
        "--idx",
        "11",
        "--events-file",
        str(events_file),
        "--log-level",
        "debug",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(20):
            conn = await runtime.registered.get()
        assert (conn.name, conn.index) == ("logger", "11")
        await configure(conn)
        await drive_lifecycle(conn)
        assert read_lines(events_file) == expected_lines()
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        assert process.stderr is not None
        stderr = (await process.stderr.read()).decode()
    assert "RunPodSandbox: pod default/web (pod-1)\n" in stderr
    assert "StartContainer: pod default/web (pod-1) container nginx (ctr-1)\n" in stderr
