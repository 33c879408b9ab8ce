"""`podgate runtime`: the CRI service, the streaming server and the runtime, in one process.

Stopping the daemon leaves pods and containers running (their holders and shims are not its
children); a restarted daemon picks them up from the state directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from podgate.aio.loop import wait_for_signal
from podgate.backends.agent import AgentBackend
from podgate.backends.base import Backend, Backends, BackendUnavailableError
from podgate.backends.exec import ExecBackend
from podgate.backends.netns import NetnsBackend
from podgate.images.config import FileConfig
from podgate.images.pull import Puller
from podgate.images.store import DEFAULT_MAX_LAYER_BYTES, ImageStore
from podgate.model import PodRecord
from podgate.nri.adaptation import Adaptation, NriConfig
from podgate.runtime.cri.service import serve_cri, stop_cri
from podgate.runtime.nri import RuntimeNri
from podgate.runtime.runtime import Runtime
from podgate.runtime.sandbox import lifecycle as sandbox
from podgate.runtime.store import state_socket
from podgate.runtime.streaming import DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS, StreamingServer
from podgate.runtime.target import RuntimeTarget

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = "/var/lib/podgate"
BACKEND_NAMES = ("netns", "agent", "exec")
# On SIGTERM streams in progress (exec sessions, forwarded connections) may go on this long
# after the servers stop accepting; then they are cut, seconds.
SHUTDOWN_DRAIN_SECONDS = 5.0


def default_backends() -> dict[str, list[str]]:
    """Port-forward backends per runtime handler, tried in order ("" = every other handler)."""
    return {"": ["netns"], sandbox.HANDLER: ["agent", "exec"]}


def parse_backend_options(values: Sequence[str]) -> dict[str, list[str]]:
    """`HANDLER=NAME[,NAME...]` options over the defaults; ValueError says what is wrong."""
    chosen = default_backends()
    for value in values:
        handler, sep, names_text = value.partition("=")
        names = [n.strip() for n in names_text.split(",") if n.strip()]
        if not sep or not names:
            raise ValueError(f"--backend {value!r}: want HANDLER=NAME[,NAME...]")
        unknown = [n for n in names if n not in BACKEND_NAMES]
        if unknown:
            raise ValueError(f"--backend {value!r}: unknown backend {unknown[0]!r}")
        chosen[handler.strip()] = names
    return chosen


@dataclass(slots=True)
class RuntimeConfig:
    state_dir: str = DEFAULT_STATE_DIR
    cri_socket: str = ""  # default: <state_dir>/cri.sock
    stream_address: str = "127.0.0.1"
    stream_port: int = 0
    stream_socket: str = ""  # a unix socket instead of TCP
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS
    backends: dict[str, list[str]] = field(default_factory=default_backends)
    nri: NriConfig | None = None  # None: no NRI at all
    nri_network: bool = False  # NRI plugins own pod networking (else loopback only)
    file: FileConfig = field(default_factory=FileConfig)  # `--config FILE`: images, registries
    oci_runtime: str = "runc"  # the OCI runtime binary for containers with a root

    @property
    def cri_socket_path(self) -> str:
        return self.cri_socket or state_socket(self.state_dir, "cri.sock")


@dataclass(slots=True)
class RunningRuntime:
    runtime: Runtime
    images: ImageStore
    target: RuntimeTarget
    streaming: StreamingServer
    cri_socket: str


@contextlib.asynccontextmanager
async def running_runtime(config: RuntimeConfig) -> AsyncIterator[RunningRuntime]:
    """Start everything; stop the servers (not the pods) on exit."""
    runtime = Runtime(config.state_dir, config.oci_runtime)
    runtime.load()
    await runtime.forker.start()  # so the first container does not wait for it
    # Loading the image store also removes what an interrupted pull or import left behind.
    images = await asyncio.to_thread(
        ImageStore,
        config.state_dir,
        config.file.images.max_layer_bytes or DEFAULT_MAX_LAYER_BYTES,
    )
    runtime.images = images
    stale = await asyncio.to_thread(images.release_unknown, runtime.containers)
    if stale:
        log.info("released the image leases of %d containers that do not exist", len(stale))
    puller = Puller(
        images,
        config.file.registries,
        max_concurrent_downloads=config.file.images.max_concurrent_downloads,
    )
    netns = NetnsBackend()

    async def restart_shim(pod: PodRecord) -> None:
        try:
            run_dir = runtime.store.run_path(pod.id)
            if await sandbox.ensure_shim(pod, run_dir, runtime.forker.spawn):
                runtime.store.save_pod(pod)
        except sandbox.SandboxError as exc:
            raise BackendUnavailableError(str(exc)) from exc

    agent = AgentBackend(runtime.store.run_path, restart_shim)
    known: dict[str, Backend] = {"netns": netns, "agent": agent, "exec": ExecBackend(runtime)}
    chains = {h: [known[n] for n in names] for h, names in config.backends.items()}
    target = RuntimeTarget(runtime, Backends(chains.pop("", [netns]), chains))
    streaming = StreamingServer(
        target,
        host=config.stream_address,
        port=config.stream_port,
        unix_path=config.stream_socket or None,
        idle_timeout=config.stream_idle_timeout,
    )
    await streaming.start()
    runtime.streaming = streaming
    adaptation = None
    if config.nri is not None:
        adaptation = Adaptation(
            config.nri,
            runtime_name=Runtime.name,
            runtime_version=Runtime.version,
            sync=lambda: runtime_nri.snapshot(runtime.list_pods(), runtime.list_containers()),
        )
        runtime_nri = RuntimeNri(
            adaptation,
            network=config.nri_network,
            runc=runtime.oci.binary,
            cdi_spec_dirs=config.nri.cdi_spec_dirs,
        )
        adaptation.update_handler = runtime_nri  # plugins' container updates reach the runtime
        runtime_nri.updater = runtime
        runtime.nri = runtime_nri
        await adaptation.start()
        log.info("NRI on unix://%s", config.nri.socket_path)
    cri = await serve_cri(runtime, config.cri_socket_path, images=images, puller=puller)
    log.info("CRI on unix://%s, streaming on %s", config.cri_socket_path, streaming.base_url)
    try:
        yield RunningRuntime(runtime, images, target, streaming, config.cri_socket_path)
    finally:
        await runtime.events.aclose()  # event streams end cleanly, before the server stops
        await stop_cri(cri, config.cri_socket_path)
        await puller.aclose()
        if adaptation is not None:
            runtime.nri = None
            await adaptation.stop()
        await streaming.stop(SHUTDOWN_DRAIN_SECONDS)
        await agent.aclose()
        netns.close()
        netns.worker.close()
        runtime.close()


async def run_daemon(config: RuntimeConfig) -> None:
    async with running_runtime(config) as running:
        print(
            f"podgate runtime ready cri=unix://{running.cri_socket} "
            f"streaming={running.streaming.base_url} state={config.state_dir}",
            flush=True,
        )
        sig = await wait_for_signal()
        log.info("signal %d: stopping (pods keep running)", sig)
