"""The state of a running port-forward, apart from how it is shown.

The engine reports what happens as `ForwardEvent`s; `ForwardStatus.apply` folds them into
per-target and per-port counters. Renderers (a live table, log lines, JSON lines) read the
model and the events; nothing here does I/O or reads a clock (times come in the events).

Bytes are counted from the local side: `bytes_out` went from local clients to the pod,
`bytes_in` came back from the pod.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from podgate.forward.specs import PortSpec

# The last errors a target keeps for display.
LAST_ERROR_CHARS = 200


class EventKind(StrEnum):
    """One line of `--json` output each; the values are the `event` field."""

    LISTENING = "listening"  # a local listener is up (local = its address)
    LISTEN_FAILED = "listen_failed"  # binding a local address failed (fatal for the target)
    CONNECTED = "connected"  # the first session to the pod is up
    SESSION_LOST = "session_lost"  # the session ended; local listeners stay up
    RECONNECTING = "reconnecting"  # one attempt to get a session back failed; retrying
    RECONNECTED = "reconnected"  # a new session replaced the lost one
    POD_REPLACED = "pod_replaced"  # the pod of that name was recreated (new uid)
    CONNECTION_OPENED = "connection_opened"  # a local client connected (or a UDP peer appeared)
    CONNECTION_CLOSED = "connection_closed"  # it ended normally (bytes in the event)
    CONNECTION_ERROR = "connection_error"  # it failed; the error text is in the event
    TARGET_GONE = "target_gone"  # the pod has been missing for longer than --gone-timeout
    TARGET_DENIED = "target_denied"  # the API refused the upgrade (401/403)
    TARGET_FAILED = "target_failed"  # any other fatal error for the target
    STOPPED = "stopped"  # the target stopped (the user interrupted)


class TargetState(Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    GONE = "gone"
    DENIED = "denied"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({TargetState.GONE, TargetState.DENIED, TargetState.FAILED, TargetState.STOPPED})

# Events that say why the target has no session.
_SESSION_ERRORS = frozenset(
    {
        EventKind.SESSION_LOST,
        EventKind.RECONNECTING,
        EventKind.POD_REPLACED,
        EventKind.TARGET_GONE,
        EventKind.TARGET_DENIED,
        EventKind.TARGET_FAILED,
        EventKind.LISTEN_FAILED,
    }
)

# How each event moves the target's state; events not listed leave it as it is.
_TRANSITIONS: dict[EventKind, TargetState] = {
    EventKind.CONNECTED: TargetState.CONNECTED,
    EventKind.RECONNECTED: TargetState.CONNECTED,
    EventKind.SESSION_LOST: TargetState.RECONNECTING,
    EventKind.RECONNECTING: TargetState.RECONNECTING,
    EventKind.POD_REPLACED: TargetState.RECONNECTING,
    EventKind.TARGET_GONE: TargetState.GONE,
    EventKind.TARGET_DENIED: TargetState.DENIED,
    EventKind.TARGET_FAILED: TargetState.FAILED,
    EventKind.LISTEN_FAILED: TargetState.FAILED,
    EventKind.STOPPED: TargetState.STOPPED,
}


@dataclass(frozen=True, slots=True)
class ForwardEvent:
    kind: EventKind
    target: str  # namespace/pod
    time: float  # seconds since the epoch
    local: str = ""  # "127.0.0.1:8080" (a listener, or the peer for connection events)
    remote: int = 0
    protocol: str = ""
    bytes_in: int = 0
    bytes_out: int = 0
    error: str = ""
    connection: int = 0  # id of the connection within its target (0: not about one)
    peer: str = ""  # the local client's address, for connection events

    def as_json(self) -> dict[str, object]:
        """The `--json` line: event, target, local, remote, protocol, bytes, error, time."""
        out: dict[str, object] = {
            "event": self.kind.value,
            "target": self.target,
            "time": round(self.time, 6),
        }
        if self.local:
            out["local"] = self.local
        if self.remote:
            out["remote"] = self.remote
        if self.protocol:
            out["protocol"] = self.protocol
        if self.kind in (EventKind.CONNECTION_CLOSED, EventKind.CONNECTION_ERROR):
            out["bytes_in"] = self.bytes_in
            out["bytes_out"] = self.bytes_out
        if self.connection:
            out["connection"] = self.connection
        if self.peer:
            out["peer"] = self.peer
        if self.error:
            out["error"] = self.error
        return out


@dataclass(slots=True)
class PortStats:
    """Counters of one port pair (the listeners of all its addresses together)."""

    spec: PortSpec
    locals: list[str] = field(default_factory=list)  # listening addresses, "127.0.0.1:8080"
    active: int = 0
    total: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_error: str = ""  # of the last connection that failed


@dataclass(slots=True)
class TargetStats:
    name: str
    ports: list[PortStats]
    state: TargetState = TargetState.CONNECTING
    reconnects: int = 0
    sessions_lost: int = 0
    last_error: str = ""  # the last error of any kind
    session_error: str = ""  # why there is no session now ("" while connected)
    since: float = 0.0  # when the state last changed

    def port(self, remote: int, protocol: str) -> PortStats | None:
        for stats in self.ports:
            if stats.spec.remote == remote and stats.spec.protocol.value == protocol:
                return stats
        return None

    @property
    def active(self) -> int:
        return sum(p.active for p in self.ports)


Listener = Callable[[ForwardEvent], None]


class ForwardStatus:
    """All targets' counters, kept up to date from events; live byte counts come from
    `add_bytes` (called as data moves, so a live view shows transfers in progress)."""

    def __init__(self) -> None:
        self.targets: dict[str, TargetStats] = {}
        self._listeners: list[Listener] = []

    def add_target(self, name: str, ports: tuple[PortSpec, ...]) -> TargetStats:
        stats = TargetStats(name, [PortStats(p) for p in ports])
        self.targets[name] = stats
        return stats

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def add_bytes(
        self, target: str, remote: int, protocol: str, *, inbound: int, outbound: int
    ) -> None:
        stats = self.targets.get(target)
        port = stats.port(remote, protocol) if stats else None
        if port is not None:
            port.bytes_in += inbound
            port.bytes_out += outbound

    def apply(self, event: ForwardEvent) -> None:
        """Fold one event into the counters, then tell every subscriber."""
        stats = self.targets.get(event.target)
        if stats is not None:
            self._count(stats, event)
        for listener in self._listeners:
            listener(event)

    @staticmethod
    def _count(stats: TargetStats, event: ForwardEvent) -> None:
        was_final = stats.state.final
        new_state = _TRANSITIONS.get(event.kind)
        if new_state is not None and not was_final and new_state is not stats.state:
            stats.state = new_state
            stats.since = event.time
        if event.kind is EventKind.RECONNECTED:
            stats.reconnects += 1
        elif event.kind is EventKind.SESSION_LOST:
            stats.sessions_lost += 1
        if event.error and event.kind is not EventKind.CONNECTION_CLOSED:
            stats.last_error = event.error[:LAST_ERROR_CHARS]
        if was_final:
            pass  # the reason it ended stays
        elif event.kind in (EventKind.CONNECTED, EventKind.RECONNECTED):
            stats.session_error = ""
        elif event.kind in _SESSION_ERRORS and event.error:
            stats.session_error = event.error[:LAST_ERROR_CHARS]
        port = stats.port(event.remote, event.protocol) if event.remote else None
        if port is None:
            return
        if event.kind is EventKind.LISTENING:
            if event.local not in port.locals:
                port.locals.append(event.local)
        elif event.kind is EventKind.CONNECTION_OPENED:
            port.active += 1
            port.total += 1
        elif event.kind in (EventKind.CONNECTION_CLOSED, EventKind.CONNECTION_ERROR):
            if event.connection:
                port.active = max(port.active - 1, 0)
            if event.kind is EventKind.CONNECTION_ERROR:
                port.errors += 1
                port.last_error = event.error[:LAST_ERROR_CHARS]

    @property
    def alive(self) -> list[TargetStats]:
        return [t for t in self.targets.values() if not t.state.final]
