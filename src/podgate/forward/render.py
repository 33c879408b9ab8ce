"""How a port-forward's events and counters are shown: log lines, JSON lines, a live table.

Each renderer subscribes to a `ForwardStatus`; the model knows nothing about them.
"""

from __future__ import annotations

import json
import time
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from podgate.forward.status import EventKind, ForwardEvent, ForwardStatus, TargetState

# Screen refreshes of the live table per second.
LIVE_REFRESH_PER_SECOND = 4
# Longest "last error" shown in a table cell.
TABLE_ERROR_CHARS = 60

_STATE_STYLE = {
    TargetState.CONNECTING: "yellow",
    TargetState.CONNECTED: "green",
    TargetState.RECONNECTING: "yellow",
    TargetState.GONE: "red",
    TargetState.DENIED: "red",
    TargetState.FAILED: "red",
    TargetState.STOPPED: "dim",
}


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def forwarding_line(event: ForwardEvent) -> str:
    """kubectl's own line for a listener: "Forwarding from 127.0.0.1:8080 -> 80"."""
    remote = str(event.remote) if event.protocol in ("", "tcp") else f"{event.remote}/udp"
    return f"Forwarding from {event.local} -> {remote}"


def describe(event: ForwardEvent) -> str:
    """One line of text for an event (without time and target)."""
    kind = event.kind
    conn = f"connection {event.connection} from {event.peer or event.local} to {event.remote}"
    if kind is EventKind.LISTENING:
        return forwarding_line(event)
    if kind is EventKind.CONNECTED:
        return f"connected ({event.protocol})"
    if kind is EventKind.RECONNECTED:
        return f"reconnected ({event.protocol})"
    if kind is EventKind.CONNECTION_OPENED:
        return f"{conn}: opened"
    if kind is EventKind.CONNECTION_CLOSED:
        return (
            f"{conn}: closed (in {human_bytes(event.bytes_in)}, out {human_bytes(event.bytes_out)})"
        )
    if kind is EventKind.CONNECTION_ERROR:
        return f"{conn}: error: {event.error}"
    text = kind.value.replace("_", " ")
    return f"{text}: {event.error}" if event.error else text


class _LineWriter:
    """Writes whole lines and flushes; a reader that went away (`| head`) silences it rather
    than failing the forward."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.closed = False

    def write_line(self, line: str) -> None:
        if self.closed:
            return
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (OSError, ValueError):
            self.closed = True


class PlainRenderer(_LineWriter):
    """One line per event, for logs and pipes. The listener lines are kubectl's own."""

    def __init__(self, out: IO[str], *, several: bool) -> None:
        super().__init__(out)
        self.several = several

    def __call__(self, event: ForwardEvent) -> None:
        if event.kind is EventKind.LISTENING:
            line = forwarding_line(event)
            if self.several:
                line += f" ({event.target})"
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            line = f"{stamp} {event.target}: {describe(event)}"
        self.write_line(line)


class JsonRenderer(_LineWriter):
    """One JSON object per event and line (`--json`)."""

    def __call__(self, event: ForwardEvent) -> None:
        self.write_line(json.dumps(event.as_json(), separators=(",", ":")))


def status_table(status: ForwardStatus) -> Table:
    """The live view: a row per port pair of every target."""
    table = Table(expand=False, header_style="bold")
    for name in (
        "target",
        "local → remote",
        "proto",
        "state",
        "active",
        "total",
        "in",
        "out",
        "errors",
        "reconnects",
        "last error",
    ):
        justify = (
            "right" if name in ("active", "total", "in", "out", "errors", "reconnects") else "left"
        )
        table.add_column(name, justify=justify, no_wrap=name != "last error")  # type: ignore[arg-type]
    for target in status.targets.values():
        for i, port in enumerate(target.ports):
            first = i == 0
            locals_text = ", ".join(port.locals) or str(port.spec.local or "-")
            state = (
                Text(target.state.value, style=_STATE_STYLE[target.state]) if first else Text("")
            )
            # Why the target has no session (its first row), else this pair's last failure.
            error = (target.session_error if first else "") or port.last_error
            if len(error) > TABLE_ERROR_CHARS:
                error = error[: TABLE_ERROR_CHARS - 1] + "…"
            table.add_row(
                target.name if first else "",
                f"{locals_text} → {port.spec.remote}",
                port.spec.protocol.value,
                state,
                str(port.active),
                str(port.total),
                human_bytes(port.bytes_in),
                human_bytes(port.bytes_out),
                str(port.errors),
                str(target.reconnects) if first else "",
                error,
            )
    return table


class LiveEvents:
    """Above the live table, the events a person should notice (not every connection)."""

    SHOWN = frozenset(
        {
            EventKind.LISTENING,
            EventKind.LISTEN_FAILED,
            EventKind.SESSION_LOST,
            EventKind.RECONNECTED,
            EventKind.POD_REPLACED,
            EventKind.CONNECTION_ERROR,
            EventKind.TARGET_GONE,
            EventKind.TARGET_DENIED,
            EventKind.TARGET_FAILED,
        }
    )

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: ForwardEvent) -> None:
        if event.kind not in self.SHOWN:
            return
        if event.kind is EventKind.LISTENING:
            self.console.print(forwarding_line(event), highlight=False)
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        self.console.print(
            f"{stamp} {event.target}: {describe(event)}", highlight=False, markup=False
        )
