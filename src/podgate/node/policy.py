"""Who may do what to which pod: a small allow-list read from a TOML file.

    [[rule]]
    users = ["alice"]            # and/or
    groups = ["devs"]            # "*" in either = anyone authenticated
    namespaces = ["default"]     # fnmatch patterns; "*" = any
    pods = ["web-*"]             # fnmatch patterns; "*" = any
    verbs = ["get", "log", "exec", "portforward"]   # "*" = all
    ports = [8080, "9000-9010", "53/udp"]  # portforward only; absent = any port

A request is allowed when one rule matches all of it; nothing is allowed otherwise. No group
is special (not even system:masters) unless a rule names it. Port-forward is authorized twice:
the upgrade (no port) needs at least one allowed port on the pod, and each stream its own port,
because ports travel inside the SPDY/WebSocket session, not in the upgrade request.

Ports are TCP unless they say otherwise: `8080` and `"9000-9010"` allow TCP only (what they
always meant), `"53/udp"` and `"5000-5010/udp"` allow UDP flows (podgate's UDP port-forward),
and `"8080/tcp"` is the explicit spelling of a TCP entry. A rule without `ports` allows every
port of either protocol, as it allowed every port before UDP existed.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from podgate.node.auth import UserInfo
from podgate.node.watched import WatchedFile
from podgate.proto.k8s import http_status_body

log = logging.getLogger(__name__)

MIN_PORT = 1  # port 0 cannot be connected to
MAX_PORT = 65535  # TCP and UDP ports are 16 bits
ANY = "*"
TCP = "tcp"
UDP = "udp"

_PORT_RANGE = re.compile(
    r"\s*(?P<first>\d{1,5})\s*(?:-\s*(?P<last>\d{1,5})\s*)?(?:/\s*(?P<protocol>tcp|udp)\s*)?",
    re.ASCII | re.IGNORECASE,
)

_RULE_KEYS = frozenset({"users", "groups", "namespaces", "pods", "verbs", "ports"})
_REQUIRED_KEYS = ("namespaces", "pods", "verbs")


class Verb(StrEnum):
    GET = "get"
    LIST = "list"
    LOG = "log"
    EXEC = "exec"
    ATTACH = "attach"
    PORTFORWARD = "portforward"


class PolicyError(ValueError):
    """The policy file is invalid; the message names the file and the rule."""


@dataclass(frozen=True, slots=True)
class PortRange:
    first: int
    last: int
    protocol: str = TCP

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def allows(self, port: int, protocol: str) -> bool:
        return protocol == self.protocol and port in self

    def __str__(self) -> str:
        ports = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return ports if self.protocol == TCP else f"{ports}/{self.protocol}"


@dataclass(frozen=True, slots=True)
class Rule:
    number: int  # 1-based position in the file, as the messages name it
    users: frozenset[str]
    groups: frozenset[str]
    namespaces: tuple[str, ...]
    pods: tuple[str, ...]
    verbs: frozenset[Verb]
    ports: tuple[PortRange, ...] | None  # None: any port

    def matches_user(self, user: UserInfo) -> bool:
        if ANY in self.users or ANY in self.groups or user.name in self.users:
            return True
        return not self.groups.isdisjoint(user.groups)

    def matches_target(self, verb: Verb, namespace: str, pod: str) -> bool:
        if verb not in self.verbs:
            return False
        if not any(fnmatchcase(namespace, p) for p in self.namespaces):
            return False
        # A list shows the whole namespace: pod patterns do not apply to it.
        return verb is Verb.LIST or any(fnmatchcase(pod, p) for p in self.pods)

    def allows_port(self, port: int, protocol: str = TCP) -> bool:
        return self.ports is None or any(r.allows(port, protocol) for r in self.ports)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str

    def forbidden_body(self) -> bytes:
        """The 403 Status for a denial; kubectl prints its message after "Forbidden"."""
        return http_status_body(403, "Forbidden", self.reason)


class Policy:
    """An ordered list of allow rules. Loaded from a file, it re-reads the file when it
    changes and keeps the previous rules (logging why) if the new version is invalid."""

    def __init__(self, rules: Sequence[Rule], *, path: Path | None = None) -> None:
        self._rules = tuple(rules)
        self._unconditional = False
        self._file = (
            WatchedFile(
                path,
                lambda text, source: _parse(_toml(text, source), source),
                PolicyError,
                "policy",
            )
            if path is not None
            else None
        )

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    @classmethod
    def allow_all(cls) -> Policy:
        """Everything is allowed, even without credentials: for tests and local development."""
        policy = cls([])
        policy._unconditional = True
        return policy

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<policy>") -> Policy:
        return cls(_parse(data, source))

    @classmethod
    def loads(cls, text: str, source: str = "<policy>") -> Policy:
        return cls.from_dict(_toml(text, source), source)

    @classmethod
    def load(cls, path: Path | str) -> Policy:
        policy = cls([], path=Path(path))
        policy._reload(raise_errors=True)
        return policy

    def authorize(
        self,
        user: UserInfo | None,
        verb: Verb | str,
        namespace: str,
        pod: str,
        port: int | None = None,
        protocol: str = TCP,
    ) -> Decision:
        """Whether `user` may `verb` the pod. `list` looks at the namespace only; `portforward`
        without a port asks whether any port of the pod is allowed; with one, whether that
        port is allowed over `protocol` ("tcp" or "udp")."""
        verb = Verb(verb)
        if port is not None and verb is not Verb.PORTFORWARD:
            raise ValueError(f"a port only applies to portforward, not {verb}")
        if protocol not in (TCP, UDP):
            raise ValueError(f"protocol must be {TCP!r} or {UDP!r}, not {protocol!r}")
        if self._unconditional:
            return Decision(True, "the policy allows all requests")
        if self._file is not None:
            self._reload(raise_errors=False)
        resource = "pods" if verb is Verb.LIST else f"pods/{pod}"
        target = f"{resource} in namespace {namespace}"
        if user is None:
            return Decision(False, f"anonymous requests may not {verb} {target}")
        who = f'user "{user.name}"'
        candidates = [
            r
            for r in self._rules
            if r.matches_user(user) and r.matches_target(verb, namespace, pod)
        ]
        if port is None:
            if candidates:
                return Decision(
                    True, f"rule #{candidates[0].number} allows {who} to {verb} {target}"
                )
            return Decision(False, f"{who} may not {verb} {target}")
        # TCP ports are named as they always were; UDP ones carry their protocol.
        shown = str(port) if protocol == TCP else f"{port}/{protocol}"
        for rule in candidates:
            if rule.allows_port(port, protocol):
                return Decision(
                    True, f"rule #{rule.number} allows {who} to {verb} port {shown} of {target}"
                )
        if candidates:
            return Decision(False, f"port {shown} is not allowed for {who} on {target}")
        return Decision(False, f"{who} may not {verb} {target}")

    def _reload(self, *, raise_errors: bool) -> None:
        assert self._file is not None
        rules = self._file.reload(raise_errors=raise_errors)
        if rules is not None:
            self._rules = tuple(rules)
            log.info("loaded %d policy rules from %s", len(rules), self._file.path)


# --- parsing ----------------------------------------------------------------------------------


def _toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None


def _parse(data: Mapping[str, Any], source: str) -> list[Rule]:
    unknown = sorted(set(data) - {"rule"})
    if unknown:
        raise PolicyError(f"{source}: unknown top-level key(s) {unknown}; rules go in [[rule]]")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise PolicyError(f"{source}: 'rule' must be an array of tables ([[rule]])")
    return [_parse_rule(raw, f"{source}: rule #{n}", n) for n, raw in enumerate(raw_rules, 1)]


def _parse_rule(raw: object, where: str, number: int) -> Rule:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a table")
    unknown = sorted(set(raw) - _RULE_KEYS)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {unknown}; known: {sorted(_RULE_KEYS)}")
    for key in _REQUIRED_KEYS:
        if key not in raw:
            raise PolicyError(f'{where}: missing "{key}" (use ["*"] for any)')
    users = _names(raw, "users", where)
    groups = _names(raw, "groups", where)
    if not users and not groups:
        raise PolicyError(f'{where}: names no users and no groups (use users = ["*"] for anyone)')
    verb_names = _names(raw, "verbs", where, required=True)
    if ANY in verb_names:
        verbs = frozenset(Verb)
    else:
        known = [v.value for v in Verb]
        bad = [v for v in verb_names if v not in known]
        if bad:
            raise PolicyError(f"{where}: unknown verb(s) {bad}; known: {known} or '*'")
        verbs = frozenset(Verb(v) for v in verb_names)
    ports: tuple[PortRange, ...] | None = None
    if "ports" in raw:
        if Verb.PORTFORWARD not in verbs:
            raise PolicyError(f'{where}: "ports" only applies to the portforward verb')
        ports = _ports(raw["ports"], where)
    return Rule(
        number=number,
        users=frozenset(users),
        groups=frozenset(groups),
        namespaces=tuple(_names(raw, "namespaces", where, required=True)),
        pods=tuple(_names(raw, "pods", where, required=True)),
        verbs=verbs,
        ports=ports,
    )


def _names(raw: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> list[str]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f'{where}: "{key}" must be a list of non-empty strings')
    if required and not value:
        raise PolicyError(f'{where}: "{key}" is empty, so the rule can never match')
    return value


def _ports(value: object, where: str) -> tuple[PortRange, ...]:
    if not isinstance(value, list) or not value:
        raise PolicyError(f'{where}: "ports" must be a non-empty list (leave it out for any port)')
    return tuple(_port_range(item, where) for item in value)


def _port_range(item: object, where: str) -> PortRange:
    bad = PolicyError(
        f'{where}: bad port {item!r}: expected a number or a range like "9000-9010", '
        f'optionally with "/udp" or "/tcp", within {MIN_PORT}-{MAX_PORT}'
    )
    if isinstance(item, bool):
        raise bad
    protocol = TCP
    if isinstance(item, int):
        first = last = item
    elif isinstance(item, str) and (m := _PORT_RANGE.fullmatch(item)):
        first = int(m["first"])
        last = int(m["last"] or first)
        protocol = (m["protocol"] or TCP).lower()
    else:
        raise bad
    if not MIN_PORT <= first <= last <= MAX_PORT:
        raise bad
    return PortRange(first, last, protocol)
