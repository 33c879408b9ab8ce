"""`make bench`'s pod start part, bounded: both runtimes start pods from the same image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# containerd, a podgate daemon, an image import and four pods on a loaded machine.
BENCH_TIMEOUT_SECONDS = 300
PODS = 2


def test_podstart_part_starts_pods_in_both_runtimes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: containerd and the podgate runtime")
    out = tmp_path / "results.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench", "--no-throughput", "--conns", "0"),
            *("--sessions", "0", "--skip-kubectl", "--skip-socat", "--only", "podstart"),
            *("--startup-runs", "0", "--podstart-pods", str(PODS)),
            *("--runs", "1", "--json", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    section = json.loads(out.read_text())["podstart"]
    assert sorted(r["tool"] for r in section["rows"]) == ["containerd"] * PODS + ["podgate"] * PODS
    for row in section["rows"]:
        assert row["error"] is None, row
        assert row["seconds"] > 0 and row["sandbox"] and row["container"]
    for tool in ("podgate", "containerd"):
        memory = section["memory"][tool]
        assert len(memory) == PODS
        # Per pod: live processes with PSS: containerd's shim and pause; podgate's shim (its
        # plain pods' namespaces are pinned by bind mounts, no holder process).
        least = 2 if tool == "containerd" else 1
        assert all(m["pids"] >= least and m["kib"] > 0 for m in memory), memory
        assert all(v > 0 for m in memory for v in m["by_process"].values()), memory
    # One sandboxed pod in the same daemon, measured beside the plain ones: its container's
    # shim, the sandbox shim (the muxer runs in it), its agent and the guest's PID 1 (holder
    # and namespace process at once), counted once each.
    [sandboxed] = section["sandboxed"]
    assert sandboxed["error"] is None, sandboxed
    roles = set(sandboxed["memory"]["by_process"])
    assert roles == {"container shim", "sandbox shim", "agent", "guest PID 1"}, roles
    assert sandboxed["memory"]["pids"] == 4
    assert all(v > 0 for v in sandboxed["memory"]["by_process"].values()), sandboxed
    # The second stage of the helper forker, which forks the sandbox shims, is reported beside
    # the pods (one per node).
    assert set(section["node"]) == {"podgate helper forker", "podgate sandbox forker"}
    assert section["sandboxed_summary"]["pss_ratio"] > 0
    assert "pod start" in done.stdout
    assert "one sandboxed pod" in done.stdout
    assert "pod start" in (tmp_path / "results.md").read_text()
