"""The runtime's side of sandboxed pods: start, adopt and stop a pod's sandbox shim.

A pod of the `sandboxed` handler has two sets of namespaces. The pod's own are what the
runtime reports (the host side of the VM: loopback only, nothing listening); the guest's, made
by the sandbox shim and held by the guest's PID 1, are where the containers run. The shim's and
the guest's process refs live in `PodRecord.extra`, so a restarted daemon (or a restarted shim)
finds them again. The shim is forked from a warm interpreter (`FORKER_MODULES`, the second
stage of the daemon's podgate.linux.forker), not started as a new one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Final

from podgate.linux import holder as holder_mod
from podgate.linux.proc import (
    Spawn,
    SpawnError,
    is_alive,
    signal_process,
    spawn_detached,
    wait_gone,
)
from podgate.linux.proc import wait_ready_file as _wait_ready_file
from podgate.model import PodRecord, ProcessRef
from podgate.runtime.api import FailedPreconditionError
from podgate.shimapi import SHIM_SOCKET, shim_socket

__all__ = [
    "FORKER_MODULES",
    "GUEST_NS_PID",
    "HANDLER",
    "READY_FILE",
    "SANDBOX_START_TIMEOUT",
    "SHIM_LOG",
    "SHIM_SOCKET",
    "SandboxError",
    "container_ns_paths",
    "container_ns_pid",
    "ensure_shim",
    "is_sandboxed",
    "shim_socket",
    "start_for_pod",
    "stop_for_pod",
]

log = logging.getLogger(__name__)

HANDLER: Final = "sandboxed"
# Files in the pod's run directory.
READY_FILE: Final = "sandbox.json"
SHIM_LOG: Final = "sandbox-shim.log"
# PodRecord.extra keys.
GUEST_NS_PID: Final = "guest_ns_pid"
_SHIM: Final = "sandbox_shim"
_GUEST_HOLDER: Final = "guest_holder"
_GUEST_NS_PROCESS: Final = "guest_ns_process"
# Booting a sandbox forks the shim, the guest and the agent and waits for the agent's health;
# generous, for a loaded node (or a forker that has to start first), seconds.
SANDBOX_START_TIMEOUT: Final = 60.0
# How long the shim gets to stop its agent after SIGTERM, seconds.
SHIM_STOP_TIMEOUT: Final = 5.0
# What the sandbox shims' forker imports and forks.
_SHIM_MODULE: Final = "podgate.runtime.sandbox.shim"
FORKER_MODULES: Final = (_SHIM_MODULE,)


class SandboxError(SpawnError):
    """The sandbox could not be booted or adopted; the message says why."""


def is_sandboxed(pod: PodRecord) -> bool:
    return pod.runtime_handler == HANDLER


def _ref(pod: PodRecord, key: str) -> ProcessRef | None:
    data = pod.extra.get(key)
    return ProcessRef(int(data["pid"]), int(data["start_time"])) if data else None


def _as_json(ref: ProcessRef) -> dict[str, int]:
    return {"pid": ref.pid, "start_time": ref.start_time}


def container_ns_paths(pod: PodRecord) -> dict[str, str]:
    """The namespace files ("net", "ipc", "uts", and "pid" when shared) a container of `pod`
    joins: the guest's for sandboxed pods, the pod's own (pinned or its holder's) otherwise."""
    if is_sandboxed(pod):
        guest = container_ns_pid(pod)
        return {kind: f"/proc/{guest}/ns/{kind}" for kind in ("net", "ipc", "uts", "pid")}
    paths = {kind: pod.ns_path(kind) for kind in ("net", "ipc", "uts", "pid")}
    return {kind: path for kind, path in paths.items() if path is not None}


def container_ns_pid(pod: PodRecord) -> int:
    """The guest process whose namespaces a container of the sandboxed `pod` joins."""
    guest = _ref(pod, _GUEST_NS_PROCESS)
    if guest is None or not is_alive(guest):
        raise FailedPreconditionError(f"pod sandbox {pod.id} has no running guest")
    return int(pod.extra[GUEST_NS_PID])


async def _start_shim(pod: PodRecord, run_dir: Path, *, adopt: bool, spawn: Spawn | None) -> None:
    ready = run_dir / READY_FILE
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    argv = ["--dir", str(run_dir), "--ready-file", str(ready)]
    if pod.hostname:
        argv += ["--hostname", pod.hostname]
    if adopt:
        holder, ns_process = _ref(pod, _GUEST_HOLDER), _ref(pod, _GUEST_NS_PROCESS)
        assert holder is not None and ns_process is not None
        argv += [
            "--adopt-guest",
            f"{holder.pid}:{holder.start_time}:{ns_process.pid}:{ns_process.start_time}",
        ]
    log_file = str(run_dir / SHIM_LOG)
    try:
        if spawn is not None:
            await spawn(_SHIM_MODULE, argv, log_file)
        else:
            await spawn_detached([sys.executable, "-m", _SHIM_MODULE, *argv], log_file)
        data: dict[str, Any] = await _wait_ready_file(str(ready), SANDBOX_START_TIMEOUT, log_file)
    except SpawnError as exc:
        raise SandboxError(str(exc)) from exc
    pod.extra[_SHIM] = data["shim"]
    pod.extra[_GUEST_HOLDER] = data["guest_holder"]
    pod.extra[_GUEST_NS_PROCESS] = data["guest_ns_process"]
    pod.extra[GUEST_NS_PID] = int(data["guest_ns_process"]["pid"])


async def start_for_pod(pod: PodRecord, run_dir: Path, spawn: Spawn | None = None) -> None:
    """Boot the sandbox of a new pod (a no-op for other handlers); its refs go to `pod.extra`.
    `spawn` forks the shim (podgate.linux.forker, FORKER_MODULES); None: a new interpreter.

    On failure the pod holder is stopped too and FailedPreconditionError says why.
    """
    if not is_sandboxed(pod):
        return
    try:
        await _start_shim(pod, run_dir, adopt=False, spawn=spawn)
    except SandboxError as exc:
        if pod.holder is not None:
            await holder_mod.stop_holder(pod.holder)
        raise FailedPreconditionError(f"failed to start the sandbox: {exc}") from exc
    log.info("pod %s: sandbox shim %s", pod.id[:12], pod.extra[_SHIM]["pid"])


async def ensure_shim(pod: PodRecord, run_dir: Path, spawn: Spawn | None = None) -> bool:
    """Start a new shim for a running guest whose shim is gone; True if one was started.

    The caller saves the pod record. Raises SandboxError when there is no guest to adopt.
    """
    shim = _ref(pod, _SHIM)
    if shim is not None and is_alive(shim):
        return False
    guest = _ref(pod, _GUEST_NS_PROCESS)
    holder = _ref(pod, _GUEST_HOLDER)
    if guest is None or holder is None or not is_alive(guest) or not is_alive(holder):
        raise SandboxError(f"pod sandbox {pod.id} has no running guest to adopt")
    log.warning("pod %s: sandbox shim is gone; starting a new one", pod.id[:12])
    await _start_shim(pod, run_dir, adopt=True, spawn=spawn)
    return True


async def stop_for_pod(pod: PodRecord) -> None:
    """Stop the shim (its agent and muxer go with it), then the guest. Idempotent."""
    if not is_sandboxed(pod):
        return
    shim = _ref(pod, _SHIM)
    stopping = shim is not None and signal_process(shim, signal.SIGTERM)
    if shim is not None and stopping and not await wait_gone(shim, SHIM_STOP_TIMEOUT):
        signal_process(shim, signal.SIGKILL)
        await wait_gone(shim, SHIM_STOP_TIMEOUT)
    holder = _ref(pod, _GUEST_HOLDER)
    guest = _ref(pod, _GUEST_NS_PROCESS)
    if holder is not None and holder != guest:  # a guest of an older shim: holder and PID 1
        await holder_mod.stop_holder(holder)
    # The guest's PID 1 ignores SIGTERM (no handler); SIGKILL ends it and its namespace.
    if guest is not None and signal_process(guest, signal.SIGKILL):
        await wait_gone(guest, SHIM_STOP_TIMEOUT)
