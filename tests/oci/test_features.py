"""podgate.oci.features against this node's real runc and cgroups."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from podgate.oci import features
from podgate.oci.adjust import check


@pytest.fixture
def runc() -> str:
    path = shutil.which("runc")
    if path is None:
        pytest.skip("runc is not installed")
    return path


def test_the_probe_reads_runc_and_the_cgroups(runc: str) -> None:
    support = features.probe(runc)
    first_line = subprocess.run(
        [runc, "--version"], check=True, capture_output=True, text=True
    ).stdout
    release = first_line.split()[2].split("+")[0]  # "runc version 1.1.5+ds1"
    assert support.runtime == f"runc {release}"
    version = tuple(int(p) for p in release.split("."))
    assert support.io_priority is (version >= (1, 2, 0))
    assert support.scheduler is (version >= (1, 2, 0))
    assert "mount" in support.namespaces and "network" in support.namespaces
    assert support.seccomp_actions is not None and "SCMP_ACT_ERRNO" in support.seccomp_actions
    assert support.cgroup_v2 is os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    if not support.cgroup_v2:
        mounted = {d for d in os.listdir("/sys/fs/cgroup") if os.path.isdir(f"/sys/fs/cgroup/{d}")}
        assert support.controllers == mounted
    # What the probe says decides what is refused.
    pages = {"resources": {"hugepageLimits": [{"pageSize": "2MB", "limit": 2097152}]}}
    assert bool(check(pages, support)) is ("hugetlb" not in support.controllers)


def test_an_unknown_binary_supports_nothing_optional() -> None:
    support = features.probe("/nonexistent/runc")
    assert support.runtime == "runc 0.0.0"
    assert not (support.io_priority or support.scheduler or support.memory_policy)
