"""A small reader of CDI (Container Device Interface) specs: the JSON or YAML files in the
CDI spec directories, each a `kind` ("vendor/class") with named devices and their
containerEdits. A device is asked for by its qualified name `vendor/class=name`; what it brings
is the spec's own containerEdits followed by the device's. Device nodes lacking type or
numbers take them from the host node, as the CDI library does.

Later directories override earlier ones for the same qualified name (the CDI library's
priority: /etc/cdi, then /var/run/cdi).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any, Final

import yaml

from podgate.oci.adjust import HOOK_KINDS

__all__ = ["DEFAULT_SPEC_DIRS", "CdiError", "resolve"]

DEFAULT_SPEC_DIRS: Final = ("/etc/cdi", "/var/run/cdi")
# A spec file larger than this is not read, bytes.
MAX_SPEC_BYTES: Final = 1024 * 1024
_SUFFIXES: Final = (".json", ".yaml", ".yml")


class CdiError(ValueError):
    """A CDI device cannot be resolved; the message names it."""


def _load(path: str) -> dict[str, Any] | None:
    with open(path, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise CdiError(f"CDI spec {path} is too large")
    try:
        spec = json.loads(data) if path.endswith(".json") else yaml.safe_load(data)
    except (ValueError, yaml.YAMLError) as exc:
        raise CdiError(f"CDI spec {path}: {exc}") from exc
    return spec if isinstance(spec, dict) else None


def _devices(spec_dirs: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Qualified name -> [spec edits, device edits]."""
    found: dict[str, list[dict[str, Any]]] = {}
    for directory in spec_dirs:
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        for name in names:
            if not name.endswith(_SUFFIXES):
                continue
            spec = _load(os.path.join(directory, name))
            if spec is None or "/" not in str(spec.get("kind", "")):
                continue
            common = spec.get("containerEdits") or {}
            for device in spec.get("devices") or ():
                qualified = f"{spec['kind']}={device.get('name', '')}"
                found[qualified] = [common, device.get("containerEdits") or {}]
    return found


def _complete_node(node: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if {"type", "major", "minor"} <= node.keys():
        return node
    host = node.get("hostPath") or node["path"]
    try:
        st = os.stat(host)
    except OSError as exc:
        raise CdiError(f"CDI device node {host}: {exc.strerror}") from exc
    if stat.S_ISCHR(st.st_mode):
        node.setdefault("type", "c")
    elif stat.S_ISBLK(st.st_mode):
        node.setdefault("type", "b")
    else:
        raise CdiError(f"CDI device node {host} is not a device")
    node.setdefault("major", os.major(st.st_rdev))
    node.setdefault("minor", os.minor(st.st_rdev))
    node.setdefault("fileMode", stat.S_IMODE(st.st_mode))
    return node


def resolve(names: Sequence[str], spec_dirs: Sequence[str]) -> list[dict[str, Any]]:
    """The containerEdits the named devices bring, in order; CdiError for an unknown one."""
    if not names:
        return []
    known = _devices(spec_dirs)
    edits: list[dict[str, Any]] = []
    for name in names:
        if name not in known:
            raise CdiError(f"unresolvable CDI devices {name}")
        for part in known[name]:
            part = dict(part)
            part["deviceNodes"] = [_complete_node(n) for n in part.get("deviceNodes") or ()]
            for hook in part.get("hooks") or ():
                if hook.get("hookName") not in HOOK_KINDS:
                    raise CdiError(f"CDI device {name}: unknown hook name {hook.get('hookName')!r}")
            edits.append(part)
    return edits
