"""Tables for the terminal (rich) and for bench/README.md (Markdown), from the summaries."""

from __future__ import annotations

from typing import Any

from rich.console import Console, JustifyMethod
from rich.table import Table

from bench.common import format_size
from bench.portforward import PATHS

THROUGHPUT_HEADERS = (
    "path",
    "dir",
    "GB/s (min–max)",
    "× direct (min–max)",
    "server s/GB",
    "client s/GB",
    "relay s/GB",
    "verified",
)
THROUGHPUT_NOTE = (
    "GB = 10^9 bytes. CPU seconds (user+sys) per GB moved: server = the podgate API server "
    "process, client = the client process, relay = socat or kubectl."
)
CONN_HEADERS = (
    "path",
    "new",
    "n",
    "p50 ms (min–max)",
    "p99 ms (min–max)",
    "conns/s (min–max)",
    "× direct",
    "server µs/conn",
    "relay µs/conn",
)
CONN_NOTE = (
    "Sequential; latency = open to 1-byte echo back. stream = error+data stream pair on one open "
    "session; session = HTTP upgrade + one stream; CPU µs per connection as above."
)
# Wide enough for the tables when stdout is not a terminal (make bench | tee ...).
REPORT_WIDTH = 160
_KIND_LABELS = {
    "connect": "TCP conn",
    "stream": "stream",
    "session": "session",
}


def _fmt(spread: dict[str, float] | None, digits: int = 2, scale: float = 1.0) -> str:
    if spread is None:
        return "–"
    med, lo, hi = (spread[k] * scale for k in ("median", "min", "max"))
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def _fmt_ratio(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "–"
    return f"{spread['median']:.3f}× ({spread['min']:.3f}–{spread['max']:.3f})"


def _median(spread: dict[str, float] | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if spread is None else f"{spread['median'] * scale:.{digits}f}"


def throughput_rows(summary: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in summary:
        if s["ok_runs"]:
            size = format_size(s["verified_bytes"][0])
            verified = f"{s['ok_runs']}/{s['runs']} × {size}"
        else:
            verified = "FAILED: " + "; ".join(s["errors"])[:120]
        rows.append(
            [
                s["path"],
                s["direction"],
                _fmt(s["gbps"], 3),
                "1" if s["path"] == "direct" else _fmt_ratio(s["ratio"]),
                _median(s["server_cpu_s_per_gb"]),
                _median(s["client_cpu_s_per_gb"]),
                _median(s["relay_cpu_s_per_gb"]),
                verified,
            ]
        )
    return rows


def conn_rows(summary: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in summary:
        if not s["ok_runs"]:
            rows.append(
                [s["path"], _KIND_LABELS[s["kind"]], "FAILED", "; ".join(s["errors"])[:120]]
            )
            continue
        rows.append(
            [
                s["path"],
                _KIND_LABELS[s["kind"]],
                str(min(s["count"])),
                _fmt(s["p50_us"], 3, 1e-3),
                _fmt(s["p99_us"], 3, 1e-3),
                _fmt(s["conns_per_s"], 0),
                "1" if s["path"] == "direct" else _fmt_ratio(s["ratio"]),
                _median(s["server_cpu_us_per_conn"], 0),
                _median(s["relay_cpu_us_per_conn"], 0),
            ]
        )
    return rows


# A section's tables: (title, caption, headers, rows).
SectionTables = list[tuple[str, str, tuple[str, ...], list[list[str]]]]


def print_tables(
    tables: SectionTables, notes: list[str], console: Console, *, label_columns: int = 1
) -> None:
    """Each non-empty table (the first `label_columns` left-aligned), then the notes."""
    for name, note, headers, table_rows in tables:
        if not table_rows:
            continue
        table = Table(title=name, title_justify="left", caption=note)
        table.caption_justify = "left"
        for i, header in enumerate(headers):
            justify: JustifyMethod = "left" if i < label_columns else "right"
            table.add_column(header, justify=justify, overflow="fold")
        for row in table_rows:
            table.add_row(*row)
        console.print(table)
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]", highlight=False)


def markdown_tables(tables: SectionTables, notes: list[str]) -> str:
    lines: list[str] = []
    for name, note, headers, table_rows in tables:
        if not table_rows:
            continue
        lines += [name, "", note, ""]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "|".join("---" for _ in headers) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in table_rows]
        lines.append("")
    lines += notes
    return "\n".join(lines) + "\n"


def _title(meta: dict[str, Any]) -> str:
    return (
        f"podgate port-forward, {format_size(meta['size'])} per run, "
        f"median of {meta['runs']} run(s) (min–max); podgate on {meta.get('podgate_loop', '?')}"
    )


def print_report(data: dict[str, Any], console: Console) -> None:
    meta = data["meta"]
    tables = (
        (
            _title(meta),
            THROUGHPUT_NOTE,
            THROUGHPUT_HEADERS,
            throughput_rows(data["summary"]["throughput"]),
        ),
        ("new connections", CONN_NOTE, CONN_HEADERS, conn_rows(data["summary"]["conns"])),
    )
    for title, note, headers, rows in tables:
        if not rows:
            continue
        table = Table(title=title, title_justify="left", caption=note, caption_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i < 2 else "right", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for name, reason in data["skipped"].items():
        console.print(f"[yellow]skipped {name}: {reason}[/yellow]")
    console.print(
        f"{meta['date']}; {meta['cpus']} CPUs ({meta['cpu_model']}); kernel {meta['kernel']}; "
        f"Python {meta['python']}; kubectl {meta.get('kubectl', '–')}; "
        f"{meta.get('socat', 'socat –')}"
    )


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [f"{_title(meta)}", ""]
    for headers, note, rows in (
        (THROUGHPUT_HEADERS, THROUGHPUT_NOTE, throughput_rows(data["summary"]["throughput"])),
        (CONN_HEADERS, CONN_NOTE, conn_rows(data["summary"]["conns"])),
    ):
        if not rows:
            continue
        lines += [note, ""]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "|".join("---" for _ in headers) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    for name, reason in data["skipped"].items():
        lines.append(f"Skipped {name}: {reason}")
    lines.append(
        f"{meta['date']}; {meta['cpus']} CPUs ({meta['cpu_model']}); kernel {meta['kernel']}; "
        f"Python {meta['python']}; kubectl {meta.get('kubectl', '–')}; "
        f"{meta.get('socat', 'socat –')}"
    )
    return "\n".join(lines) + "\n"


def path_descriptions() -> str:
    return "\n".join(f"  {p.name:<15} {p.description}" for p in PATHS)
