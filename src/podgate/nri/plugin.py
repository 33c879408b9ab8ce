"""The NRI plugin SDK: write a `Plugin` subclass, hand it to `run_plugin` (or a `Stub`).

    class Hello(Plugin):
        name, index = "hello", "50"

        async def create_container(self, pod, container):
            return api.ContainerAdjustment(annotations={"hello": "world"})

    if __name__ == "__main__":
        sys.exit(run_plugin(Hello()))

The plugin subscribes to the events whose methods it overrides (or sets `events` to a mask).
Replies may be built with `podgate.nri.adjust` (`Adjustment`, `Update`: one method per field).
The stub does the rest, as containerd/nri's Go stub does: it connects (a pre-launched plugin
uses the socket in `NRI_PLUGIN_SOCKET` and takes its name and index from `NRI_PLUGIN_NAME` and
`NRI_PLUGIN_IDX`; an external one dials `/var/run/nri/nri.sock`), multiplexes the connection,
serves the Plugin service on ConnID 1, registers through the Runtime service on ConnID 2, and
answers Configure, Synchronize (collecting `more=true` chunks) and every event RPC. Events also
arrive through the deprecated `StateChange` for runtimes older than NRI v0.12; no RPC the
service defines is answered UNIMPLEMENTED.

An external plugin reconnects after losing the runtime, with bounded exponential backoff, until
cancelled; a pre-launched plugin exits when the runtime closes its socket. A runtime that
rejects the registration outright (anything but a closed connection or a timeout) ends `run()`
with `RegistrationError`: retrying a bad name would never succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from podgate.aio import loop as aio_loop
from podgate.aio.errors import StreamError
from podgate.aio.nrimux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from podgate.aio.streams import SocketStream
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcServer
from podgate.nri import api_pb2 as api
from podgate.nri.adjust import Adjustment, Update
from podgate.proto.ttrpc import Code, TtrpcError

__all__ = [
    "ALL_EVENTS",
    "DEFAULT_SOCKET_PATH",
    "EVENT_METHODS",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "VALID_EVENTS",
    "Plugin",
    "RegistrationError",
    "Stub",
    "event_mask",
    "run_plugin",
]

log = logging.getLogger(__name__)

DEFAULT_SOCKET_PATH = "/var/run/nri/nri.sock"  # api.DefaultSocketPath
PLUGIN_SOCKET_ENV = "NRI_PLUGIN_SOCKET"  # fd of the socket a launching runtime passes
PLUGIN_NAME_ENV = "NRI_PLUGIN_NAME"
PLUGIN_IDX_ENV = "NRI_PLUGIN_IDX"
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
# seconds; the Go stub's RegisterPlugin deadline, equal to the runtime's registration wait.
REGISTRATION_TIMEOUT = 5.0
# seconds; first and longest wait between reconnect attempts of an external plugin.
RECONNECT_MIN_DELAY = 0.1
RECONNECT_MAX_DELAY = 5.0
# Every event bit including POD_SANDBOX_STATUS (containerd/nri #267); upstream main has 0x3FFF.
VALID_EVENTS = (1 << (api.LAST - 1)) - 1
ALL_EVENTS = VALID_EVENTS
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # what the runtime accepts as a plugin name
_INDEX = re.compile(r"[0-9]{2}")

# Plugin method -> the event it subscribes to when overridden.
EVENT_METHODS: dict[str, int] = {
    "run_pod_sandbox": api.RUN_POD_SANDBOX,
    "stop_pod_sandbox": api.STOP_POD_SANDBOX,
    "remove_pod_sandbox": api.REMOVE_POD_SANDBOX,
    "create_container": api.CREATE_CONTAINER,
    "post_create_container": api.POST_CREATE_CONTAINER,
    "start_container": api.START_CONTAINER,
    "post_start_container": api.POST_START_CONTAINER,
    "update_container": api.UPDATE_CONTAINER,
    "post_update_container": api.POST_UPDATE_CONTAINER,
    "stop_container": api.STOP_CONTAINER,
    "remove_container": api.REMOVE_CONTAINER,
    "update_pod_sandbox": api.UPDATE_POD_SANDBOX,
    "post_update_pod_sandbox": api.POST_UPDATE_POD_SANDBOX,
    "validate_container_adjustment": api.VALIDATE_CONTAINER_ADJUSTMENT,
    "pod_sandbox_status": api.POD_SANDBOX_STATUS,
}


def event_mask(*events: int) -> int:
    """The ConfigureResponse bit mask for `events` (bit event-1 each)."""
    mask = 0
    for event in events:
        if not api.UNKNOWN < event < api.LAST:
            raise ValueError(f"not an NRI event: {event}")
        mask |= 1 << (event - 1)
    return mask


class RegistrationError(Exception):
    """The runtime refused to register the plugin (or the plugin's identity is invalid)."""


AdjustmentReply = api.ContainerAdjustment | Adjustment | None
UpdateReply = api.ContainerUpdate | Update
# CreateContainer: an adjustment, or (adjustment, updates), or (adjustment, updates, evictions).
CreateResult = (
    AdjustmentReply
    | tuple[AdjustmentReply, Sequence[UpdateReply]]
    | tuple[AdjustmentReply, Sequence[UpdateReply], Sequence[api.ContainerEviction]]
)


def _updates(updates: Iterable[UpdateReply] | None) -> list[api.ContainerUpdate]:
    return [u.message if isinstance(u, Update) else u for u in updates or ()]


class Plugin:
    """Override what the plugin needs; everything else is answered with an empty reply."""

    name: str = ""  # defaults for the stub; NRI_PLUGIN_NAME/IDX win for a launched plugin
    index: str = ""
    events: int | None = None  # an explicit mask; None: from the overridden methods

    def subscribed_events(self) -> int:
        if self.events is not None:
            return self.events
        cls = type(self)
        return event_mask(
            *(
                event
                for method, event in EVENT_METHODS.items()
                if getattr(cls, method) is not getattr(Plugin, method)
            )
        )

    # -- command line (run_plugin)
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add plugin-specific command-line options."""

    def apply_arguments(self, args: argparse.Namespace) -> None:
        """Take the parsed options (called before connecting)."""

    # -- lifecycle
    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        """`config` is the drop-in config text; setting `self.events` here still counts."""

    async def synchronize(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> Sequence[UpdateReply]:
        return []

    async def shutdown(self) -> None:
        pass

    # -- pod events
    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        pass

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        pass

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        pass

    async def update_pod_sandbox(
        self,
        pod: api.PodSandbox,
        overhead_resources: api.LinuxResources,
        resources: api.LinuxResources,
    ) -> None:
        pass

    async def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None:
        pass

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        """The pod's (ip, additional_ips), or None for no opinion (the #267 extension)."""
        return None

    # -- container events
    async def create_container(self, pod: api.PodSandbox, container: api.Container) -> CreateResult:
        """An adjustment (message or `Adjustment` builder), or (adjustment, updates of other
        containers[, evictions]), or None."""
        return None

    async def post_create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        pass

    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        pass

    async def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        pass

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[UpdateReply]:
        """Changes to this update (an update of `container` itself) and to other containers."""
        return []

    async def post_update_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        pass

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[UpdateReply]:
        """Updates of the remaining containers."""
        return []

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        pass

    async def validate_container_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> str | None:
        """A reason to reject the merged adjustment, or None to accept it."""
        return None


_M = TypeVar("_M", bound=Message)
_Handler = Callable[[bytes, RequestContext], Awaitable[bytes]]


def _parse(cls: type[_M], payload: bytes) -> _M:
    try:
        return cls.FromString(payload)
    except DecodeError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bad {cls.__name__}: {exc}") from exc


class Stub:
    """Connects a `Plugin` to the runtime and serves it; see the module docstring."""

    def __init__(
        self,
        plugin: Plugin,
        *,
        socket_path: str = DEFAULT_SOCKET_PATH,
        name: str | None = None,
        index: str | None = None,
        reconnect: bool = True,
        registration_timeout: float = REGISTRATION_TIMEOUT,
    ) -> None:
        self.plugin = plugin
        self.socket_path = socket_path
        self.name = name or os.environ.get(PLUGIN_NAME_ENV) or plugin.name
        self.index = index or os.environ.get(PLUGIN_IDX_ENV) or plugin.index
        self.reconnect = reconnect
        self.registration_timeout = registration_timeout
        if not _NAME.fullmatch(self.name):
            raise RegistrationError(f"invalid plugin name {self.name!r}")
        if not _INDEX.fullmatch(self.index):
            raise RegistrationError(f"invalid plugin index {self.index!r} (two digits)")
        if plugin.events is None and plugin.subscribed_events() == 0:
            raise RegistrationError(f"plugin {self.full_name} handles no events")
        self.registered = asyncio.Event()  # set while registered with a runtime
        self.runtime_name = ""
        self.runtime_version = ""
        self.request_timeout = 0.0  # seconds the runtime gives each call (from Configure)
        self._client: TtrpcClient | None = None
        self._sync_pods: list[api.PodSandbox] = []
        self._sync_containers: list[api.Container] = []

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"

    async def run(self) -> None:
        """Serve the plugin until the runtime goes away (launched) or until cancelled."""
        fd = os.environ.get(PLUGIN_SOCKET_ENV)
        if fd:
            try:
                sock = socket.socket(fileno=int(fd))
            except (ValueError, OSError) as exc:
                raise RegistrationError(f"invalid socket in {PLUGIN_SOCKET_ENV}={fd!r}") from exc
            log.info("%s: using the connection in %s=%s", self.full_name, PLUGIN_SOCKET_ENV, fd)
            if not await self._session(await SocketStream.from_socket(sock)):
                raise RegistrationError("could not register with the runtime")
            return
        delay = RECONNECT_MIN_DELAY
        while True:
            try:
                stream = await SocketStream.connect_unix(self.socket_path)
            except StreamError as exc:
                if not self.reconnect:
                    raise
                log.info("%s: cannot connect to %s: %s", self.full_name, self.socket_path, exc)
            else:
                if await self._session(stream):
                    delay = RECONNECT_MIN_DELAY
                if not self.reconnect:
                    return
                log.info("%s: connection to the runtime lost; reconnecting", self.full_name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)

    async def update_containers(
        self,
        updates: Iterable[UpdateReply],
        evictions: Iterable[api.ContainerEviction] = (),
        *,
        timeout: float | None = None,
    ) -> list[api.ContainerUpdate]:
        """Unsolicited container updates; returns the ones the runtime failed to apply."""
        if self._client is None:
            raise TtrpcError(Code.UNAVAILABLE, "not connected to the runtime")
        request = api.UpdateContainersRequest(update=_updates(updates), evict=evictions)
        reply = await self._client.call(
            RUNTIME_SERVICE, "UpdateContainers", request.SerializeToString(), timeout=timeout
        )
        return list(_parse(api.UpdateContainersResponse, reply).failed)

    # -- one connection
    async def _session(self, stream: SocketStream) -> bool:
        """Serve one connection until it drops; True if registration succeeded."""
        mux = Mux(stream, name=f"nri plugin {self.full_name}")
        server = TtrpcServer(name=f"nri plugin {self.full_name}")
        server.register(PLUGIN_SERVICE, self._handlers())
        serving = asyncio.get_running_loop().create_task(
            server.serve(mux.conn(PLUGIN_SERVICE_CONN)), name=f"{mux.name} server"
        )
        client = TtrpcClient(mux.conn(RUNTIME_SERVICE_CONN), name=f"{mux.name} client")
        mux.start()
        try:
            request = api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index)
            log.info("%s: registering with the runtime", self.full_name)
            try:
                await client.call(
                    RUNTIME_SERVICE,
                    "RegisterPlugin",
                    request.SerializeToString(),
                    timeout=self.registration_timeout,
                )
            except TtrpcError as exc:
                if exc.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                    log.warning("%s: registration failed: %s", self.full_name, exc.message)
                    return False
                raise RegistrationError(f"runtime refused registration: {exc.message}") from exc
            self._client = client
            self.registered.set()
            await mux.wait_closed()
            if mux.error:
                log.warning("%s: connection failed: %s", self.full_name, mux.error)
            return True
        finally:
            self.registered.clear()
            self._client = None
            self._sync_pods, self._sync_containers = [], []
            await client.aclose()
            await mux.aclose()
            await server.aclose()
            await asyncio.wait([serving])

    def _handlers(self) -> dict[str, _Handler]:
        return {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "RunPodSandbox": self._run_pod_sandbox,
            "UpdatePodSandbox": self._update_pod_sandbox,
            "PostUpdatePodSandbox": self._post_update_pod_sandbox,
            "StopPodSandbox": self._stop_pod_sandbox,
            "RemovePodSandbox": self._remove_pod_sandbox,
            "PodSandboxStatus": self._pod_sandbox_status,
            "CreateContainer": self._create_container,
            "PostCreateContainer": self._post_create_container,
            "StartContainer": self._start_container,
            "PostStartContainer": self._post_start_container,
            "UpdateContainer": self._update_container,
            "PostUpdateContainer": self._post_update_container,
            "StopContainer": self._stop_container,
            "RemoveContainer": self._remove_container,
            "StateChange": self._state_change,
            "ValidateContainerAdjustment": self._validate_container_adjustment,
        }

    # -- handlers: payload in, payload out
    async def _configure(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.ConfigureRequest, payload)
        self.runtime_name, self.runtime_version = request.runtime_name, request.runtime_version
        self.request_timeout = request.request_timeout / 1000
        log.info(
            "%s: configuring for runtime %s/%s",
            self.full_name,
            request.runtime_name,
            request.runtime_version,
        )
        await self.plugin.configure(request.config, request.runtime_name, request.runtime_version)
        events = self.plugin.subscribed_events()
        if events & ~VALID_EVENTS:
            raise TtrpcError(Code.INTERNAL, f"invalid plugin events 0x{events:x}")
        log.info("%s: subscribing to events 0x%04x", self.full_name, events)
        return api.ConfigureResponse(events=events).SerializeToString()

    async def _synchronize(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.SynchronizeRequest, payload)
        self._sync_pods += request.pods
        self._sync_containers += request.containers
        if request.more:
            # An intermediate chunk: collect, answer with no updates and echo `more`.
            return api.SynchronizeResponse(more=True).SerializeToString()
        pods, containers = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        updates = await self.plugin.synchronize(pods, containers)
        return api.SynchronizeResponse(update=_updates(updates)).SerializeToString()

    async def _shutdown(self, payload: bytes, ctx: RequestContext) -> bytes:
        await self.plugin.shutdown()
        return b""

    async def _run_pod_sandbox(self, payload: bytes, ctx: RequestContext) -> bytes:
        await self.plugin.run_pod_sandbox(_parse(api.RunPodSandboxRequest, payload).pod)
        return b""

    async def _update_pod_sandbox(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.UpdatePodSandboxRequest, payload)
        await self.plugin.update_pod_sandbox(
            request.pod, request.overhead_linux_resources, request.linux_resources
        )
        return b""

    async def _post_update_pod_sandbox(self, payload: bytes, ctx: RequestContext) -> bytes:
        await self.plugin.post_update_pod_sandbox(
            _parse(api.PostUpdatePodSandboxRequest, payload).pod
        )
        return b""

    async def _stop_pod_sandbox(self, payload: bytes, ctx: RequestContext) -> bytes:
        await self.plugin.stop_pod_sandbox(_parse(api.StopPodSandboxRequest, payload).pod)
        return b""

    async def _remove_pod_sandbox(self, payload: bytes, ctx: RequestContext) -> bytes:
        await self.plugin.remove_pod_sandbox(_parse(api.RemovePodSandboxRequest, payload).pod)
        return b""

    async def _pod_sandbox_status(self, payload: bytes, ctx: RequestContext) -> bytes:
        status = await self.plugin.pod_sandbox_status(
            _parse(api.PodSandboxStatusRequest, payload).pod
        )
        if status is None:
            return b""
        ip, additional = status
        return api.PodSandboxStatusResponse(ip=ip, additional_ips=additional).SerializeToString()

    async def _create_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.CreateContainerRequest, payload)
        result = await self.plugin.create_container(request.pod, request.container)
        adjust: AdjustmentReply
        updates: Sequence[UpdateReply] = ()
        evictions: Sequence[api.ContainerEviction] = ()
        if isinstance(result, tuple):
            adjust, updates, *rest = result
            evictions = rest[0] if rest else ()
        else:
            adjust = result
        if isinstance(adjust, Adjustment):
            adjust = adjust.message
        reply = api.CreateContainerResponse(
            adjust=adjust, update=_updates(updates), evict=evictions
        )
        return reply.SerializeToString()

    async def _post_create_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.PostCreateContainerRequest, payload)
        await self.plugin.post_create_container(request.pod, request.container)
        return b""

    async def _start_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.StartContainerRequest, payload)
        await self.plugin.start_container(request.pod, request.container)
        return b""

    async def _post_start_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.PostStartContainerRequest, payload)
        await self.plugin.post_start_container(request.pod, request.container)
        return b""

    async def _update_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.UpdateContainerRequest, payload)
        updates = await self.plugin.update_container(
            request.pod, request.container, request.linux_resources
        )
        return api.UpdateContainerResponse(update=_updates(updates)).SerializeToString()

    async def _post_update_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.PostUpdateContainerRequest, payload)
        await self.plugin.post_update_container(request.pod, request.container)
        return b""

    async def _stop_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.StopContainerRequest, payload)
        updates = await self.plugin.stop_container(request.pod, request.container)
        return api.StopContainerResponse(update=_updates(updates)).SerializeToString()

    async def _remove_container(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.RemoveContainerRequest, payload)
        await self.plugin.remove_container(request.pod, request.container)
        return b""

    async def _state_change(self, payload: bytes, ctx: RequestContext) -> bytes:
        """The pre-v0.12 path for events without results, dispatched as the Go stub does."""
        request = _parse(api.StateChangeEvent, payload)
        plugin, pod, container, event = (
            self.plugin,
            request.pod,
            request.container,
            request.event,
        )
        if event == api.RUN_POD_SANDBOX:
            await plugin.run_pod_sandbox(pod)
        elif event == api.STOP_POD_SANDBOX:
            await plugin.stop_pod_sandbox(pod)
        elif event == api.REMOVE_POD_SANDBOX:
            await plugin.remove_pod_sandbox(pod)
        elif event == api.POST_UPDATE_POD_SANDBOX:
            await plugin.post_update_pod_sandbox(pod)
        elif event == api.POST_CREATE_CONTAINER:
            await plugin.post_create_container(pod, container)
        elif event == api.START_CONTAINER:
            await plugin.start_container(pod, container)
        elif event == api.POST_START_CONTAINER:
            await plugin.post_start_container(pod, container)
        elif event == api.POST_UPDATE_CONTAINER:
            await plugin.post_update_container(pod, container)
        elif event == api.REMOVE_CONTAINER:
            await plugin.remove_container(pod, container)
        else:
            # Events with results always had their own RPC; nothing to do for them here.
            log.debug("%s: ignoring StateChange for event %d", self.full_name, event)
        return b""

    async def _validate_container_adjustment(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = _parse(api.ValidateContainerAdjustmentRequest, payload)
        reason = await self.plugin.validate_container_adjustment(request)
        if reason is None:
            return b""
        return api.ValidateContainerAdjustmentResponse(
            reject=True, reason=reason
        ).SerializeToString()


# ----------------------------------------------------------------------------- main


def run_plugin(plugin: Plugin, argv: Sequence[str] | None = None) -> int:
    """A plugin's `main`: parse options, run the stub until SIGTERM/SIGINT or disconnection."""
    parser = argparse.ArgumentParser(description=f"NRI plugin {plugin.name or type(plugin)}")
    parser.add_argument("--socket", default=DEFAULT_SOCKET_PATH, help="NRI socket to dial")
    parser.add_argument("--name", help="plugin name (default: $NRI_PLUGIN_NAME or built in)")
    parser.add_argument("--idx", help="two-digit plugin index (default: $NRI_PLUGIN_IDX)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info)",
    )
    plugin.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    plugin.apply_arguments(args)
    try:
        stub = Stub(plugin, socket_path=args.socket, name=args.name, index=args.idx)
    except RegistrationError as exc:
        log.error("%s", exc)
        return 2
    try:
        return aio_loop.run(_main(stub))
    except (RegistrationError, StreamError) as exc:
        log.error("%s: %s", stub.full_name, exc)
        return 1


async def _main(stub: Stub) -> int:
    """Run the stub; a signal cancels it and counts as a clean exit."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(stub.run(), name=f"nri plugin {stub.full_name}")
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
    try:
        await task
    except asyncio.CancelledError:
        if not stopped:
            raise
        log.info("%s: stopped by signal", stub.full_name)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return 0
