"""Command start-up: `podgate --help` and the in-pod forwarder `podgate agent forward PORT` (one
process per exec-backend connection), against `kubectl version --client` in the same run.

Wall time of the whole process, median of `runs` (min–max); the forwarder connects to a
loopback listener that closes at once, so its time is start-up plus one connect.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from bench.portforward import _spread
from bench.report import SectionTables, markdown_tables, print_tables

RUNS = 15
COMMAND_TIMEOUT_SECONDS = 30.0
HEADERS = ("command", "wall ms (min–max)", "× kubectl version --client")
NOTE = "Wall time of a whole process, median of the runs; kubectl is the peer of the same run."


def _closing_listener() -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _time(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # wait(timeout=...) polls in sleeps of up to 50 ms: a watchdog keeps the wait exact.
        watchdog = threading.Timer(COMMAND_TIMEOUT_SECONDS, proc.kill)
        watchdog.start()
        try:
            proc.wait()
        finally:
            watchdog.cancel()
        times.append(time.perf_counter() - start)
    return times


def run_startup(runs: int = RUNS, progress: Callable[[str], None] = print) -> dict[str, Any]:
    kubectl = shutil.which("kubectl")
    server, _ = _closing_listener()
    port = server.getsockname()[1]
    podgate = [sys.executable, "-m", "podgate"]
    commands = {
        "podgate --help": [*podgate, "--help"],
        "podgate agent forward PORT": [*podgate, "agent", "forward", str(port)],
    }
    if kubectl is not None:
        commands["kubectl version --client"] = [kubectl, "version", "--client"]
    results: dict[str, Any] = {}
    try:
        for name, argv in commands.items():
            progress(f"startup: {name} x {runs}")
            results[name] = _time(argv, runs)
    finally:
        server.close()
    peer = results.get("kubectl version --client")
    rows = []
    for name, times in results.items():
        wall = _spread(times)
        ratio = None if peer is None else _spread([t / statistics.median(peer) for t in times])
        rows.append({"command": name, "wall_s": wall, "x_kubectl": ratio})
    return {"runs": runs, "cpu_count": os.cpu_count(), "rows": rows}


def _rows(data: dict[str, Any]) -> list[list[str]]:
    out = []
    for row in data["rows"]:
        wall = row["wall_s"]
        ratio = row["x_kubectl"]
        out.append(
            [
                row["command"],
                f"{wall['median'] * 1e3:.0f} ({wall['min'] * 1e3:.0f}–{wall['max'] * 1e3:.0f})",
                "–" if ratio is None else f"{ratio['median']:.2f}",
            ]
        )
    return out


def _tables(data: dict[str, Any]) -> SectionTables:
    return [("Command start-up", NOTE, HEADERS, _rows(data))]


def print_report(data: dict[str, Any], console: Console) -> None:
    print_tables(_tables(data), [], console)


def markdown(data: dict[str, Any]) -> str:
    return markdown_tables(_tables(data), [])
