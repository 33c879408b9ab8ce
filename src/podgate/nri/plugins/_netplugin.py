"""What podgate's two network plugins share: config text, the pod's netns, IP ordering.

The Configure config text is either one JSON object or `key=value` lines (`#` comments and
blank lines ignored). Keys may use `-` or `_`. List values are JSON arrays, or comma-separated
in `key=value` form.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, TypeVar

from podgate.nri import api_pb2 as api

__all__ = ["PluginConfigError", "apply_settings", "netns_path", "parse_config_text"]

# The LinuxNamespace type of the pod's network namespace.
NETWORK_NAMESPACE: Final = "network"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})

S = TypeVar("S")


class PluginConfigError(ValueError):
    """The plugin's configuration text or options are invalid."""


def parse_config_text(text: str) -> dict[str, Any]:
    """The config as a dict: one JSON object, or `key=value` lines."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith(("{", "[")):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise PluginConfigError(f"config is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise PluginConfigError("config must be a JSON object")
        return {str(k).replace("-", "_"): v for k, v in obj.items()}
    out: dict[str, Any] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise PluginConfigError(f"config line {number}: expected key=value, got {line!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _coerce(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, inner, value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, dict):
            return json.dumps(value)  # an inline JSON document (the CNI conflist)
    elif origin is tuple:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    raise PluginConfigError(f"config key {key!r}: invalid value {value!r}")


def apply_settings(settings: S, items: Mapping[str, Any]) -> S:
    """A copy of the dataclass `settings` with `items` applied (unknown keys are errors)."""
    assert dataclasses.is_dataclass(settings) and not isinstance(settings, type)
    hints = typing.get_type_hints(type(settings))
    known = {f.name for f in dataclasses.fields(settings)}
    changes: dict[str, Any] = {}
    for key, value in items.items():
        name = key.replace("-", "_")
        if name not in known:
            raise PluginConfigError(
                f"unknown config key {key!r} (known: {', '.join(sorted(known))})"
            )
        changes[name] = _coerce(key, hints[name], value)
    return dataclasses.replace(settings, **changes)


def netns_path(pod: api.PodSandbox) -> str:
    """The path of the pod's network namespace ("" for a host-network pod)."""
    for namespace in pod.linux.namespaces:
        if namespace.type == NETWORK_NAMESPACE:
            return str(namespace.path)
    return ""
