"""cgroup v1 and v2 readings from a fake hierarchy, and runc's error extraction."""

from __future__ import annotations

import json
from pathlib import Path

from podgate.oci import cgroups
from podgate.oci.runc import Runc


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1(tmp_path: Path) -> None:
    cg = "/podgate/pod/c1"
    write(tmp_path / "cpuacct" / cg.lstrip("/") / "cpuacct.usage", "12345\n")
    mem = tmp_path / "memory" / cg.lstrip("/")
    write(mem / "memory.usage_in_bytes", "1000\n")
    write(mem / "memory.stat", "total_inactive_file 300\ntotal_rss 600\ntotal_pgfault 9\n")
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    write(mem / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    write(tmp_path / "pids" / cg.lstrip("/") / "pids.current", "3\n")
    assert not cgroups.is_v2(str(tmp_path))
    stats = cgroups.stats(cg, str(tmp_path))
    assert (stats.cpu_usage_ns, stats.memory_usage, stats.memory_working_set) == (12345, 1000, 700)
    assert (stats.memory_rss, stats.page_faults, stats.pids) == (600, 9, 3)
    assert cgroups.memory_limit(cg, str(tmp_path)) == 0  # unlimited
    assert cgroups.oom_kills(cg, str(tmp_path)) == 2
    assert cgroups.oom_kills("/other", str(tmp_path)) == 0


def test_v2(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "cpu memory pids\n")
    base = tmp_path / "podgate" / "c1"
    write(base / "cpu.stat", "usage_usec 7\nuser_usec 5\n")
    write(base / "memory.current", "2000\n")
    write(base / "memory.stat", "anon 1500\ninactive_file 500\n")
    write(base / "memory.max", "4096\n")
    write(base / "memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroups.is_v2(str(tmp_path))
    stats = cgroups.stats("/podgate/c1", str(tmp_path))
    assert (stats.cpu_usage_ns, stats.memory_working_set, stats.memory_rss) == (7000, 1500, 1500)
    assert cgroups.memory_limit("/podgate/c1", str(tmp_path)) == 4096
    assert cgroups.oom_kills("/podgate/c1", str(tmp_path)) == 1


def test_set_limits_v1_writes_each_controller(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "cpu").mkdir()
    limits = cgroups.Limits(memory=64 << 20, cpu_quota=30000, cpu_period=50000, cpu_shares=512)
    cgroups.set_limits("/podgate/pod1", limits, str(tmp_path))
    mem, cpu = tmp_path / "memory" / "podgate" / "pod1", tmp_path / "cpu" / "podgate" / "pod1"
    assert (mem / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (cpu / "cpu.cfs_period_us").read_text() == "50000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "30000"
    assert (cpu / "cpu.shares").read_text() == "512"
    # Unlimited again: -1 in v1; shares left as they are when none is given.
    cgroups.set_limits("/podgate/pod1", cgroups.Limits(), str(tmp_path))
    assert (mem / "memory.limit_in_bytes").read_text() == "-1"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "-1"
    assert (cpu / "cpu.shares").read_text() == "512"


def test_set_limits_v2_uses_the_unified_files(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "cpu memory\n")
    cgroups.set_limits("/podgate/pod1", cgroups.Limits(cpu_shares=1024), str(tmp_path))
    base = tmp_path / "podgate" / "pod1"
    assert (base / "memory.max").read_text() == "max"
    assert (base / "cpu.max").read_text() == "max 100000"
    assert (base / "cpu.weight").read_text() == "39"  # runc's conversion of 1024 shares
    cgroups.set_limits(
        "/podgate/pod1", cgroups.Limits(memory=1 << 30, cpu_quota=5000), str(tmp_path)
    )
    assert (base / "memory.max").read_text() == str(1 << 30)
    assert (base / "cpu.max").read_text() == "5000 100000"


def test_runc_error_is_its_own_message(tmp_path: Path) -> None:
    log = tmp_path / "runc.log"
    old = json.dumps({"level": "error", "msg": "old failure"}) + "\n"
    log.write_text(old)
    runc = Runc("runc", str(tmp_path / "root"), str(log))
    offset = len(old)
    with open(log, "a") as f:
        f.write(json.dumps({"level": "warning", "msg": "ignored"}) + "\n")
        f.write(json.dumps({"level": "error", "msg": 'exec: "nope": not found'}) + "\n")
    assert runc.error_since(offset) == 'exec: "nope": not found'
    assert runc.error_since(log.stat().st_size, b"from stderr\n") == "from stderr"
    assert runc.argv("state", "x")[:7] == [
        "runc",
        "--root",
        str(tmp_path / "root"),
        "--log",
        str(log),
        "--log-format",
        "json",
    ]
