from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import RunningServers, demo_servers


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServers]:
    """The demo API (pod default/demo) with echo and sink targets, in a background thread."""
    with demo_servers(str(tmp_path_factory.mktemp("demo"))) as servers:
        yield servers


# With PODGATE_TEST_STRICT=1 (.ci/run sets it) a test skipped for a missing part of the
# environment — kubectl, containerd, runc, CNI plugins, the registry, root — fails instead: a
# green CI run must have run every layer. Only what this kernel cannot have stays a skip.
STRICT_ENV = "PODGATE_TEST_STRICT"
KERNEL_LIMITS = (
    "no AF_VSOCK",
    "no vsock loopback transport",
    "no IPv6 loopback",
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not report.skipped or os.environ.get(STRICT_ENV) != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(limit in reason for limit in KERNEL_LIMITS):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under {STRICT_ENV}=1 (the environment must provide it): {reason}"


def _in_use(directory: Path) -> bool:
    """Whether a live process has its cwd or an open file under `directory`."""
    prefix = str(directory) + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/cwd")]
            fds = f"/proc/{pid}/fd"
            links += [os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds)]
        except OSError:
            continue
        if any(link == str(directory) or link.startswith(prefix) for link in links):
            return True
    return False


@pytest.fixture(scope="session", autouse=True)
def _short_run_roots() -> Iterator[None]:
    """Daemons whose state directory is too deep for socket paths keep their run directory
    under the short run root (/run/podgate/<hash>), which outlives the test's state directory:
    remove the ones this session made once nothing uses them."""
    from podgate.runtime.store import SHORT_RUN_ROOT

    root = Path(SHORT_RUN_ROOT)
    before = set(os.listdir(root)) if root.is_dir() else set()
    yield
    if not root.is_dir():
        return
    for name in set(os.listdir(root)) - before:
        path = root / name
        if path.is_dir() and not path.is_symlink() and not _in_use(path):
            shutil.rmtree(path, ignore_errors=True)
