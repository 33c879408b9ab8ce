"""`make bench`'s image part end to end at a small size: every tool pulls the right image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The whole part (registry, containerd, a podgate daemon, three pulls) on a loaded machine.
BENCH_TIMEOUT_SECONDS = 300


def test_images_part_pulls_with_every_tool(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: containerd and the podgate runtime")
    out = tmp_path / "results.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench", "--no-throughput", "--conns", "0"),
            *("--sessions", "0", "--skip-kubectl", "--skip-socat", "--startup-runs", "0"),
            *("--only", "images", "--image-size", "2M"),
            *("--runs", "1", "--json", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    section = json.loads(out.read_text())["images"]
    assert {r["tool"] for r in section["rows"]} == {"podgate", "podgate-cri", "containerd"}
    for row in section["rows"]:
        assert row["error"] is None, row
        assert row["wall"] > 0 and row["cpu"] >= 0
    podgate_ids = {r["image_id"] for r in section["rows"] if r["tool"].startswith("podgate")}
    assert len(podgate_ids) == 1
    assert section["unpacked_bytes"] > 2 * 1024 * 1024
    assert "image pull + unpack" in done.stdout
    assert "images" in (tmp_path / "results.md").read_text()
