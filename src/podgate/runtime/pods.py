"""The runtime's pods as the Kubernetes API shows them (for `podgate up`'s local API)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from podgate.node.kubeapi import ContainerView, PodView
from podgate.node.logs import LogSource
from podgate.runtime.api import PodConfig, RuntimeError_
from podgate.runtime.model import (
    ContainerMetadata,
    ContainerSpec,
    ContainerState,
    PodMetadata,
    PodState,
)
from podgate.runtime.runtime import Runtime
from podgate.runtime.target import RuntimeTarget

# Annotation holding a container's declared ports (CRI has no field for them).
PORTS_ANNOTATION = "podgate.io/ports"


def _phase(pod_ready: bool, states: list[ContainerState]) -> str:
    if not pod_ready:
        return (
            "Succeeded" if states and all(s is ContainerState.EXITED for s in states) else "Failed"
        )
    if states and all(s is ContainerState.RUNNING for s in states):
        return "Running"
    if states and all(s is ContainerState.EXITED for s in states):
        return "Succeeded"
    return "Pending"


class RuntimePodSource:
    def __init__(self, runtime: Runtime, target: RuntimeTarget, node: str = "") -> None:
        self.runtime = runtime
        self.target = target
        self.node = node

    async def list_pods(self) -> list[PodView]:
        views = []
        for pod in self.runtime.list_pods():
            containers = self.runtime.pod_containers(pod.id)
            views.append(
                PodView(
                    namespace=pod.metadata.namespace,
                    name=pod.metadata.name,
                    uid=pod.metadata.uid or pod.id,
                    containers=[
                        ContainerView(
                            c.metadata.name,
                            id=c.id,
                            ports=json.loads(c.annotations.get(PORTS_ANNOTATION, "[]")),
                            stdin=c.spec.stdin,
                            tty=c.spec.tty,
                            ready=c.state is ContainerState.RUNNING,
                            image=c.spec.image,
                        )
                        for c in containers
                    ],
                    phase=_phase(pod.state is PodState.READY, [c.state for c in containers]),
                    created=datetime.fromtimestamp(pod.created_at / 1e9, UTC),
                    ip=pod.ip,
                    node=self.node,
                    sandbox_id=pod.id,
                )
            )
        return views

    async def logs(self, pod: PodView, container: str) -> LogSource | None:
        for c in pod.containers:
            if c.name == container:
                record = self.runtime.containers.get(c.id)
                if record is None or not record.log_file:
                    return None

                async def running(cid: str = c.id) -> bool:
                    try:
                        state = self.runtime.get_container(cid).state
                    except RuntimeError_:
                        return False
                    return state is ContainerState.RUNNING

                return LogSource(record.log_file, running)
        return None

    def stream_container(self, pod: PodView, name: str | None) -> str | None:
        for c in pod.containers:
            if name is None or c.name == name:
                return c.id
        return None


def load_example(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if "pod" not in data or "containers" not in data:
        raise ValueError(f"{path}: an example needs 'pod' and 'containers'")
    return data


async def ensure_example(runtime: Runtime, data: dict[str, Any]) -> str:
    """Run the pod an examples/*.json file describes unless it already runs; its id."""
    meta = data["pod"]["metadata"]
    for pod in runtime.list_pods():
        m = pod.metadata
        if (m.namespace, m.name) == (meta["namespace"], meta["name"]):
            if pod.state is PodState.READY:
                return pod.id
            await runtime.remove_pod(pod.id)
    pod_id = await runtime.run_pod(
        PodConfig(
            metadata=PodMetadata(meta["name"], meta["namespace"], meta.get("uid", "")),
            hostname=data["pod"].get("hostname", ""),
            runtime_handler=data["pod"].get("runtime_handler", ""),
        )
    )
    for c in data["containers"]:
        container_id = await runtime.create_container(
            pod_id,
            ContainerMetadata(c["name"]),
            ContainerSpec(
                command=list(c["command"]),
                args=list(c.get("args", [])),
                envs=dict(c.get("env", {})),
                working_dir=c.get("workingDir", ""),
                stdin=bool(c.get("stdin", False)),
                tty=bool(c.get("tty", False)),
                log_path=f"{c['name']}/0.log",
            ),
            labels={},
            annotations={PORTS_ANNOTATION: json.dumps(c.get("ports", []))},
        )
        await runtime.start_container(container_id)
    return pod_id
