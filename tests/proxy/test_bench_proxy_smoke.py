"""The proxy section of `make bench` at a tiny size: it runs end to end, every byte comes back
verified, and both paths of each table are measured in the same run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import proxy as bench_proxy  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]


def test_the_proxy_bench_measures_both_paths_with_verified_bytes() -> None:
    if os.geteuid() != 0:
        pytest.skip("containerd and runc need root")
    section = bench_proxy.run_proxy(calls=20, size=1024 * 1024, runs=1, progress=lambda m: None)
    assert section["error"] is None, section["error"]
    assert [(r["method"], r["path"]) for r in section["unary"]] == [
        (method, path)
        for method in ("Version", "PodSandboxStatus")
        for path in ("direct", "proxy (relay)", "proxy (grpc)", bench_proxy.SOCAT_PATH)
    ]
    for row in section["unary"]:
        assert row["calls"] == 20
        assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"]
    # Every path but direct runs through a process of the bench's, whose CPU is counted.
    assert set(section["cpu_us_per_call"]) == {
        "proxy (relay)",
        "proxy (grpc)",
        bench_proxy.SOCAT_PATH,
    }
    assert all(us > 0 for us in section["cpu_us_per_call"].values())
    paths = [r["path"] for r in section["throughput"]]
    assert len(paths) == 2 and len(set(paths)) == 2
    assert all(r["verified"] and r["seconds"] > 0 for r in section["throughput"])
    assert not bench_proxy.failed(section)
    text = bench_proxy.markdown(section)
    assert "added p50" in text and "CPU/call" in text and "× containerd" in text
