"""The state directory: one JSON record per pod and per container, written atomically.

A crash at any point leaves either the old record or the new one, never a torn file: records
are written to a temporary file, fsynced, renamed over the old one, and the directory fsynced.
Leftover temporary files from a crash are ignored and cleaned up on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Final

from podgate.linux.proc import atomic_write_json
from podgate.model import (
    ContainerRecord,
    PodRecord,
    container_from_json,
    pod_from_json,
    to_json,
)

log = logging.getLogger(__name__)

# A unix socket path holds at most 107 bytes (sun_path is 108 with the NUL).
UNIX_PATH_MAX: Final = 107
# Run directories are named by this many hex digits of the pod or container id: 64 random bits
# keep them apart and leave room for socket names in a deep state directory.
RUN_NAME_CHARS: Final = 16
# The longest socket name in a run directory: the agent backend's dial-back "pf-<8 hex>.sock"
# plus a hybrid-vsock "_<port>" suffix.
LONGEST_SOCKET_NAME: Final = len("pf-01234567.sock_65535")
# Where run directories go when the state directory is too deep for socket paths.
SHORT_RUN_ROOT: Final = "/run/podgate"


def state_socket(state_dir: str | Path, name: str) -> str:
    """STATE_DIR/NAME for a socket, or the short run root's when that path would be too long."""
    path = Path(state_dir).resolve() / name
    if len(str(path)) <= UNIX_PATH_MAX:
        return str(path)
    root = run_root(Path(state_dir))
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(root / name)


def run_root(state_dir: Path) -> Path:
    """STATE_DIR/run, or a short directory named for it when socket paths would not fit."""
    default = state_dir.resolve() / "run"
    if len(str(default)) + 2 + RUN_NAME_CHARS + LONGEST_SOCKET_NAME <= UNIX_PATH_MAX:
        return default
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:RUN_NAME_CHARS]
    return Path(SHORT_RUN_ROOT) / digest


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir)
        self.pods_dir = self.root / "pods"
        self.containers_dir = self.root / "containers"
        self.run_dir = run_root(self.root)
        self.logs_dir = self.root / "logs"
        for d in (self.root, self.pods_dir, self.containers_dir, self.run_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        os.chmod(self.run_dir, 0o700)

    def save_pod(self, pod: PodRecord) -> None:
        atomic_write_json(str(self.pods_dir / f"{pod.id}.json"), to_json(pod))

    def save_container(self, container: ContainerRecord) -> None:
        atomic_write_json(str(self.containers_dir / f"{container.id}.json"), to_json(container))

    def delete_pod(self, pod_id: str) -> None:
        (self.pods_dir / f"{pod_id}.json").unlink(missing_ok=True)

    def delete_container(self, container_id: str) -> None:
        (self.containers_dir / f"{container_id}.json").unlink(missing_ok=True)

    def run_path(self, object_id: str) -> Path:
        """A per-pod or per-container directory for sockets, ready and exit files."""
        path = self.run_dir / object_id[:RUN_NAME_CHARS]
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove_run_path(self, object_id: str) -> None:
        shutil.rmtree(self.run_dir / object_id[:RUN_NAME_CHARS], ignore_errors=True)

    @staticmethod
    def ensure_dir(path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def remove_file(path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def load(self) -> tuple[list[PodRecord], list[ContainerRecord]]:
        pods = [pod_from_json(d) for d in self._read_all(self.pods_dir)]
        containers = [container_from_json(d) for d in self._read_all(self.containers_dir)]
        return pods, containers

    def _read_all(self, directory: Path) -> list[dict[str, object]]:
        records = []
        for path in sorted(directory.iterdir()):
            if path.suffix != ".json":
                log.info("removing leftover %s", path)
                path.unlink(missing_ok=True)
                continue
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                # Cannot happen with atomic writes; keep the file for a human to look at.
                log.error("unreadable record %s (%s); skipping it", path, exc)
        return records
