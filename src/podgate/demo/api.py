"""The demo's pods: static pods whose "containers" are this host (a LocalTarget)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from podgate.node.kubeapi import ContainerView, KubeApi, PodView
from podgate.node.logs import LogSource
from podgate.streaming.target import StreamTarget


@dataclass(slots=True)
class DemoPod:
    namespace: str
    name: str
    containers: Sequence[str] = ("main",)
    ports: Sequence[int] = ()
    phase: str = "Running"
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def uid(self) -> str:
        return f"demo-{self.namespace}-{self.name}"

    def view(self) -> PodView:
        containers = [
            ContainerView(name, ports=self.ports if i == 0 else (), stdin=True, tty=True)
            for i, name in enumerate(self.containers)
        ]
        return PodView(
            self.namespace,
            self.name,
            self.uid,
            containers,
            self.phase,
            self.created,
            node="podgate-demo",
        )


class DemoSource:
    def __init__(self, target: StreamTarget, pods: Sequence[DemoPod]) -> None:
        self.target = target
        self.pods = list(pods)

    async def list_pods(self) -> list[PodView]:
        return [p.view() for p in self.pods]

    def stream_container(self, pod: PodView, name: str | None) -> str | None:
        names = [c.name for c in pod.containers]
        if name is None:
            return names[0] if names else None
        return name if name in names else None

    async def logs(self, pod: PodView, container: str) -> LogSource | None:
        return None  # the demo's "containers" are this host: no CRI logs


class DemoApi(KubeApi):
    """The demo API: static pods served by `target`."""

    def __init__(self, target: StreamTarget, pods: Sequence[DemoPod]) -> None:
        super().__init__(DemoSource(target, pods))
