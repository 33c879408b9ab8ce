"""A scriptable NRI plugin for adaptation tests, built from the mux and ttrpc pieces directly so
a test can make it answer UNIMPLEMENTED, hang, fail or send garbage. Every call it receives is
recorded, decoded, in `calls` (and as (plugin, method) in a shared `journal`).

`serve_launched` makes it a pre-installed plugin speaking over fd 3.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf.message import Message

from podgate.aio.nrimux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from podgate.aio.streams import SocketStream
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcServer
from podgate.nri import api_pb2 as api
from podgate.proto.ttrpc import TtrpcError

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
WAIT_SECONDS = 5.0  # bound on every wait in the tests

# Method -> (request type, default reply type).
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Configure": (api.ConfigureRequest, api.ConfigureResponse),
    "Synchronize": (api.SynchronizeRequest, api.SynchronizeResponse),
    "Shutdown": (api.Empty, api.Empty),
    "RunPodSandbox": (api.RunPodSandboxRequest, api.RunPodSandboxResponse),
    "UpdatePodSandbox": (api.UpdatePodSandboxRequest, api.UpdatePodSandboxResponse),
    "PostUpdatePodSandbox": (api.PostUpdatePodSandboxRequest, api.PostUpdatePodSandboxResponse),
    "StopPodSandbox": (api.StopPodSandboxRequest, api.StopPodSandboxResponse),
    "RemovePodSandbox": (api.RemovePodSandboxRequest, api.RemovePodSandboxResponse),
    "PodSandboxStatus": (api.PodSandboxStatusRequest, api.PodSandboxStatusResponse),
    "CreateContainer": (api.CreateContainerRequest, api.CreateContainerResponse),
    "PostCreateContainer": (api.PostCreateContainerRequest, api.PostCreateContainerResponse),
    "StartContainer": (api.StartContainerRequest, api.StartContainerResponse),
    "PostStartContainer": (api.PostStartContainerRequest, api.PostStartContainerResponse),
    "UpdateContainer": (api.UpdateContainerRequest, api.UpdateContainerResponse),
    "PostUpdateContainer": (api.PostUpdateContainerRequest, api.PostUpdateContainerResponse),
    "StopContainer": (api.StopContainerRequest, api.StopContainerResponse),
    "RemoveContainer": (api.RemoveContainerRequest, api.RemoveContainerResponse),
    "StateChange": (api.StateChangeEvent, api.Empty),
    "ValidateContainerAdjustment": (
        api.ValidateContainerAdjustmentRequest,
        api.ValidateContainerAdjustmentResponse,
    ),
}

Reply = Callable[[Any], Message]


class Peer:
    """One plugin connection. `events` is what Configure answers; `missing` methods are not
    served (UNIMPLEMENTED), `hang` ones never answer, `hold` ones answer once their event is
    set, `fail` ones answer with that error, `replies` build the answer from the request."""

    def __init__(
        self,
        name: str,
        idx: str,
        *,
        events: int = 0,
        journal: list[tuple[str, str]] | None = None,
        missing: Iterable[str] = (),
        hang: Iterable[str] = (),
        hold: Mapping[str, asyncio.Event] | None = None,
        fail: Mapping[str, TtrpcError] | None = None,
        replies: Mapping[str, Reply] | None = None,
    ) -> None:
        self.name = name
        self.idx = idx
        self.events = events
        self.journal = journal if journal is not None else []
        self.missing = set(missing)
        self.hang = set(hang)
        self.hold = dict(hold or {})
        self.fail = dict(fail or {})
        self.replies = dict(replies or {})
        self.calls: list[tuple[str, Any]] = []
        self.changed = asyncio.Event()
        self.stream: SocketStream | None = None
        self.mux: Mux | None = None
        self.client: TtrpcClient | None = None
        self._server: TtrpcServer | None = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def full_name(self) -> str:
        return f"{self.idx}-{self.name}"

    async def connect(self, path: str) -> Peer:
        return self.attach(await SocketStream.connect_unix(path))

    def attach(self, stream: SocketStream) -> Peer:
        self.stream = stream
        self.mux = Mux(stream, name=f"test plugin {self.full_name}")
        self._server = TtrpcServer(name=f"test plugin {self.full_name}")
        self._server.register(
            PLUGIN_SERVICE,
            {method: self._handler(method) for method in METHODS if method not in self.missing},
        )
        self._serving = asyncio.get_running_loop().create_task(
            self._server.serve(self.mux.conn(PLUGIN_SERVICE_CONN))
        )
        self.client = TtrpcClient(self.mux.conn(RUNTIME_SERVICE_CONN))
        self.mux.start()
        return self

    async def register(self, *, name: str | None = None, idx: str | None = None) -> None:
        assert self.client is not None
        request = api.RegisterPluginRequest(
            plugin_name=self.name if name is None else name,
            plugin_idx=self.idx if idx is None else idx,
            NRI_version="test",
        )
        await self.client.call(
            RUNTIME_SERVICE, "RegisterPlugin", request.SerializeToString(), timeout=WAIT_SECONDS
        )

    async def update_containers(self, request: api.UpdateContainersRequest) -> Any:
        assert self.client is not None
        data = await self.client.call(
            RUNTIME_SERVICE, "UpdateContainers", request.SerializeToString(), timeout=WAIT_SECONDS
        )
        return api.UpdateContainersResponse.FromString(data)

    def received(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    async def wait_for(self, method: str, count: int = 1) -> list[Any]:
        async with asyncio.timeout(WAIT_SECONDS):
            while len(self.received(method)) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.received(method)

    async def wait_closed(self) -> None:
        assert self.mux is not None
        async with asyncio.timeout(WAIT_SECONDS):
            await self.mux.wait_closed()

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.mux is not None:
            await self.mux.aclose()
        if self._server is not None:
            await self._server.aclose()
        if self._serving is not None:
            await asyncio.wait([self._serving])

    def _handler(self, method: str) -> Callable[[bytes, RequestContext], Any]:
        request_type, reply_type = METHODS[method]

        async def handle(payload: bytes, ctx: RequestContext) -> bytes:
            request = request_type.FromString(payload)
            self.calls.append((method, request))
            self.journal.append((self.full_name, method))
            self.changed.set()
            if method in self.hang:
                await asyncio.Event().wait()
            if method in self.hold:
                await self.hold[method].wait()
            if method in self.fail:
                raise self.fail[method]
            if method in self.replies:
                return self.replies[method](request).SerializeToString()
            if method == "Configure":
                return api.ConfigureResponse(events=self.events).SerializeToString()
            if method == "Synchronize":
                return api.SynchronizeResponse(more=request.more).SerializeToString()
            return reply_type().SerializeToString()

        return handle


# ----------------------------------------------------------------------------- launched


async def serve_launched(config_file: str) -> None:
    """Be a pre-installed plugin on fd 3: register under the name the runtime gave us, write
    the Configure config text to `config_file`, and serve until the runtime hangs up. A config
    of "hang METHOD..." makes those methods never answer."""
    sock = socket.socket(fileno=3)
    peer = Peer(os.environ.get("NRI_PLUGIN_NAME", "?"), os.environ.get("NRI_PLUGIN_IDX", "?"))
    peer.attach(await SocketStream.from_socket(sock))
    await peer.register()
    configure = (await peer.wait_for("Configure"))[0]
    words = configure.config.split()
    if words[:1] == ["hang"]:
        peer.hang.update(words[1:])
    with open(config_file, "w", encoding="utf-8") as f:
        f.write(configure.config)
    assert peer.mux is not None
    await peer.mux.wait_closed()
    await peer.aclose()
