"""Seccomp for a CRI container: RuntimeDefault (containerd's profile), Localhost, Unconfined.

The RuntimeDefault profile ships as package data (`seccomp_default.json`) in a compact form:
each rule may carry `includes`/`excludes` on the container's bounding capabilities, the host
architecture and the kernel version; `runtime_default` keeps the rules that apply and returns
the OCI `linux.seccomp` object runc takes. Pure functions, apart from reading that file once.
"""

from __future__ import annotations

import functools
import json
import platform
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any, Final

__all__ = [
    "LOCALHOST",
    "RUNTIME_DEFAULT",
    "UNCONFINED",
    "SeccompError",
    "host_arch",
    "load_localhost",
    "runtime_default",
    "select_profile",
]

RUNTIME_DEFAULT: Final = "RuntimeDefault"
UNCONFINED: Final = "Unconfined"
LOCALHOST: Final = "Localhost"
_LOCALHOST_PREFIX: Final = "localhost/"
# Go's GOARCH names for the machine names uname reports.
_GOARCH: Final = {
    "x86_64": "amd64",
    "aarch64": "arm64",
    "i686": "386",
    "i386": "386",
    "armv7l": "arm",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


class SeccompError(ValueError):
    """A profile that cannot be used; the message is containerd's wording."""


def host_arch() -> str:
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


@functools.cache
def _template() -> dict[str, Any]:
    text = resources.files("podgate.oci").joinpath("seccomp_default.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("-", 1)[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _applies(rule: Mapping[str, Any], caps: frozenset[str], arch: str, kernel: str) -> bool:
    includes = rule.get("includes", {})
    excludes = rule.get("excludes", {})
    if "caps" in includes and not set(includes["caps"]) <= caps:
        return False
    if "arches" in includes and arch not in includes["arches"]:
        return False
    if "minKernel" in includes and _version(kernel) < _version(includes["minKernel"]):
        return False
    if caps & set(excludes.get("caps", ())):
        return False
    return arch not in excludes.get("arches", ())


def runtime_default(bounding: Iterable[str], arch: str, kernel: str) -> dict[str, Any]:
    """containerd's RuntimeDefault for a container with this bounding set, as OCI seccomp."""
    template = _template()
    caps = frozenset(bounding)
    syscalls = []
    for rule in template["syscalls"]:
        if not _applies(rule, caps, arch, kernel):
            continue
        entry: dict[str, Any] = {"names": list(rule["names"]), "action": rule["action"]}
        if "errnoRet" in rule:
            entry["errnoRet"] = rule["errnoRet"]
        if "args" in rule:
            entry["args"] = [dict(arg) for arg in rule["args"]]
        syscalls.append(entry)
    return {
        "defaultAction": template["defaultAction"],
        "architectures": list(template["archMap"].get(arch, [])),
        "syscalls": syscalls,
    }


def load_localhost(text: str, path: str) -> dict[str, Any]:
    """An OCI-seccomp JSON document (a Localhost profile file's contents)."""
    try:
        profile = json.loads(text)
    except ValueError as exc:
        raise SeccompError(f'cannot load seccomp profile "{path}": {exc}') from exc
    if not isinstance(profile, dict) or "defaultAction" not in profile:
        raise SeccompError(f'cannot load seccomp profile "{path}": no defaultAction')
    return profile


def select_profile(profile_type: str, localhost_ref: str) -> tuple[str, str]:
    """(kind, path) for a CRI SecurityProfile; kind "" = unset (no filter).

    `profile_type` is "", RuntimeDefault, Unconfined or Localhost; the deprecated strings
    (`runtime/default`, `docker/default`, `unconfined`, `localhost/<path>`) are accepted too.
    """
    legacy = {"runtime/default": RUNTIME_DEFAULT, "docker/default": RUNTIME_DEFAULT}
    if profile_type in legacy:
        return legacy[profile_type], ""
    if profile_type == "unconfined":
        return UNCONFINED, ""
    if profile_type.startswith(_LOCALHOST_PREFIX):
        return LOCALHOST, profile_type[len(_LOCALHOST_PREFIX) :]
    if localhost_ref and profile_type != LOCALHOST:
        raise SeccompError(
            "seccomp config invalid LocalhostRef must only be set if ProfileType is Localhost"
        )
    if profile_type == LOCALHOST:
        ref = localhost_ref.removeprefix(_LOCALHOST_PREFIX)
        if not ref:
            raise SeccompError("seccomp config invalid: Localhost needs a localhost_ref")
        return LOCALHOST, ref
    if profile_type in ("", RUNTIME_DEFAULT, UNCONFINED):
        return profile_type, ""
    raise SeccompError(f"unsupported seccomp profile type {profile_type!r}")
