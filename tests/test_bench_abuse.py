"""`make bench`'s streams-under-abuse parts at a bounded size, through a real `podgate up` and
kubectl 1.33: the PING flood beside another user's kubectl execs, and the port-forward soak
beside a flood and a never-reading pod. Correctness and memory are asserted; the timings are
only reported (by `make bench`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.abuse import RSS_BOUND_BYTES, STALL_PORT  # noqa: E402

from process_support import processes_mentioning  # noqa: E402
from test_bench_smoke import run_bench  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

ONLY = (
    *("--paths", "direct", "--conns", "0", "--sessions", "0", "--no-throughput"),
    *("--no-runtime", "--no-gateway", "--no-forward", "--no-authflood", "--no-podstart"),
    *("--no-proxy", "--no-manyforwards", "--startup-runs", "0"),
)
# kubectl execs per period: enough to overlap many flood sessions.
EXECS = 10
# The soak's bounded size: 8 port-forwards moving 256 MiB in 4 MiB echoes (32 connections).
SOAK_FORWARDS = 8
SOAK_SIZE = "256M"
SOAK_CONNECTION_SIZE = "4M"


# In the command line of the `data` pod's server and of nothing else.
POD_SERVER_MARK = f"args=({STALL_PORT}, held.append)"


@pytest.fixture(autouse=True)
def _root() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("podgate up runs pods in Linux namespaces: needs root")
    yield
    # The bench stopped `podgate up` in time for it to remove its pod: nothing is left.
    assert processes_mentioning(POD_SERVER_MARK) == []
    assert processes_mentioning("/tmp/pgab") == []


def test_ping_flood_beside_kubectl_exec(tmp_path: Path) -> None:
    results, report = run_bench(
        tmp_path, *ONLY, "--pingflood", "--pingflood-execs", str(EXECS), timeout=600
    )
    ping = results["abuse"]["pingflood"]
    # Every exec of the other user ran and printed its own line, quiet and under the flood.
    assert ping["quiet"]["n"] == ping["busy"]["n"] == EXECS
    assert ping["quiet"]["failures"] == [] and ping["busy"]["failures"] == []
    flood = ping["flood"]
    assert ping["flood_outlasted_execs"], ping
    assert flood["upgraded"] > 0, flood
    # Once a session of the flooder's was ended, its reconnects are refused (429) for the
    # cool-down: the flood costs refusals, not sessions.
    assert flood["refused"] > 0, flood
    # The gateway ended every flooded session itself (GOAWAY, or the connection closed) but
    # the one each client was flooding when it was stopped.
    ended = flood["goaway"] + flood["closed"]
    assert ended + flood["interrupted"] == flood["upgraded"], flood
    assert flood["interrupted"] <= ping["flood_processes"], flood
    assert flood["open_at_deadline"] == 0, flood
    assert flood["goaway"] > 0, flood
    assert ping["rss_growth"] <= RSS_BOUND_BYTES, ping
    assert "PING flood" in report
    print(f"PING flood: {flood}; RSS growth {ping['rss_growth'] >> 20} MiB")


def test_soak_port_forwards_with_churn(tmp_path: Path) -> None:
    results, report = run_bench(
        tmp_path,
        *ONLY,
        *("--soak", "--soak-forwards", str(SOAK_FORWARDS), "--soak-size", SOAK_SIZE),
        *("--soak-connection-size", SOAK_CONNECTION_SIZE),
        timeout=600,
    )
    soak = results["abuse"]["soak"]
    assert soak["connections"] == soak["planned_connections"] == 32, soak
    assert soak["bad_connections"] == 0 and soak["errors"] == 0, soak
    assert soak["lost_bytes"] == 0
    assert soak["moved_bytes"] == 256 * 1024 * 1024
    assert soak["stalled_pushed"] > 0, soak
    assert soak["rss_growth"] <= RSS_BOUND_BYTES, soak
    assert "Soak" in report
    print(
        f"soak: {soak['connections']} connections, {soak['moved_bytes'] >> 20} MiB in "
        f"{soak['seconds']:.1f} s; RSS {soak['rss_start'] >> 20} -> {soak['rss_peak'] >> 20} "
        f"-> {soak['rss_after'] >> 20} MiB"
    )
