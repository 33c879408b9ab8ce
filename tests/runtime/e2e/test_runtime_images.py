"""Containers from the image store: a real `podgate runtime`, images built here from Debian's
busybox-static and loaded with `podgate images import` (no registry), run through runc.

The kubelet's CRI sequence for a pod, an image removed under a running container, and image
based pods adopted by a daemon restarted after kill -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from runtime_e2e_support import (
    POD_NAMESPACE,
    WAIT_SECONDS,
    Pods,
    Resizes,
    RuntimeDaemon,
    Sink,
    channel_options,
    rpc_error,
    running_daemon,
    state_root,
    stream_target,
    wait_for_log,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.demo.sample_images import SampleImageError, build_sample_images
from podgate.images.builder import BuiltImage, build_image, dir_layer, write_oci_layout
from podgate.images.snapshots import chain_ids
from podgate.streaming.client import exec_spdy

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

APP_IMAGE = "localhost/e2e/app:1"
DOOMED_IMAGE = "localhost/e2e/doomed:1"
APP_MARKER = "from the app layer\n"
DOOMED_MARKER = "only in the doomed image\n"
APP_ENV = "GREETING=from-the-image"
# Entrypoint + Cmd: say hello, then wait; SIGUSR1 (the image's StopSignal) exits 3. SIGTERM
# would kill the shell (143), so exit code 3 shows StopContainer sent the image's signal.
APP_CMD = (
    'echo "started as $(id -u) in $(pwd) with $GREETING"; trap "exit 3" USR1; sleep 1000 & wait'
)
EXEC_TIMEOUT = 30
STOP_TIMEOUT = 30
IMPORT_TIMEOUT_SECONDS = 120
# tty exec sessions in a row: the first size must reach every one of them.
TTY_ROUNDS = 5


@dataclass
class Images:
    busybox: BuiltImage
    app: BuiltImage
    doomed: BuiltImage
    layout: Path


def _layer(files: dict[str, str]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="pgimg-") as tmp:
        root = Path(tmp)
        for name, text in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(0o666)  # the image's user (uid 33) may change it: copy-up is checked
        return dir_layer(root)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    try:
        samples = build_sample_images()
    except SampleImageError:
        pytest.skip("busybox-static is not installed")
    busybox = samples["localhost/podgate/busybox:latest"]
    base = busybox.layer_tars[0]
    app = build_image(
        [base, _layer({"app/marker": APP_MARKER})],
        {
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": [APP_CMD],
            "Env": ["PATH=/bin", APP_ENV],
            "WorkingDir": "/app",
            "User": "33",
            "StopSignal": "SIGUSR1",
        },
    )
    doomed = build_image([base, _layer({"doomed": DOOMED_MARKER})], {"Cmd": ["sleep", "1000"]})
    layout = tmp_path_factory.mktemp("layout") / "images"
    write_oci_layout([(busybox, "localhost/e2e/busybox:1"), (app, APP_IMAGE)], layout)
    return Images(busybox, app, doomed, layout)


def import_images(state_dir: Path, layout: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "podgate", "images", "import", "--state-dir", str(state_dir),
         str(layout)],
        check=True,
        capture_output=True,
        timeout=IMPORT_TIMEOUT_SECONDS,
    )  # fmt: skip


@dataclass
class Cri:
    rt: pb_grpc.RuntimeServiceStub
    img: pb_grpc.ImageServiceStub


@contextlib.asynccontextmanager
async def connect(daemon: RuntimeDaemon) -> AsyncIterator[Cri]:
    channel = grpc.aio.insecure_channel(daemon.cri_target, options=channel_options())
    try:
        yield Cri(pb_grpc.RuntimeServiceStub(channel), pb_grpc.ImageServiceStub(channel))
    finally:
        await channel.close()


@pytest.fixture(scope="module")
def daemon(images: Images) -> Iterator[RuntimeDaemon]:
    with state_root() as root:
        import_images(root / "s", images.layout)
        with running_daemon(root) as running:
            yield running


async def image_status(cri: Cri, name: str) -> pb.Image:
    response = await cri.img.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=name)))
    assert response.HasField("image"), name
    return response.image


async def run_pod(cri: Cri, pods: Pods, name: str) -> tuple[str, pb.PodSandboxConfig]:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=POD_NAMESPACE, uid=os.urandom(8).hex()),
        hostname=name,
    )
    response = await cri.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config))
    pods.created.append(response.pod_sandbox_id)
    return response.pod_sandbox_id, config


async def create(
    cri: Cri,
    pod: tuple[str, pb.PodSandboxConfig],
    image: str,
    name: str,
    command: list[str] | None = None,
    mounts: list[pb.Mount] | None = None,
    user_image: str = "",
) -> str:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=image, user_specified_image=user_image or image),
        command=command or [],
        mounts=mounts or [],
        log_path=f"{name}/0.log",
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(seccomp=pb.SecurityProfile())
        ),
    )
    response = await cri.rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pod[0], config=config, sandbox_config=pod[1])
    )
    return response.container_id


async def ok(cri: Cri, cid: str, *cmd: str) -> str:
    response = await cri.rt.ExecSync(
        pb.ExecSyncRequest(container_id=cid, cmd=list(cmd), timeout=EXEC_TIMEOUT)
    )
    assert (response.exit_code, response.stderr) == (0, b""), response
    return response.stdout.decode()


def lease(state_dir: Path, cid: str) -> Path:
    return state_dir / "images" / "snapshots" / "leases" / f"{cid}.json"


def snapshot_dir(state_dir: Path, image: BuiltImage) -> Path:
    """The image's topmost snapshot (its own layer)."""
    return (
        state_dir / "images" / "snapshots" / chain_ids(image.diff_ids)[-1].removeprefix("sha256:")
    )


async def test_kubelet_sequence_runs_a_pod_from_its_image(
    daemon: RuntimeDaemon, images: Images, tmp_path: Path
) -> None:
    etc_hosts = tmp_path / "etc-hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n10.0.0.7 kubelet-pod\n")
    termination = tmp_path / "termination-log"
    termination.write_bytes(b"")
    os.chmod(termination, 0o666)
    token_dir = tmp_path / "kube-api-access"
    token_dir.mkdir()
    (token_dir / "token").write_text("service-account-token")
    mounts = [
        pb.Mount(container_path="/etc/hosts", host_path=str(etc_hosts)),
        pb.Mount(container_path="/dev/termination-log", host_path=str(termination)),
        pb.Mount(
            container_path="/var/run/secrets/kubernetes.io/serviceaccount",
            host_path=str(token_dir),
            readonly=True,
        ),
    ]
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await run_pod(cri, pods, "kubelet-images")
            # The kubelet: ImageStatus by the pod's string, then CreateContainer by image ID.
            image = await image_status(cri, APP_IMAGE)
            assert image.id == images.app.config_digest
            cid = await create(cri, pod, image.id, "app", mounts=mounts, user_image=APP_IMAGE)
            assert lease(daemon.state_dir, cid).exists()
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            # Entrypoint + Cmd, User, WorkingDir and Env all came from the image config.
            log = await wait_for_log(cri.rt, cid, b"started as")
            assert b"started as 33 in /app with from-the-image\n" in log
            status = (
                await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
            ).status
            assert status.state == pb.CONTAINER_RUNNING
            assert status.image.image == APP_IMAGE
            assert status.image_id == images.app.config_digest
            want_ref = image.repo_digests[0] if image.repo_digests else image.id
            assert status.image_ref == want_ref
            # The root is the image's layers: its files, not the node's.
            assert await ok(cri, cid, "cat", "/app/marker") == APP_MARKER
            probe = await cri.rt.ExecSync(
                pb.ExecSyncRequest(container_id=cid, cmd=["ls", sys.executable], timeout=30)
            )
            assert probe.exit_code != 0
            assert await ok(cri, cid, "cat", "/etc/hosts") == etc_hosts.read_text()
            token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
            assert await ok(cri, cid, "cat", token) == "service-account-token"
            await ok(cri, cid, "sh", "-c", "echo done > /dev/termination-log")
            assert termination.read_text() == "done\n"
            # Writes land in the container's upper dir, never in the shared snapshot.
            await ok(cri, cid, "sh", "-c", "echo changed > /app/marker")
            assert (snapshot_dir(daemon.state_dir, images.app) / "fs/app/marker").read_text() == (
                APP_MARKER
            )
            await cri.rt.StopContainer(
                pb.StopContainerRequest(container_id=cid, timeout=STOP_TIMEOUT)
            )
            status = (
                await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
            ).status
            assert (status.state, status.exit_code) == (pb.CONTAINER_EXITED, 3)
            await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
            assert not lease(daemon.state_dir, cid).exists()
            await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod[0]))
            await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod[0]))
            pods.created.remove(pod[0])
        finally:
            await pods.remove_all()


async def test_cri_args_replace_the_image_cmd_and_a_name_resolves(daemon: RuntimeDaemon) -> None:
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await run_pod(cri, pods, "images-names")
            # By name (as critest does), with CRI command replacing Entrypoint and Cmd.
            cid = await create(cri, pod, "localhost/e2e/busybox:1", "sh", ["sleep", "1000"])
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            assert await ok(cri, cid, "id", "-u") == "0\n"
            status = (
                await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
            ).status
            assert status.image.image == "localhost/e2e/busybox:1"
        finally:
            await pods.remove_all()


async def test_unknown_image_is_not_found(daemon: RuntimeDaemon) -> None:
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await run_pod(cri, pods, "images-missing")
            err = await rpc_error(create(cri, pod, "localhost/e2e/nothing:1", "x", ["true"]))
            assert err.code() == grpc.StatusCode.NOT_FOUND
            assert err.details() == 'failed to resolve image "localhost/e2e/nothing:1": not found'
            listed = await cri.rt.ListContainers(pb.ListContainersRequest())
            assert [c for c in listed.containers if c.pod_sandbox_id == pod[0]] == []
            assert list((daemon.state_dir / "images/snapshots/leases").glob("*.json")) == []
        finally:
            await pods.remove_all()


async def test_remove_image_keeps_a_running_containers_root(
    daemon: RuntimeDaemon, images: Images, tmp_path: Path
) -> None:
    write_oci_layout([(images.doomed, DOOMED_IMAGE)], tmp_path / "doomed")
    import_images(daemon.state_dir, tmp_path / "doomed")
    snap = snapshot_dir(daemon.state_dir, images.doomed)
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await run_pod(cri, pods, "images-removed")
            cid = await create(cri, pod, DOOMED_IMAGE, "main")
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            await cri.img.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=DOOMED_IMAGE)))
            gone = await cri.img.ImageStatus(
                pb.ImageStatusRequest(image=pb.ImageSpec(image=DOOMED_IMAGE))
            )
            assert not gone.HasField("image")
            assert snap.is_dir()  # the container's lease keeps its snapshot
            assert await ok(cri, cid, "cat", "/doomed") == DOOMED_MARKER
            assert await ok(cri, cid, "sh", "-c", "echo new > /f && cat /f") == "new\n"
            err = await rpc_error(create(cri, pod, DOOMED_IMAGE, "again", ["true"]))
            assert err.code() == grpc.StatusCode.NOT_FOUND
            status = (
                await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
            ).status
            assert status.image_id == images.doomed.config_digest
            await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
            assert not snap.exists()  # released: nothing holds it any more
            # The base layer is shared with images still stored: it stays.
            base = chain_ids(images.doomed.diff_ids)[0].removeprefix("sha256:")
            assert (daemon.state_dir / "images/snapshots" / base).is_dir()
        finally:
            await pods.remove_all()


async def test_image_pods_survive_a_killed_daemon_and_are_adopted(images: Images) -> None:
    with state_root() as root:
        import_images(root / "s", images.layout)
        first = RuntimeDaemon.start(root / "s", root / "daemon.log")
        try:
            async with connect(first) as cri:
                pod = await run_pod(cri, Pods(cri.rt), "images-survivor")
                cid = await create(cri, pod, APP_IMAGE, "app")
                await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
                await wait_for_log(cri.rt, cid, b"started as")
        finally:
            first.kill()
        # A lease whose container was never recorded (a crash inside CreateContainer).
        stray = lease(root / "s", "0" * 64)
        stray.write_text(json.dumps(chain_ids(images.app.diff_ids)))
        with running_daemon(root) as second:
            assert not stray.exists()  # released on start; the live container's stays
            assert lease(root / "s", cid).exists()
            async with connect(second) as cri:
                status = (
                    await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
                ).status
                assert status.state == pb.CONTAINER_RUNNING
                assert (status.image.image, status.image_id) == (
                    APP_IMAGE,
                    images.app.config_digest,
                )
                assert await ok(cri, cid, "cat", "/app/marker") == APP_MARKER
                # A restarted daemon's garbage collection keeps the running container's layers.
                await cri.img.RemoveImage(
                    pb.RemoveImageRequest(image=pb.ImageSpec(image=APP_IMAGE))
                )
                assert snapshot_dir(root / "s", images.app).is_dir()
                assert await ok(cri, cid, "cat", "/app/marker") == APP_MARKER
                await cri.rt.StopContainer(
                    pb.StopContainerRequest(container_id=cid, timeout=STOP_TIMEOUT)
                )
                status = (
                    await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
                ).status
                assert status.exit_code == 3  # the image's StopSignal, after adoption too
                await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod[0]))
                assert not lease(root / "s", cid).exists()
                assert not snapshot_dir(root / "s", images.app).exists()


async def test_sandboxed_pod_runs_image_containers_in_the_guest(daemon: RuntimeDaemon) -> None:
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await pods.run("images-sandboxed", runtime_handler="sandboxed")
            cid = await create(
                cri, (pod.id, pod.config), "localhost/e2e/busybox:1", "sh", ["sleep", "1000"]
            )
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            record = json.loads((daemon.state_dir / "pods" / f"{pod.id}.json").read_text())
            guest = int(record["extra"]["guest_ns_pid"])
            holder = int(record["ns_process"]["pid"])
            inside = await ok(
                cri, cid, "sh", "-c", "for n in net uts; do readlink /proc/self/ns/$n; done"
            )
            # The container joined the guest's network and UTS namespaces, not the host side's.
            guest_ns = [os.readlink(f"/proc/{guest}/ns/{k}") for k in ("net", "uts")]
            assert inside.split() == guest_ns
            assert os.readlink(f"/proc/{holder}/ns/net") != guest_ns[0]
            assert await ok(cri, cid, "ls", "/bin/busybox") == "/bin/busybox\n"
        finally:
            await pods.remove_all()


# runc sizes the container's terminal just after the process started, and busybox's stty fails
# on a terminal without a size: the script retries until it reads one, prints it, then waits
# for the second size.
TTY_SCRIPT = (
    'while :; do s=$(stty size 2>/dev/null); case "$s" in [1-9]*) break;; esac; sleep 0.05;'
    ' done; echo "$s"; while [ "$(stty size 2>/dev/null)" != \'43 132\' ]; do sleep 0.05;'
    " done; echo now 43 132"
)


async def test_exec_with_a_tty_gets_the_clients_sizes(daemon: RuntimeDaemon) -> None:
    async with connect(daemon) as cri:
        pods = Pods(cri.rt)
        try:
            pod = await run_pod(cri, pods, "images-tty")
            cid = await create(cri, pod, "localhost/e2e/busybox:1", "sh", ["sleep", "1000"])
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            for _ in range(TTY_ROUNDS):
                request = pb.ExecRequest(
                    container_id=cid, cmd=["sh", "-c", TTY_SCRIPT], stdout=True, tty=True
                )
                url = (await cri.rt.Exec(request)).url
                resizes, stdout = Resizes(), Sink()
                resizes.push(100, 30)
                endpoint, path = stream_target(url)
                session = asyncio.create_task(
                    exec_spdy(endpoint, path, stdout=stdout, tty=True, resizes=resizes.sizes())
                )
                try:
                    async with asyncio.timeout(WAIT_SECONDS):
                        await stdout.wait_for(b"30 100\r\n", session=session)
                        resizes.push(132, 43)
                        result = await session
                finally:
                    resizes.close()
                    session.cancel()
                assert result.exit_code == 0
                assert bytes(stdout.data) == b"30 100\r\nnow 43 132\r\n"
        finally:
            await pods.remove_all()
