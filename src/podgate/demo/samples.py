"""The sample pods `podgate up` runs (examples/*.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from podgate.model import (
    ContainerMetadata,
    ContainerSpec,
    PodMetadata,
    PodState,
)
from podgate.runtime.api import PodConfig
from podgate.runtime.runtime import Runtime

# Annotation holding a container's declared ports (CRI has no field for them).
PORTS_ANNOTATION = "podgate.io/ports"


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
    try:
        await _start_containers(runtime, pod_id, data["containers"])
    except BaseException:
        await runtime.remove_pod(pod_id)  # nothing of a sample that did not start stays
        raise
    return pod_id


async def _start_containers(runtime: Runtime, pod_id: str, containers: list[Any]) -> None:
    for c in containers:
        container_id = await runtime.create_container(
            pod_id,
            ContainerMetadata(c["name"]),
            ContainerSpec(
                # An image from the runtime's store (by name); none: the node's filesystem.
                image=str(c.get("image", "")),
                command=list(c.get("command", [])),
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
