"""The `ulimits` NRI plugin: rlimits for a container from its pod's annotations, the same
contract as containerd/nri's Go `ulimit-adjuster` (and the same bytes on the wire):

    ulimits.noderesource.dev/container.<container name>: |
      - type: RLIMIT_NOFILE
        hard: 4096
        soft: 1024
      - type: nproc          # case-insensitive, RLIMIT_ prefix optional
        hard: 9000
        soft: 9000

A malformed annotation, an unknown rlimit or soft > hard fails the container's creation with
the reason. Run: `python -m podgate.nri.plugins.ulimits` (index 30 unless told otherwise).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import yaml

from podgate.nri import api_pb2 as api
from podgate.nri.adjust import Adjustment
from podgate.nri.plugin import Plugin, run_plugin

log = logging.getLogger("podgate.nri.plugins.ulimits")

ANNOTATION_PREFIX = "ulimits.noderesource.dev/container."
# The POSIX rlimits an OCI runtime knows (runtime-spec config.md, process.rlimits).
RLIMITS = frozenset(
    f"RLIMIT_{name}"
    for name in (
        *("AS", "CORE", "CPU", "DATA", "FSIZE", "LOCKS", "MEMLOCK", "MSGQUEUE", "NICE"),
        *("NOFILE", "NPROC", "RSS", "RTPRIO", "RTTIME", "SIGPENDING", "STACK"),
    )
)


class UlimitError(ValueError):
    """The annotation asks for something no container can have."""


@dataclass(frozen=True, slots=True)
class Ulimit:
    type: str
    hard: int
    soft: int


def parse(text: str) -> list[Ulimit]:
    """The annotation's list, types normalised to RLIMIT_*; UlimitError when invalid."""
    try:
        entries = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UlimitError(f"annotation is not YAML: {exc}") from exc
    if not isinstance(entries, list):
        raise UlimitError("annotation must be a list of {type, hard, soft}")
    limits: list[Ulimit] = []
    for entry in entries:
        if not isinstance(entry, dict) or not {"type", "hard", "soft"} <= entry.keys():
            raise UlimitError(f"entry {entry!r} needs type, hard and soft")
        kind = str(entry["type"]).upper()
        if not kind.startswith("RLIMIT_"):
            kind = f"RLIMIT_{kind}"
        if kind not in RLIMITS:
            raise UlimitError(f"unknown rlimit {entry['type']!r}")
        hard, soft = entry["hard"], entry["soft"]
        if not (isinstance(hard, int) and isinstance(soft, int)) or min(hard, soft) < 0:
            raise UlimitError(f"{kind}: hard and soft must be non-negative integers")
        if soft > hard:
            raise UlimitError(f"{kind}: soft limit {soft} is above hard limit {hard}")
        limits.append(Ulimit(kind, hard, soft))
    return limits


class Ulimits(Plugin):
    name, index = "ulimits", "30"

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Adjustment | None:
        text = pod.annotations.get(ANNOTATION_PREFIX + container.name)
        if text is None:
            return None
        limits = parse(text)  # an error fails the creation with its reason
        adjust = Adjustment()
        for limit in limits:
            adjust.add_rlimit(limit.type, hard=limit.hard, soft=limit.soft)
        log.info(
            "%s/%s: %s",
            pod.name,
            container.name,
            ", ".join(f"{u.type}={u.soft}/{u.hard}" for u in limits),
        )
        return adjust


def main(argv: list[str] | None = None) -> int:
    return run_plugin(Ulimits(), argv)


if __name__ == "__main__":
    sys.exit(main())
