"""The node's platform and the choice of one manifest from an index (containerd/platforms rules).

Names are Go's (`amd64`, `arm64`, `arm/v7`). A candidate either matches the node exactly or is
one it can also run (a lower amd64 level, 386 on amd64, an older arm variant); the best rank
wins and ties keep index order. Entries with an unknown os/architecture (attestations) never
match.
"""

from __future__ import annotations

import platform as _platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

# uname machine → Go architecture (and the variant it implies).
_MACHINE_ARCH: Final = {
    "x86_64": ("amd64", ""),
    "amd64": ("amd64", ""),
    "i386": ("386", ""),
    "i686": ("386", ""),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "armv5tel": ("arm", "v5"),
    "ppc64le": ("ppc64le", ""),
    "s390x": ("s390x", ""),
    "riscv64": ("riscv64", ""),
}
# Variants an architecture has when none is given.
_DEFAULT_VARIANT: Final = {"arm": "v7", "arm64": "v8"}
# amd64 micro-architecture levels, lowest first (v1 is the baseline).
_AMD64_LEVELS: Final = ("v1", "v2", "v3", "v4")


@dataclass(frozen=True, slots=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        base = f"{self.os}/{self.architecture}"
        return f"{base}/{self.variant}" if self.variant else base


def normalize(os_name: str, arch: str, variant: str = "") -> Platform:
    """Lower-case, Go names, and the default variant made explicit for arm and arm64."""
    os_name, arch, variant = os_name.lower(), arch.lower(), variant.lower()
    if arch in _MACHINE_ARCH:
        arch, implied = _MACHINE_ARCH[arch]
        variant = variant or implied
    if arch == "arm64" and variant == "8":
        variant = "v8"
    if arch == "arm" and variant in {"5", "6", "7", "8"}:
        variant = "v" + variant
    if arch == "amd64" and variant == "v1":
        variant = ""
    variant = variant or _DEFAULT_VARIANT.get(arch, "")
    return Platform(os_name, arch, variant)


def host_platform(machine: str | None = None) -> Platform:
    """linux/<this machine's architecture>[/<variant>]."""
    return normalize("linux", machine or _platform.machine())


def compatible(node: Platform) -> list[Platform]:
    """Platforms the node runs, best first (containerd's ordering)."""
    out = [node]
    if node.architecture == "amd64":
        level = node.variant or "v1"
        if level in _AMD64_LEVELS:
            lower = _AMD64_LEVELS[: _AMD64_LEVELS.index(level)]
            out += [Platform(node.os, "amd64", v if v != "v1" else "") for v in reversed(lower)]
        out.append(Platform(node.os, "386"))
    elif node.architecture == "arm" and node.variant.startswith("v"):
        arm_level = int(node.variant[1:]) if node.variant[1:].isdigit() else 7
        out += [Platform(node.os, "arm", f"v{v}") for v in range(arm_level - 1, 4, -1)]
    elif node.architecture == "arm64":
        out += [Platform(node.os, "arm", f"v{v}") for v in range(8, 4, -1)]
    return out


def rank(candidate: Platform, node: Platform) -> int | None:
    """Position of `candidate` in the node's preference list; None if it cannot run."""
    c = normalize(candidate.os, candidate.architecture, candidate.variant)
    for i, p in enumerate(compatible(node)):
        if (c.os, c.architecture, c.variant) == (p.os, p.architecture, p.variant):
            return i
    return None


def choose(candidates: Sequence[Platform | None], node: Platform) -> int | None:
    """Index of the best candidate for the node (first wins a tie); None when none fits."""
    best: tuple[int, int] | None = None
    for i, cand in enumerate(candidates):
        if cand is None:
            continue
        r = rank(cand, node)
        if r is not None and (best is None or r < best[0]):
            best = (r, i)
    return None if best is None else best[1]
