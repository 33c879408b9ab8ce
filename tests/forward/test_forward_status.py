"""The port-forward state model: events in, counters and states out; JSON lines."""

from __future__ import annotations

import io
import json

from podgate.forward.render import JsonRenderer, PlainRenderer, human_bytes, status_table
from podgate.forward.specs import PortSpec, Protocol
from podgate.forward.status import EventKind, ForwardEvent, ForwardStatus, TargetState

T = "default/web"
PORTS = (PortSpec(8080, 80), PortSpec(0, 53, Protocol.UDP))


def event(kind: EventKind, **fields: object) -> ForwardEvent:
    return ForwardEvent(kind, T, 1000.0, **fields)  # type: ignore[arg-type]


def conn(
    kind: EventKind, cid: int, remote: int = 80, proto: str = "tcp", **f: object
) -> ForwardEvent:
    return event(kind, local="127.0.0.1:8080", remote=remote, protocol=proto, connection=cid, **f)


def test_connection_counters() -> None:
    status = ForwardStatus()
    stats = status.add_target(T, PORTS)
    status.apply(event(EventKind.LISTENING, local="127.0.0.1:8080", remote=80, protocol="tcp"))
    status.apply(event(EventKind.LISTENING, local="[::1]:8080", remote=80, protocol="tcp"))
    status.apply(event(EventKind.CONNECTED, protocol="websocket"))
    for cid in (1, 2, 3):
        status.apply(conn(EventKind.CONNECTION_OPENED, cid))
    status.apply(conn(EventKind.CONNECTION_CLOSED, 1, bytes_in=10, bytes_out=20))
    status.apply(conn(EventKind.CONNECTION_ERROR, 2, error="refused"))
    status.add_bytes(T, 80, "tcp", inbound=5, outbound=7)
    status.add_bytes(T, 53, "udp", inbound=1, outbound=2)
    status.add_bytes("other/pod", 80, "tcp", inbound=1, outbound=1)  # unknown target: ignored
    web, dns = stats.ports
    assert web.locals == ["127.0.0.1:8080", "[::1]:8080"]
    assert (web.active, web.total, web.errors, web.bytes_in, web.bytes_out) == (1, 3, 1, 5, 7)
    assert (dns.active, dns.total, dns.bytes_in, dns.bytes_out) == (0, 0, 1, 2)
    assert stats.active == 1
    assert stats.last_error == web.last_error == "refused"
    assert stats.session_error == "" and dns.last_error == ""
    # A failure before a connection existed (UDP open failed, peer limit) counts, opens none.
    status.apply(conn(EventKind.CONNECTION_ERROR, 0, remote=53, proto="udp", error="limit"))
    assert (dns.active, dns.errors) == (0, 1)


def test_state_transitions() -> None:
    status = ForwardStatus()
    stats = status.add_target(T, PORTS)
    assert stats.state is TargetState.CONNECTING
    steps = [
        (EventKind.RECONNECTING, TargetState.RECONNECTING),
        (EventKind.CONNECTED, TargetState.CONNECTED),
        (EventKind.CONNECTION_ERROR, TargetState.CONNECTED),  # one connection: no change
        (EventKind.SESSION_LOST, TargetState.RECONNECTING),
        (EventKind.RECONNECTED, TargetState.CONNECTED),
        (EventKind.POD_REPLACED, TargetState.RECONNECTING),
        (EventKind.RECONNECTED, TargetState.CONNECTED),
        (EventKind.TARGET_GONE, TargetState.GONE),
        (EventKind.RECONNECTED, TargetState.GONE),  # final states stay
        (EventKind.STOPPED, TargetState.GONE),
    ]
    for i, (kind, state) in enumerate(steps):
        status.apply(
            ForwardEvent(kind, T, 100.0 + i, error="why" if kind.name.startswith("T") else "")
        )
        assert stats.state is state, (kind, stats.state)
    assert (stats.reconnects, stats.sessions_lost) == (3, 1)
    assert stats.session_error == "why"  # from target_gone
    assert stats.since == 107.0  # when it became gone
    assert status.alive == []


def test_denied_and_failed_are_final() -> None:
    for kind, state in (
        (EventKind.TARGET_DENIED, TargetState.DENIED),
        (EventKind.TARGET_FAILED, TargetState.FAILED),
        (EventKind.LISTEN_FAILED, TargetState.FAILED),
        (EventKind.STOPPED, TargetState.STOPPED),
    ):
        status = ForwardStatus()
        stats = status.add_target(T, PORTS)
        status.apply(event(kind))
        status.apply(event(EventKind.CONNECTED))
        assert stats.state is state


def test_json_lines() -> None:
    out = io.StringIO()
    status = ForwardStatus()
    status.add_target(T, PORTS)
    status.subscribe(JsonRenderer(out))
    status.apply(event(EventKind.LISTENING, local="127.0.0.1:8080", remote=80, protocol="tcp"))
    status.apply(conn(EventKind.CONNECTION_CLOSED, 4, bytes_in=1, bytes_out=2, peer="127.0.0.1:5"))
    status.apply(event(EventKind.SESSION_LOST, error="connection closed"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {
            "event": "listening",
            "target": T,
            "time": 1000.0,
            "local": "127.0.0.1:8080",
            "remote": 80,
            "protocol": "tcp",
        },
        {
            "event": "connection_closed",
            "target": T,
            "time": 1000.0,
            "local": "127.0.0.1:8080",
            "remote": 80,
            "protocol": "tcp",
            "bytes_in": 1,
            "bytes_out": 2,
            "connection": 4,
            "peer": "127.0.0.1:5",
        },
        {"event": "session_lost", "target": T, "time": 1000.0, "error": "connection closed"},
    ]


def test_plain_lines() -> None:
    out = io.StringIO()
    render = PlainRenderer(out, several=False)
    render(event(EventKind.LISTENING, local="127.0.0.1:8080", remote=80, protocol="tcp"))
    render(event(EventKind.LISTENING, local="[::1]:5353", remote=53, protocol="udp"))
    render(conn(EventKind.CONNECTION_ERROR, 2, error="refused", peer="127.0.0.1:9"))
    first, second, third = out.getvalue().splitlines()
    assert first == "Forwarding from 127.0.0.1:8080 -> 80"  # kubectl's line
    assert second == "Forwarding from [::1]:5353 -> 53/udp"
    assert third.endswith("default/web: connection 2 from 127.0.0.1:9 to 80: error: refused")


def test_table_and_sizes() -> None:
    status = ForwardStatus()
    status.add_target(T, PORTS)
    table = status_table(status)
    assert table.row_count == 2 and len(table.columns) == 11
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 * 1024**2, 3 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]
