"""The runc driver, the overlay root and cgroup readings against the real runc (root only):
a busybox container created, started, inspected, updated, signalled and deleted."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from busybox_rootfs import make_rootfs
from podgate.model import ContainerSpec, NamespaceMode
from podgate.oci import bundle, cgroups, overlay, spec
from podgate.oci.runc import Runc, RuncError

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runc and overlay mounts"),
]
# Bound on waiting for a state change of the container, seconds.
WAIT_SECONDS = 15.0


@pytest.fixture
def runc_env(tmp_path: Path) -> Iterator[tuple[Runc, Path]]:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    lower = make_rootfs(tmp_path / "lower")
    (lower / "etc" / "from-image").write_text("image\n")
    b = tmp_path / "bundle"
    b.mkdir()
    overlay.mount_overlay([str(lower)], str(b / "upper"), str(b / "work"), str(b / "rootfs"))
    runc = Runc(shutil.which("runc") or "runc", str(tmp_path / "state"), str(tmp_path / "runc.log"))
    try:
        yield runc, b
    finally:
        try:
            runc.run_sync(["delete", "--force", "oci-test"])
        except RuncError:
            pass
        overlay.unmount(str(b / "rootfs"))
        cgroups.remove(spec.cgroups_path("/podgate-oci-test", "oci-test"))
        cgroups.remove("/podgate-oci-test")
    assert not overlay.is_mounted(str(b / "rootfs"))


async def wait_status(runc: Runc, want: str) -> dict[str, object]:
    async with asyncio.timeout(WAIT_SECONDS):
        while True:
            state = await runc.state("oci-test")
            if state["status"] == want:
                return state
            await asyncio.sleep(0.05)


async def test_lifecycle(runc_env: tuple[Runc, Path]) -> None:
    runc, b = runc_env
    host = bundle.host_info()
    pod = spec.PodEnv(
        id="p",
        name="p",
        namespace="n",
        uid="u",
        hostname="oci-test",
        ns_pid=None,
        pid_mode=NamespaceMode.CONTAINER,
        cgroup_parent="/podgate-oci-test",
    )
    cspec = ContainerSpec(
        command=["sh", "-c", "echo upper > /etc/written; exec sleep 1000"],
        seccomp="RuntimeDefault",
        resources={"memory_limit_in_bytes": 64 << 20},
    )
    identity = bundle.resolve_identity(str(b / "rootfs"), "", [], False)
    bundle.write_json(
        str(b / "config.json"),
        spec.build_spec("oci-test", cspec, spec.ImageConfig(), pod, identity, host),
    )
    pid_file = str(b / "init.pid")
    runc.run_sync(runc.create_args("oci-test", str(b), pid_file))
    assert (await runc.state("oci-test"))["status"] == "created"
    await runc.start("oci-test")
    state = await wait_status(runc, "running")
    assert state["pid"] == int(Path(pid_file).read_text())
    cgroup = spec.cgroups_path("/podgate-oci-test", "oci-test")
    assert cgroups.memory_limit(cgroup) == 64 << 20
    async with asyncio.timeout(WAIT_SECONDS):
        while True:
            if (b / "upper" / "etc" / "written").exists():
                break
            await asyncio.sleep(0.05)
    used, inodes = overlay.disk_usage(str(b / "upper"))
    assert used > 0 and inodes >= 2  # etc/ and etc/written, nothing of the image
    assert not (b.parent / "lower" / "etc" / "written").exists()  # the image is untouched
    assert (b / "rootfs" / "etc" / "from-image").read_text() == "image\n"

    events = await runc.stats("oci-test")
    assert events["type"] == "stats" and events["data"]["memory"]["usage"]["limit"] == 64 << 20
    assert cgroups.stats(cgroup).pids == 1

    resources = b / "resources.json"
    bundle.write_json(str(resources), {"memory": {"limit": 32 << 20, "swap": 32 << 20}})
    await runc.update("oci-test", str(resources))
    assert cgroups.memory_limit(cgroup) == 32 << 20

    await runc.kill("oci-test", signal.SIGKILL)
    await wait_status(runc, "stopped")
    await runc.delete("oci-test")
    with pytest.raises(RuncError, match="does not exist"):
        await runc.state("oci-test")


def test_run_sync_passes_stdio_and_restores_ignored_signals(tmp_path: Path) -> None:
    """The shim's synchronous runs: the child gets the given fds and the signals Python ignores
    (SIGPIPE, SIGXFSZ) back at their defaults, as subprocess gives them; a failure carries
    the runtime's own error from its log."""
    binary = tmp_path / "fake-runtime"
    # argv: --root R --log LOG --log-format json COMMAND
    binary.write_text(
        "#!/bin/sh\n"
        "grep SigIgn /proc/self/status\n"
        'echo "on stderr" >&2\n'
        '[ "$7" = fail ] || exit 0\n'
        'echo \'{"level":"error","msg":"it failed"}\' >> "$4"\n'
        "exit 3\n"
    )
    binary.chmod(0o755)
    runc = Runc(str(binary), str(tmp_path / "state"), str(tmp_path / "runtime.log"))
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        runc.run_sync(["ok"], stdout=stdout.fileno(), stderr=stderr.fileno())
    ignored = int(out.read_text().split()[1], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), out.read_text()
    assert err.read_text() == "on stderr\n"
    with pytest.raises(RuncError, match=r"^it failed$"):
        runc.run_sync(["fail"])
