"""The runtime side of NRI: the plugin registry and event fan-out (containerd/nri
`pkg/adaptation`, reference §6).

`Adaptation.start()` launches the pre-installed plugins (`launcher`), then listens for external
ones. Each plugin connection is a mux (`podgate.aio.nrimux`): the runtime calls the plugin's
`Plugin` service on ConnID 1 and serves `Runtime` (RegisterPlugin, UpdateContainers) on ConnID 2.
A plugin registers within the registration timeout, is configured (its event mask checked), is
synchronized with every pod and container — split into `more=true` chunks when one message
would be too big — and then joins the list, sorted by index then name.

Events go to the subscribed plugins one by one in that order, each call bounded by the request
timeout; for events that once travelled as `StateChange`, the dedicated RPC goes first and an
UNIMPLEMENTED answer is re-sent as `StateChange` (plugins built with older stubs). A plugin that
times out or whose connection is gone or garbled is dropped (SIGKILLed if we launched it) and
the event carries on as if it had answered nothing; any other error fails the event with
`NriError` — except StopPodSandbox, whose errors are only logged. One lock covers event delivery
and the synchronization of a newly registered plugin, so a plugin misses no event between its
Synchronize and its first event (upstream's `BlockPluginSync`).

Container updates and evictions a plugin asks for — unsolicited (UpdateContainers), in its
Synchronize, CreateContainer, UpdateContainer or StopContainer reply — are merged per container
with the adjustment ownership rules and handed to the runtime's `UpdateHandler`, which answers
with the updates that failed. A runtime that cannot update containers raises
`UpdatesNotSupportedError`: the plugin's UpdateContainers call gets that error back, a
synchronizing plugin is refused, a CreateContainer or UpdateContainer fails (unless every
update asked to ignore failure), and a StopContainer goes on with the error logged.

Where podgate differs from containerd, on purpose:
- UNIMPLEMENTED from a plugin for PodSandboxStatus or ValidateContainerAdjustment counts as an
  empty answer: a plugin that subscribed to everything (mask 0) with an older stub gets these
  newer events too.
- Validators are asked one after another in index order (upstream asks them concurrently).
- A StopPodSandbox error is logged and the remaining plugins still get the event (containerd's
  loop stops at the first error, and the runtime only logs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from podgate.aio.errors import StreamError
from podgate.aio.nrimux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from podgate.aio.streams import SocketStream, start_unix_server
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcClosedError, TtrpcServer
from podgate.nri import api_pb2 as api
from podgate.nri.launcher import LaunchedProcess, PluginSpec, discover, plugin_config
from podgate.nri.merge import (
    VALID_EVENTS,
    AdjustmentMerger,
    ConflictError,
    MergeResult,
    NriError,
    UpdateCollector,
    aggregate_pod_ips,
    event_mask,
    subscribed,
)
from podgate.oci.cdi import DEFAULT_SPEC_DIRS as DEFAULT_CDI_SPEC_DIRS
from podgate.proto.ttrpc import Code, OversizedMessageError, TtrpcError, code_name

__all__ = [
    "DEFAULT_PLUGIN_CONFIG_PATH",
    "DEFAULT_PLUGIN_PATH",
    "DEFAULT_SOCKET_PATH",
    "NRI_VERSION",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "Adaptation",
    "ConflictError",
    "NriConfig",
    "NriError",
    "PluginConnection",
    "SyncFn",
    "UpdateHandler",
    "UpdatesNotSupportedError",
]

log = logging.getLogger(__name__)

DEFAULT_SOCKET_PATH = "/var/run/nri/nri.sock"
DEFAULT_PLUGIN_PATH = "/opt/nri/plugins"
DEFAULT_PLUGIN_CONFIG_PATH = "/etc/nri/conf.d"
# Seconds; upstream's defaults (api.DefaultPluginRegistrationTimeout / RequestTimeout).
DEFAULT_REGISTRATION_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 2.0
SOCKET_DIR_MODE = 0o700  # the socket's directory: only root may connect, as upstream
SOCKET_MODE = 0o600
NRI_VERSION = "v0.12.0"  # the upstream API level we speak (dedicated RPCs + StateChange)
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
# Fewest objects per Synchronize chunk and the largest share of the rejected size a retry may
# use (upstream's recalcObjsPerSyncMsg): a message is cut down by maxLen/msgLen, at most 0.9.
MIN_SYNC_OBJECTS = 8
MAX_SYNC_SHRINK = 0.9
# Seconds stop() waits for the tasks serving plugin connections once they are closed.
STOP_GRACE = 5.0

_PLUGIN_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_PLUGIN_IDX = re.compile(r"[0-9]{2}")
_OVERSIZE = re.compile(r"message length (\d+) exceed maximum message size of (\d+)")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

SyncFn = Callable[[], tuple[list[api.PodSandbox], list[api.Container]]]


class UpdatesNotSupportedError(NriError):
    """The runtime cannot change a container's resources or evict it (yet)."""


class UpdateHandler(Protocol):
    """Where plugins' container updates go: the runtime applies them (upstream's UpdateFn and
    EvictFn)."""

    async def update_containers(
        self, updates: Sequence[api.ContainerUpdate]
    ) -> list[api.ContainerUpdate]:
        """Apply the updates; return the ones that failed. UpdatesNotSupportedError when the
        runtime cannot update containers at all."""
        ...

    async def evict_containers(self, evictions: Sequence[api.ContainerEviction]) -> None: ...


class _NoUpdates:
    """The handler until the runtime installs one."""

    async def update_containers(
        self, updates: Sequence[api.ContainerUpdate]
    ) -> list[api.ContainerUpdate]:
        raise UpdatesNotSupportedError("container updates are not supported by this runtime")

    async def evict_containers(self, evictions: Sequence[api.ContainerEviction]) -> None:
        raise UpdatesNotSupportedError("container eviction is not supported by this runtime")


_Reply = TypeVar("_Reply", bound=Message)


@dataclass(slots=True)
class NriConfig:
    """containerd's `[plugins.'io.containerd.nri.v1.nri']`, plus podgate's additions."""

    socket_path: str = DEFAULT_SOCKET_PATH
    plugin_path: str = DEFAULT_PLUGIN_PATH
    plugin_config_path: str = DEFAULT_PLUGIN_CONFIG_PATH
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT  # seconds
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # seconds, per plugin call
    disable_connections: bool = False  # no listener: pre-installed plugins only
    enabled: bool = True
    # Where launched plugins' stdout/stderr go, as <log_dir>/<NN-name>.log; "" = our log.
    plugin_log_dir: str = ""
    # Plugins launched like pre-installed ones without a plugin dir: (idx, name, argv); argv[0]
    # must be absolute (the plugin's environment has no PATH).
    builtin: list[tuple[str, str, list[str]]] = field(default_factory=list)
    # Where CDI device specs are read for plugins' CDI device adjustments (in priority order).
    cdi_spec_dirs: list[str] = field(default_factory=lambda: list(DEFAULT_CDI_SPEC_DIRS))


# (event, dedicated method, StateChange fallback?) for the notification-only events.
_RUN_POD_SANDBOX = (api.RUN_POD_SANDBOX, "RunPodSandbox")
_STOP_POD_SANDBOX = (api.STOP_POD_SANDBOX, "StopPodSandbox")
_REMOVE_POD_SANDBOX = (api.REMOVE_POD_SANDBOX, "RemovePodSandbox")
_POST_UPDATE_POD_SANDBOX = (api.POST_UPDATE_POD_SANDBOX, "PostUpdatePodSandbox")
_POST_CREATE_CONTAINER = (api.POST_CREATE_CONTAINER, "PostCreateContainer")
_START_CONTAINER = (api.START_CONTAINER, "StartContainer")
_POST_START_CONTAINER = (api.POST_START_CONTAINER, "PostStartContainer")
_POST_UPDATE_CONTAINER = (api.POST_UPDATE_CONTAINER, "PostUpdateContainer")
_REMOVE_CONTAINER = (api.REMOVE_CONTAINER, "RemoveContainer")


class _Dropped(Exception):
    """The plugin was dropped during the call; it answered nothing."""


class PluginConnection:
    """One plugin connection: registration state, its mux, ttrpc client and server, and the
    process when we launched it."""

    def __init__(
        self,
        adaptation: Adaptation,
        stream: SocketStream,
        *,
        spec: PluginSpec | None = None,
        process: LaunchedProcess | None = None,
    ) -> None:
        self._adaptation = adaptation
        self.external = spec is None
        self.idx = spec.idx if spec is not None else ""
        self.name = spec.name if spec is not None else ""
        self.config = spec.config if spec is not None else ""
        self.process = process
        self.events = 0
        # SO_PEERCRED names the process that made a socketpair (us): only an accepted
        # connection's peer pid says anything.
        self.peer_pid = _peer_pid(stream) if process is None else 0
        self.closed = False
        self.close_reason = ""
        self.done = asyncio.Event()  # set once closing has begun
        self.warned_state_change: set[str] = set()
        loop = asyncio.get_running_loop()
        self.registered: asyncio.Future[None] = loop.create_future()
        self._mux = Mux(stream, name=f"nri plugin {self.label}")
        self.client = TtrpcClient(
            self._mux.conn(PLUGIN_SERVICE_CONN), name=f"nri plugin {self.label} client"
        )
        self._server = TtrpcServer(name=f"nri runtime for {self.label}")
        self._server.register(
            RUNTIME_SERVICE,
            {"RegisterPlugin": self._register_plugin, "UpdateContainers": self._update_containers},
        )
        self._serving = loop.create_task(
            self._server.serve(self._mux.conn(RUNTIME_SERVICE_CONN)),
            name=f"nri runtime for {self.label}",
        )
        self._serving.add_done_callback(self._connection_ended)
        self._closer: asyncio.Task[None] | None = None
        self._mux.start()

    @property
    def full_name(self) -> str:
        return f"{self.idx}-{self.name}"

    @property
    def label(self) -> str:
        """For logs before and after registration, like upstream's qualifiedName."""
        kind = "external" if self.external else "pre-connected"
        idx = self.idx or "??"
        name = self.name or "plugin"
        return f"{kind}:{idx}-{name}[{self.pid or '?'}]"

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else self.peer_pid

    def __repr__(self) -> str:
        return f"<nri plugin {self.label} events=0x{self.events:x}>"

    # -- Runtime service (the plugin calls these)
    async def _register_plugin(self, payload: bytes, ctx: RequestContext) -> bytes:
        request = api.RegisterPluginRequest.FromString(payload)
        if self.registered.done():
            raise TtrpcError(Code.FAILED_PRECONDITION, "plugin already registered")
        if self.external:
            if not (
                _PLUGIN_NAME.fullmatch(request.plugin_name)
                and _PLUGIN_IDX.fullmatch(request.plugin_idx)
            ):
                message = (
                    f"invalid plugin name/index: name {request.plugin_name!r}, "
                    f"index {request.plugin_idx!r}"
                )
                self.registered.set_exception(NriError(message))
                raise TtrpcError(Code.INVALID_ARGUMENT, message)
            self.idx, self.name = request.plugin_idx, request.plugin_name
        log.info(
            "nri: plugin %s registered as %s (NRI version %s)",
            self.label,
            self.full_name,
            request.NRI_version or "unknown",
        )
        self.registered.set_result(None)
        return b""

    async def _update_containers(self, payload: bytes, ctx: RequestContext) -> bytes:
        """Unsolicited updates and evictions, merged like a reply's and handed to the runtime;
        a runtime that cannot apply them answers the plugin with that error."""
        request = api.UpdateContainersRequest.FromString(payload)
        if not self.registered.done() or self.registered.exception() is not None:
            raise TtrpcError(Code.FAILED_PRECONDITION, "plugin not registered")
        try:
            failed = await self._adaptation._unsolicited(self, request)
        except UpdatesNotSupportedError as exc:
            log.warning("nri: plugin %s asked for container updates: %s", self.full_name, exc)
            raise TtrpcError(Code.UNIMPLEMENTED, str(exc)) from exc
        except NriError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, str(exc)) from exc
        return api.UpdateContainersResponse(failed=failed).SerializeToString()

    # -- lifecycle
    def _connection_ended(self, _task: asyncio.Task[None]) -> None:
        if not self.closed:
            self._adaptation._plugin_lost(self, "connection closed")

    def close(self, reason: str) -> asyncio.Task[None]:
        """Close the connection and kill the process, once; returns the task doing it."""
        if self._closer is None:
            self.closed = True
            self.close_reason = reason
            self.done.set()
            self._adaptation._closing(self)
            if not self.registered.done():
                self.registered.set_exception(NriError(f"plugin connection closed: {reason}"))
                self.registered.exception()  # retrieved: nobody may be waiting any more
            self._closer = asyncio.get_running_loop().create_task(
                self._close(), name=f"nri close {self.label}"
            )
        return self._closer

    async def _close(self) -> None:
        if self.process is not None:
            self.process.kill()  # first, so it acts on nothing more
        await self.client.aclose()
        await self._server.aclose()
        await self._mux.aclose()
        if self._serving is not asyncio.current_task():
            await asyncio.wait([self._serving])
        if self.process is not None:
            await self.process.aclose()
        self._adaptation._closed(self)

    # -- calls
    async def call(
        self, method: str, request: Message, reply_type: type[_Reply], timeout: float
    ) -> _Reply:
        data = await self.client.call(
            PLUGIN_SERVICE, method, request.SerializeToString(), timeout=timeout
        )
        try:
            return reply_type.FromString(data)
        except DecodeError as exc:
            raise _ProtocolError(f"undecodable {method} reply: {exc}") from exc


class _ProtocolError(Exception):
    """The plugin's answer is not a message of the expected type (upstream's ErrProtocol)."""


def _peer_pid(stream: SocketStream) -> int:
    sock = stream.transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return 0
    try:
        pid, _, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return 0
    return int(pid)


def _is_fatal(exc: BaseException) -> bool:
    """Errors that drop the plugin instead of failing the event: a timeout, a connection that
    is gone, or garbage from the plugin (upstream's ErrClosed/ErrProtocol/DeadlineExceeded)."""
    if isinstance(exc, TtrpcClosedError | _ProtocolError | StreamError):
        return True
    return isinstance(exc, TtrpcError) and exc.code == Code.DEADLINE_EXCEEDED


def _oversize(exc: TtrpcError) -> tuple[int, int] | None:
    """(rejected length, limit) of a RESOURCE_EXHAUSTED for an oversized message, ours or the
    plugin's."""
    if exc.code != Code.RESOURCE_EXHAUSTED:
        return None
    cause = exc.__cause__
    if isinstance(cause, OversizedMessageError):
        return cause.length, cause.limit
    match = _OVERSIZE.search(exc.message)
    return (int(match[1]), int(match[2])) if match else None


class Adaptation:
    """The runtime's NRI: see the module docstring."""

    def __init__(
        self,
        config: NriConfig,
        *,
        runtime_name: str,
        runtime_version: str,
        sync: SyncFn,
        updates: UpdateHandler | None = None,
    ) -> None:
        self.config = config
        self.update_handler: UpdateHandler = updates if updates is not None else _NoUpdates()
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self._sync = sync
        self._plugins: list[PluginConnection] = []  # registered and synchronized, sorted
        self._connections: set[PluginConnection] = set()  # every open connection, registered or not
        self._handlers: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # event delivery vs. synchronizing a new plugin
        self._server: asyncio.Server | None = None
        self._started = False
        self._stopping = False

    @property
    def plugins(self) -> list[PluginConnection]:
        """Registered plugins in invocation order (index, then name)."""
        return list(self._plugins)

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        """Launch pre-installed plugins, then listen for external ones.

        Discovery errors (a badly named plugin file) fail the start; a plugin that fails to
        launch, register, configure or synchronize is logged and left out.
        """
        if not self.config.enabled or self._started:
            return
        self._started = True
        conf_dir = self.config.plugin_config_path
        specs = [
            PluginSpec(idx, name, tuple(argv), plugin_config(conf_dir, idx, name))
            for idx, name, argv in self.config.builtin
        ]
        specs += discover(self.config.plugin_path, self.config.plugin_config_path)
        try:
            launched = await asyncio.gather(*(self._launch(spec) for spec in specs))
            for plugin in sorted(
                (p for p in launched if p is not None), key=lambda p: (p.idx, p.name)
            ):
                try:
                    await self._join(plugin)
                except NriError as exc:
                    log.warning("nri: failed to start plugin %s: %s", plugin.full_name, exc)
                    await plugin.close(str(exc))
            if not self.config.disable_connections:
                await self._listen()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop listening, close every plugin connection, SIGKILL and reap launched plugins."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        closers = [plugin.close("runtime shutting down") for plugin in list(self._connections)]
        if closers:
            await asyncio.wait(closers)
        self._plugins.clear()
        handlers = [task for task in self._handlers if task is not asyncio.current_task()]
        if handlers:
            _, pending = await asyncio.wait(handlers, timeout=STOP_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def __aenter__(self) -> Adaptation:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _listen(self) -> None:
        _make_socket_dir(self.config.socket_path)
        self._server = await start_unix_server(
            self._serve_external, self.config.socket_path, mode=SOCKET_MODE
        )
        log.info("nri: listening for plugins on %s", self.config.socket_path)

    async def _launch(self, spec: PluginSpec) -> PluginConnection | None:
        """Start a pre-installed plugin and wait for it to register and be configured."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with child:
                process = LaunchedProcess.spawn(
                    spec, child.fileno(), log_dir=self.config.plugin_log_dir
                )
            stream = await SocketStream.from_socket(parent)
        except Exception as exc:
            parent.close()
            log.warning("nri: failed to launch plugin %s: %s", spec.full_name, exc)
            return None
        plugin = PluginConnection(self, stream, spec=spec, process=process)
        try:
            await self._handshake(plugin)
        except NriError as exc:
            log.warning("nri: failed to start plugin %s: %s", spec.full_name, exc)
            await plugin.close(str(exc))
            return None
        return plugin

    async def _serve_external(self, stream: SocketStream) -> None:
        """One external plugin connection, for as long as it lasts."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        plugin: PluginConnection | None = None
        try:
            if self._stopping:
                return
            plugin = PluginConnection(self, stream)
            try:
                await self._handshake(plugin)
                await self._join(plugin)
            except NriError as exc:
                log.warning("nri: failed to start plugin %s: %s", plugin.label, exc)
                await plugin.close(str(exc))
                return
            await plugin.done.wait()
        finally:
            if plugin is not None:
                await plugin.close("connection closed")
            self._handlers.discard(task)

    async def _handshake(self, plugin: PluginConnection) -> None:
        """Registration within the registration timeout, then Configure."""
        self._connections.add(plugin)
        try:
            async with asyncio.timeout(self.config.registration_timeout):
                await asyncio.shield(plugin.registered)
        except TimeoutError:
            raise NriError("plugin registration timed out") from None
        request = api.ConfigureRequest(
            config=plugin.config,
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
            registration_timeout=int(self.config.registration_timeout * 1000),
            request_timeout=int(self.config.request_timeout * 1000),
            NRI_version=NRI_VERSION,
        )
        try:
            reply = await plugin.call(
                "Configure", request, api.ConfigureResponse, self.config.request_timeout
            )
        except (TtrpcError, _ProtocolError) as exc:
            raise NriError(f"failed to configure plugin: {exc}") from exc
        plugin.events = event_mask(reply.events)

    async def _join(self, plugin: PluginConnection) -> None:
        """Synchronize under the lock, then add to the list: no event slips between."""
        async with self._lock:
            if plugin.closed:
                raise NriError(f"plugin closed before synchronizing: {plugin.close_reason}")
            try:
                pods, containers = self._sync()
            except Exception as exc:
                raise NriError(f"failed to collect pods and containers: {exc}") from exc
            try:
                updates = await self._synchronize(plugin, pods, containers)
            except (TtrpcError, _ProtocolError) as exc:
                raise NriError(f"failed to synchronize plugin: {exc}") from exc
            if updates:
                collector = UpdateCollector()
                collector.add(plugin.full_name, updates)
                failed = await self.update_handler.update_containers(collector.updates())
                if failed:
                    raise NriError(f"failed to update {len(failed)} containers while synchronizing")
            self._plugins.append(plugin)
            self._plugins.sort(key=lambda p: (p.idx, p.name))
            log.info(
                "nri: plugin %s synchronized (%d pods, %d containers), events 0x%04x",
                plugin.full_name,
                len(pods),
                len(containers),
                plugin.events,
            )
        log.info(
            "nri: plugin %s ready, events 0x%x%s",
            plugin.full_name,
            plugin.events,
            "" if plugin.events != VALID_EVENTS else " (all)",
        )

    async def _synchronize(
        self,
        plugin: PluginConnection,
        pods: Sequence[api.PodSandbox],
        containers: Sequence[api.Container],
    ) -> list[api.ContainerUpdate]:
        """Synchronize, split into `more=true` chunks while a message is too big; the whole
        exchange shares one request timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout
        pods_left, ctrs_left = list(pods), list(containers)
        pods_per_msg, ctrs_per_msg = len(pods_left), len(ctrs_left)
        while True:
            more = len(pods_left) > pods_per_msg or len(ctrs_left) > ctrs_per_msg
            request = api.SynchronizeRequest(
                pods=pods_left[:pods_per_msg], containers=ctrs_left[:ctrs_per_msg], more=more
            )
            remaining = deadline - loop.time()
            try:
                reply = await plugin.call(
                    "Synchronize", request, api.SynchronizeResponse, remaining
                )
            except TtrpcError as exc:
                sizes = _oversize(exc)
                if sizes is None:
                    raise
                pods_per_msg, ctrs_per_msg = _shrink(pods_per_msg, ctrs_per_msg, *sizes)
                log.debug("nri: Synchronize too large for %s; splitting", plugin.full_name)
                continue
            if not more:
                return list(reply.update)
            if reply.update or reply.more != more:
                raise NriError("plugin does not handle split sync requests")
            pods_left, ctrs_left = pods_left[pods_per_msg:], ctrs_left[ctrs_per_msg:]
            pods_per_msg = min(pods_per_msg, len(pods_left))
            ctrs_per_msg = min(ctrs_per_msg, len(ctrs_left))

    # ------------------------------------------------------------------ plugin bookkeeping
    def _plugin_lost(self, plugin: PluginConnection, reason: str) -> None:
        """The plugin's connection ended on its own."""
        if not self._stopping and plugin.registered.done():
            log.warning("nri: dropping plugin %s: %s", plugin.full_name, reason)
        plugin.close(reason)

    def _drop(self, plugin: PluginConnection, reason: str) -> None:
        log.warning("nri: dropping plugin %s: %s", plugin.full_name, reason)
        plugin.close(reason)

    def _closing(self, plugin: PluginConnection) -> None:
        """A plugin started closing: it gets no more events."""
        with contextlib.suppress(ValueError):
            self._plugins.remove(plugin)

    def _closed(self, plugin: PluginConnection) -> None:
        self._connections.discard(plugin)

    def _subscribers(self, event: int) -> list[PluginConnection]:
        return [p for p in self._plugins if not p.closed and subscribed(p.events, event)]

    async def _request(
        self,
        plugin: PluginConnection,
        method: str,
        request: Message,
        reply_type: type[_Reply],
        *,
        state_change: api.StateChangeEvent | None = None,
        unimplemented_ok: bool = False,
    ) -> _Reply:
        """One call within the request timeout. UNIMPLEMENTED goes on as StateChange when the
        event has that form (within the same timeout); fatal errors drop the plugin and raise
        _Dropped; any other error raises NriError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout
        try:
            try:
                return await plugin.call(method, request, reply_type, self.config.request_timeout)
            except TtrpcError as exc:
                if exc.code != Code.UNIMPLEMENTED:
                    raise
                if unimplemented_ok:
                    return reply_type()
                if state_change is None:
                    raise
            await plugin.call("StateChange", state_change, api.Empty, deadline - loop.time())
            if method not in plugin.warned_state_change:
                plugin.warned_state_change.add(method)
                log.info(
                    "nri: plugin %s has no %s RPC; using the deprecated StateChange",
                    plugin.full_name,
                    method,
                )
            return reply_type()
        except (TtrpcError, _ProtocolError, StreamError) as exc:
            if _is_fatal(exc):
                self._drop(plugin, f"{method}: {self._describe(exc)}")
                raise _Dropped from exc
            raise NriError(
                f"plugin {plugin.full_name} failed {method}: {self._describe(exc)}"
            ) from exc

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, TtrpcError):
            if exc.code == Code.DEADLINE_EXCEEDED:
                return f"no answer within {self.config.request_timeout:g} s"
            if isinstance(exc, TtrpcClosedError):
                return exc.message
            return f"{code_name(exc.code)}: {exc.message}"
        return str(exc)

    async def _notify(
        self,
        event_method: tuple[api.Event.ValueType, str],
        request: Message,
        reply_type: type[Message],
        pod: api.PodSandbox,
        container: api.Container | None = None,
        *,
        errors_only_logged: bool = False,
    ) -> None:
        event, method = event_method
        state_change = api.StateChangeEvent(event=event, pod=pod)
        if container is not None:
            state_change.container.CopyFrom(container)
        async with self._lock:
            for plugin in self._subscribers(event):
                try:
                    await self._request(
                        plugin, method, request, reply_type, state_change=state_change
                    )
                except _Dropped:
                    continue
                except NriError as exc:
                    if not errors_only_logged:
                        raise
                    log.error("nri: %s", exc)

    # ------------------------------------------------------------------ pod events
    async def run_pod_sandbox(
        self, pod: api.PodSandbox, *, network: bool = False
    ) -> tuple[str, list[str]]:
        """RunPodSandbox to every subscriber in index order.

        With `network` (pod networking belongs to NRI plugins) each plugin that answers
        PodSandboxStatus is asked for the pod's IPs right after its RunPodSandbox, and later
        plugins get the pod with the IPs found so far — as containerd, which runs CNI before
        NRI's RunPodSandbox, hands every plugin the pod's IPs. Returns (ip, additional_ips),
        aggregated as `pod_sandbox_status` does; ("", []) without `network`."""
        if not network:
            await self._notify(
                _RUN_POD_SANDBOX, api.RunPodSandboxRequest(pod=pod), api.RunPodSandboxResponse, pod
            )
            return "", []
        current = api.PodSandbox()
        current.CopyFrom(pod)
        replies: list[api.PodSandboxStatusResponse] = []
        asked: set[PluginConnection] = set()
        async with self._lock:
            for plugin in self._subscribers(api.RUN_POD_SANDBOX):
                state_change = api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=current)
                request = api.RunPodSandboxRequest(pod=current)
                try:
                    await self._request(
                        plugin,
                        "RunPodSandbox",
                        request,
                        api.RunPodSandboxResponse,
                        state_change=state_change,
                    )
                    if subscribed(plugin.events, api.POD_SANDBOX_STATUS):
                        asked.add(plugin)
                        replies.append(await self._pod_status(plugin, current))
                except _Dropped:
                    continue
                ip, additional = aggregate_pod_ips(replies)
                current.ClearField("ips")
                current.ips.extend([ip, *additional] if ip else [])
            for plugin in self._subscribers(api.POD_SANDBOX_STATUS):
                if plugin not in asked:
                    with contextlib.suppress(_Dropped):
                        replies.append(await self._pod_status(plugin, current))
        return aggregate_pod_ips(replies)

    async def _pod_status(
        self, plugin: PluginConnection, pod: api.PodSandbox
    ) -> api.PodSandboxStatusResponse:
        return await self._request(
            plugin,
            "PodSandboxStatus",
            api.PodSandboxStatusRequest(pod=pod),
            api.PodSandboxStatusResponse,
            unimplemented_ok=True,
        )

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        """Errors are only logged (as containerd), and every subscriber still hears of it."""
        await self._notify(
            _STOP_POD_SANDBOX,
            api.StopPodSandboxRequest(pod=pod),
            api.StopPodSandboxResponse,
            pod,
            errors_only_logged=True,
        )

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await self._notify(
            _REMOVE_POD_SANDBOX,
            api.RemovePodSandboxRequest(pod=pod),
            api.RemovePodSandboxResponse,
            pod,
        )

    async def update_pod_sandbox(
        self,
        pod: api.PodSandbox,
        overhead: api.LinuxResources | None = None,
        resources: api.LinuxResources | None = None,
    ) -> None:
        request = api.UpdatePodSandboxRequest(pod=pod)
        if overhead is not None:
            request.overhead_linux_resources.CopyFrom(overhead)
        if resources is not None:
            request.linux_resources.CopyFrom(resources)
        async with self._lock:
            for plugin in self._subscribers(api.UPDATE_POD_SANDBOX):
                with contextlib.suppress(_Dropped):
                    await self._request(
                        plugin, "UpdatePodSandbox", request, api.UpdatePodSandboxResponse
                    )

    async def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None:
        await self._notify(
            _POST_UPDATE_POD_SANDBOX,
            api.PostUpdatePodSandboxRequest(pod=pod),
            api.PostUpdatePodSandboxResponse,
            pod,
        )

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]]:
        """(ip, additional_ips) from the plugins, aggregated as PR #267 revision 2."""
        request = api.PodSandboxStatusRequest(pod=pod)
        replies: list[api.PodSandboxStatusResponse] = []
        async with self._lock:
            for plugin in self._subscribers(api.POD_SANDBOX_STATUS):
                with contextlib.suppress(_Dropped):
                    replies.append(
                        await self._request(
                            plugin,
                            "PodSandboxStatus",
                            request,
                            api.PodSandboxStatusResponse,
                            unimplemented_ok=True,
                        )
                    )
        return aggregate_pod_ips(replies)

    # ------------------------------------------------------------------ container events
    async def create_container(self, pod: api.PodSandbox, container: api.Container) -> MergeResult:
        """Every subscriber's adjustment, merged; later plugins see earlier adjustments; then
        the validators. ConflictError when two plugins set the same thing, NriError when a
        validator rejects the result or a plugin fails. Updates of other containers that the
        plugins asked for are applied through the update handler once validation passed."""
        merger = AdjustmentMerger(container)
        collector = UpdateCollector(creating=container.id)
        async with self._lock:
            consulted = list(self._plugins)
            for plugin in self._subscribers(api.CREATE_CONTAINER):
                request = api.CreateContainerRequest(pod=pod, container=merger.container)
                try:
                    reply = await self._request(
                        plugin, "CreateContainer", request, api.CreateContainerResponse
                    )
                except _Dropped:
                    continue
                if reply.HasField("adjust"):
                    merger.apply(plugin.full_name, reply.adjust)
                collector.add(plugin.full_name, reply.update)
                collector.evict(reply.evict)
            result = merger.result()
            updates = collector.updates()
            owners = result.owners
            owners.owners.MergeFrom(collector.owners().owners)
            await self._validate(pod, container, result.adjust, updates, owners, consulted)
            await self._apply_updates(updates, collector.evictions, "CreateContainer")
        return result

    async def _apply_updates(
        self,
        updates: Sequence[api.ContainerUpdate],
        evictions: Sequence[api.ContainerEviction],
        during: str,
    ) -> None:
        """Hand merged updates to the runtime; a failed update fails the event unless it asked
        to have failures ignored (upstream's IgnoreFailure)."""
        if evictions:
            await self.update_handler.evict_containers(evictions)
        if not updates:
            return
        try:
            failed = await self.update_handler.update_containers(updates)
        except UpdatesNotSupportedError as exc:
            if all(update.ignore_failure for update in updates):
                log.warning(
                    "nri: ignoring %d container updates on %s: %s", len(updates), during, exc
                )
                return
            raise UpdatesNotSupportedError(f"{during}: {exc}") from exc
        fatal = [update.container_id for update in failed if not update.ignore_failure]
        if fatal:
            raise NriError(f"{during}: failed to update containers {', '.join(fatal)}")

    async def _unsolicited(
        self, plugin: PluginConnection, request: api.UpdateContainersRequest
    ) -> list[api.ContainerUpdate]:
        """A plugin's UpdateContainers: merged, then applied; returns what failed."""
        collector = UpdateCollector()
        collector.add(plugin.full_name, request.update)
        if request.evict:
            await self.update_handler.evict_containers(list(request.evict))
        updates = collector.updates()
        if not updates:
            return []
        return await self.update_handler.update_containers(updates)

    async def _validate(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        adjust: api.ContainerAdjustment,
        updates: Sequence[api.ContainerUpdate],
        owners: api.OwningPlugins,
        consulted: Sequence[PluginConnection],
    ) -> None:
        validators = self._subscribers(api.VALIDATE_CONTAINER_ADJUSTMENT)
        if not validators:
            return
        request = api.ValidateContainerAdjustmentRequest(
            pod=pod,
            container=container,
            adjust=adjust,
            update=updates,
            owners=owners,
            plugins=[api.PluginInstance(name=p.name, index=p.idx) for p in consulted],
        )
        for plugin in validators:
            try:
                reply = await self._request(
                    plugin,
                    "ValidateContainerAdjustment",
                    request,
                    api.ValidateContainerAdjustmentResponse,
                    unimplemented_ok=True,
                )
            except _Dropped:
                raise NriError(
                    f"validator plugin {plugin.full_name} failed: {plugin.close_reason}"
                ) from None
            if reply.reject:
                reason = reply.reason or "unknown rejection reason"
                raise NriError(
                    f'validator "{plugin.full_name}" rejected container adjustment, '
                    f"reason: {reason}"
                )

    async def post_create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._notify(
            _POST_CREATE_CONTAINER,
            api.PostCreateContainerRequest(pod=pod, container=container),
            api.PostCreateContainerResponse,
            pod,
            container,
        )

    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._notify(
            _START_CONTAINER,
            api.StartContainerRequest(pod=pod, container=container),
            api.StartContainerResponse,
            pod,
            container,
        )

    async def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._notify(
            _POST_START_CONTAINER,
            api.PostStartContainerRequest(pod=pod, container=container),
            api.PostStartContainerResponse,
            pod,
            container,
        )

    async def update_container(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        resources: api.LinuxResources | None = None,
    ) -> list[api.ContainerUpdate]:
        """The runtime is about to change `container`'s resources: plugins may alter that and
        ask for other updates. Returns the merged updates, the container's own first; the
        runtime applies them, then sends PostUpdateContainer."""
        request = api.UpdateContainerRequest(pod=pod, container=container)
        requested = api.ContainerUpdate(container_id=container.id)
        if resources is not None:
            request.linux_resources.CopyFrom(resources)
            requested.linux.resources.CopyFrom(resources)
        collector = UpdateCollector(requested=requested)
        async with self._lock:
            for plugin in self._subscribers(api.UPDATE_CONTAINER):
                try:
                    reply = await self._request(
                        plugin, "UpdateContainer", request, api.UpdateContainerResponse
                    )
                except _Dropped:
                    continue
                collector.add(plugin.full_name, reply.update)
                collector.evict(reply.evict)
            if collector.evictions:
                await self.update_handler.evict_containers(collector.evictions)
        return collector.updates()

    async def post_update_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._notify(
            _POST_UPDATE_CONTAINER,
            api.PostUpdateContainerRequest(pod=pod, container=container),
            api.PostUpdateContainerResponse,
            pod,
            container,
        )

    async def stop_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        """Plugins may ask for updates of the remaining containers; a failure to apply them is
        logged and the stop goes on."""
        collector = UpdateCollector()
        request = api.StopContainerRequest(pod=pod, container=container)
        async with self._lock:
            for plugin in self._subscribers(api.STOP_CONTAINER):
                try:
                    reply = await self._request(
                        plugin, "StopContainer", request, api.StopContainerResponse
                    )
                except _Dropped:
                    continue
                collector.add(plugin.full_name, reply.update)
            try:
                await self._apply_updates(collector.updates(), (), "StopContainer")
            except NriError as exc:
                log.warning("nri: %s", exc)

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._notify(
            _REMOVE_CONTAINER,
            api.RemoveContainerRequest(pod=pod, container=container),
            api.RemoveContainerResponse,
            pod,
            container,
        )


def _make_socket_dir(socket_path: str) -> None:
    """Create the socket's directory (mode 0700) if missing; an existing one is left alone, as
    upstream's MkdirAll does (it may be a shared directory)."""
    os.makedirs(os.path.dirname(os.path.abspath(socket_path)), mode=SOCKET_DIR_MODE, exist_ok=True)


def _shrink(pods: int, ctrs: int, length: int, limit: int) -> tuple[int, int]:
    """Objects per Synchronize message after one was `length` bytes against `limit`."""
    if pods + ctrs <= MIN_SYNC_OBJECTS or not 0 < limit < length:
        raise NriError("failed to synchronize plugin with split messages")
    factor = min(limit / length, MAX_SYNC_SHRINK)
    pods, ctrs = int(pods * factor), int(ctrs * factor)
    if pods + ctrs < MIN_SYNC_OBJECTS:
        pods = ctrs = MIN_SYNC_OBJECTS // 2
    return pods, ctrs
