"""What `podgate port-forward` is asked to forward: targets, port pairs, listen addresses.

Port pairs read as kubectl reads them, plus an optional protocol suffix:

    8080:80     local 8080 -> remote 80
    80          local 80 -> remote 80 (the same port)
    :80, 0:80   a random free local port -> remote 80
    5353:53/udp UDP instead of TCP (the default is /tcp)

Everything here is pure parsing: no sockets, no files except `load_targets_file`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

MAX_PORT = 65535
# kubectl's default --address: "localhost" means both loopbacks.
LOCALHOST_ADDRESSES = ("127.0.0.1", "::1")
DEFAULT_ADDRESSES = ("127.0.0.1",)
# A targets file is a short hand-written list; anything bigger is a mistake.
MAX_TARGETS_FILE_BYTES = 1024 * 1024
# Kubernetes object names are DNS subdomains (RFC 1123), at most 253 characters.
MAX_NAME_LENGTH = 253

_POD_KINDS = ("pod", "pods", "po")


class SpecError(ValueError):
    """A target, port pair or address that cannot be used; the message is for the user."""


class Protocol(StrEnum):
    TCP = "tcp"
    UDP = "udp"


@dataclass(frozen=True, slots=True)
class PortSpec:
    """One port pair. `local` 0 asks for a random free port."""

    local: int
    remote: int
    protocol: Protocol = Protocol.TCP

    @property
    def remote_label(self) -> str:
        """The remote side as printed: "80" for TCP (as kubectl prints it), "53/udp" for UDP."""
        return str(self.remote) if self.protocol is Protocol.TCP else f"{self.remote}/udp"

    def __str__(self) -> str:
        return f"{self.local}:{self.remote_label}"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One pod and its port pairs; `namespace` None means the context's namespace."""

    pod: str
    ports: tuple[PortSpec, ...]
    namespace: str | None = None

    def label(self, default_namespace: str) -> str:
        return f"{self.namespace or default_namespace}/{self.pod}"


def _port_number(text: str, what: str, spec: str, *, allow_zero: bool) -> int:
    if not text.isascii() or not text.isdigit():
        raise SpecError(f"invalid port pair {spec!r}: {what} port {text!r} is not a number")
    value = int(text)
    low = 0 if allow_zero else 1
    if not low <= value <= MAX_PORT:
        raise SpecError(
            f"invalid port pair {spec!r}: {what} port {value} is not in {low}..{MAX_PORT}"
        )
    return value


def parse_port_spec(text: str) -> PortSpec:
    """`[LOCAL:]REMOTE[/tcp|/udp]` as described in the module docstring."""
    spec = text.strip()
    if not spec:
        raise SpecError("empty port pair")
    body, slash, proto_text = spec.partition("/")
    protocol = Protocol.TCP
    if slash:
        try:
            protocol = Protocol(proto_text.lower())
        except ValueError:
            raise SpecError(
                f"invalid port pair {spec!r}: protocol must be tcp or udp, not {proto_text!r}"
            ) from None
    if body.count(":") > 1:
        raise SpecError(f"invalid port pair {spec!r}: expected [LOCAL:]REMOTE")
    local_text, colon, remote_text = body.rpartition(":")
    remote = _port_number(remote_text, "remote", spec, allow_zero=False)
    if not colon:
        local = remote  # "80": the same port locally
    elif not local_text:
        local = 0  # ":80": any free port
    else:
        local = _port_number(local_text, "local", spec, allow_zero=True)
    return PortSpec(local, remote, protocol)


def parse_port_specs(texts: Iterable[str]) -> tuple[PortSpec, ...]:
    specs = tuple(parse_port_spec(t) for t in texts)
    if not specs:
        raise SpecError("at least one port pair is needed")
    seen: set[tuple[int, Protocol]] = set()
    for spec in specs:
        if spec.local and (spec.local, spec.protocol) in seen:
            raise SpecError(f"local port {spec.local}/{spec.protocol} is given twice")
        seen.add((spec.local, spec.protocol))
    return specs


def parse_target(text: str) -> str:
    """The pod name of `pod/NAME`, `pods/NAME`, `po/NAME` or `NAME`."""
    value = text.strip()
    kind, slash, name = value.partition("/")
    if not slash:
        kind, name = "pod", value
    elif kind.lower() not in _POD_KINDS:
        raise SpecError(
            f"cannot forward to {value!r}: only pods are supported (pod/NAME or NAME), not {kind!r}"
        )
    if not name or "/" in name:
        raise SpecError(f"invalid target {value!r}: expected pod/NAME or NAME")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(f"invalid pod name {name[:40]!r}...: longer than {MAX_NAME_LENGTH}")
    return name


def parse_addresses(values: Sequence[str]) -> tuple[str, ...]:
    """Listen addresses: IP literals, or "localhost" for 127.0.0.1 and ::1 (as kubectl)."""
    out: list[str] = []
    for value in values or DEFAULT_ADDRESSES:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            candidates = LOCALHOST_ADDRESSES if item.lower() == "localhost" else (item,)
            for candidate in candidates:
                try:
                    address = str(ipaddress.ip_address(candidate.strip("[]")))
                except ValueError:
                    raise SpecError(
                        f"invalid --address {item!r}: an IP address or localhost is needed"
                    ) from None
                if address not in out:
                    out.append(address)
    if not out:
        raise SpecError("no listen address given")
    return tuple(out)


def _target_from_entry(entry: Any, where: str) -> TargetSpec:
    if not isinstance(entry, dict):
        raise SpecError(f"{where}: expected a map with pod and ports")
    unknown = set(entry) - {"pod", "namespace", "ports"}
    if unknown:
        raise SpecError(f"{where}: unknown keys {', '.join(sorted(map(str, unknown)))}")
    pod = entry.get("pod")
    if not isinstance(pod, str):
        raise SpecError(f"{where}: pod must be a string")
    namespace = entry.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise SpecError(f"{where}: namespace must be a non-empty string")
    ports = entry.get("ports")
    if isinstance(ports, (str, int)):
        ports = [ports]
    if not isinstance(ports, list) or not ports:
        raise SpecError(f"{where}: ports must be a non-empty list")
    try:
        return TargetSpec(
            parse_target(pod), parse_port_specs(str(p) for p in ports), namespace or None
        )
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def parse_targets_document(text: str, source: str = "targets file") -> list[TargetSpec]:
    """A YAML list of {namespace?, pod, ports: ["8080:80", "53/udp"]}."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source} is not valid YAML: {exc}") from None
    if not isinstance(doc, list) or not doc:
        raise SpecError(f"{source}: expected a non-empty YAML list of targets")
    return [_target_from_entry(e, f"{source} entry {i + 1}") for i, e in enumerate(doc)]


def load_targets_file(path: str) -> list[TargetSpec]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TARGETS_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read targets file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_TARGETS_FILE_BYTES:
        raise SpecError(f"targets file {path} is larger than {MAX_TARGETS_FILE_BYTES} bytes")
    return parse_targets_document(data.decode("utf-8", "replace"), Path(path).name)


def check_local_ports(targets: Sequence[TargetSpec]) -> None:
    """A fixed local port (and protocol) may be asked for once in all targets together."""
    owner: dict[tuple[int, Protocol], str] = {}
    for target in targets:
        name = f"{target.namespace or ''}/{target.pod}"
        for spec in target.ports:
            if not spec.local:
                continue
            key = (spec.local, spec.protocol)
            if key in owner:
                raise SpecError(
                    f"local port {spec.local}/{spec.protocol} is asked for twice "
                    f"({owner[key]} and {name})"
                )
            owner[key] = name
