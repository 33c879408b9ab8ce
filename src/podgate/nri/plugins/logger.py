"""The `logger` NRI plugin: logs every event it sees as one line.

With an events file (`--events-file PATH`, `$NRI_LOGGER_EVENTS_FILE`, or `events_file=PATH` in
the config text the runtime passes to Configure) it also appends one JSON object per event,
flushed per line, so the order of events can be checked:

    {"event": "RunPodSandbox", "pod": "ns/name", "pod_id": "…", "container": "", "container_id": "",
     "ips": ["10.88.0.2"]}

It subscribes to every event except ValidateContainerAdjustment (a logger must not become a
validator), including the PodSandboxStatus extension. Run: `python -m podgate.nri.plugins.logger`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from podgate.nri import api_pb2 as api
from podgate.nri.plugin import ALL_EVENTS, Plugin, event_mask, run_plugin

log = logging.getLogger("podgate.nri.plugins.logger")

EVENTS_FILE_ENV = "NRI_LOGGER_EVENTS_FILE"
CONFIG_EVENTS_FILE = "events_file"  # key in the Configure config text (`key=value` lines)


class Logger(Plugin):
    name, index = "logger", "10"
    events = ALL_EVENTS & ~event_mask(api.VALIDATE_CONTAINER_ADJUSTMENT)

    def __init__(self, events_file: str | None = None) -> None:
        self.events_file = events_file or os.environ.get(EVENTS_FILE_ENV) or None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--events-file", help="append one JSON object per event here")

    def apply_arguments(self, args: argparse.Namespace) -> None:
        self.events_file = args.events_file or self.events_file

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        for line in config.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() == CONFIG_EVENTS_FILE and value.strip():
                self.events_file = value.strip()
        log.info("Configure: runtime %s %s", runtime_name, runtime_version)

    async def synchronize(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> list[api.ContainerUpdate]:
        log.info("Synchronize: %d pods, %d containers", len(pods), len(containers))
        return []

    def _record(
        self, event: str, pod: api.PodSandbox, container: api.Container | None = None
    ) -> None:
        line = {
            "event": event,
            "pod": f"{pod.namespace}/{pod.name}",
            "pod_id": pod.id,
            "container": container.name if container is not None else "",
            "container_id": container.id if container is not None else "",
            "ips": list(pod.ips),
        }
        suffix = f" container {container.name} ({container.id})" if container is not None else ""
        log.info("%s: pod %s (%s)%s", event, line["pod"], pod.id, suffix)
        if self.events_file is None:
            return
        # Opened per event: a few hundred bytes, and nothing stays open when the runtime goes.
        with open(self.events_file, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self._record("RunPodSandbox", pod)

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self._record("StopPodSandbox", pod)

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self._record("RemovePodSandbox", pod)

    async def update_pod_sandbox(
        self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
    ) -> None:
        self._record("UpdatePodSandbox", pod)

    async def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self._record("PostUpdatePodSandbox", pod)

    async def pod_sandbox_status(self, pod: api.PodSandbox) -> tuple[str, list[str]] | None:
        self._record("PodSandboxStatus", pod)
        return None

    async def create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("CreateContainer", pod, container)

    async def post_create_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("PostCreateContainer", pod, container)

    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("StartContainer", pod, container)

    async def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("PostStartContainer", pod, container)

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> list[api.ContainerUpdate]:
        self._record("UpdateContainer", pod, container)
        return []

    async def post_update_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("PostUpdateContainer", pod, container)

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> list[api.ContainerUpdate]:
        self._record("StopContainer", pod, container)
        return []

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._record("RemoveContainer", pod, container)


def main(argv: list[str] | None = None) -> int:
    return run_plugin(Logger(), argv)


if __name__ == "__main__":
    sys.exit(main())
