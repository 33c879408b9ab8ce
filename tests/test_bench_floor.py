"""bench.floor at a small size: socat's relay, plain and TLS, every byte checked."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.floor import run_floor, summarize


def test_floor_relays_every_byte_and_accounts_the_relay() -> None:
    if shutil.which("socat") is None:
        pytest.skip("socat is not installed (apt-get install socat)")
    data = run_floor(32 << 20, 1)
    rows = data["rows"]
    assert [(r["path"], r["direction"]) for r in rows] == [
        (p, d) for p in ("direct", "socat", "socat-tls") for d in ("upload", "download")
    ]
    assert all(r["ok"] for r in rows), rows
    for row in summarize(data):
        if row["path"] == "direct":
            assert row["relay_cpu_s_per_gb"] is None
        else:  # a relay that moved 32 MiB used some CPU, read before it was reaped
            assert row["relay_cpu_s_per_gb"] > 0, row
    assert all(r["cipher"].startswith("TLS_") for r in rows if r["path"] == "socat-tls"), rows
    assert data["sha256_s_per_gb"] > 0
