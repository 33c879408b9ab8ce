"""The CRI ImageService of a real `podgate runtime`, after `podgate images import` from
another process: ListImages, ImageStatus (every kind of name), RemoveImage, ImageFsInfo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc.aio
import pytest
from layers_support import E, layer_tar

sys.path.insert(0, str(Path(__file__).parent.parent / "runtime" / "e2e"))

from runtime_e2e_support import RuntimeDaemon, running_daemon, state_root

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.images.builder import BuiltImage, build_image, write_docker_archive, write_oci_layout

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

CT = "gcr.io/k8s-staging-cri-tools"
BUSYBOX = shutil.which("busybox")
# A podgate CLI call that takes longer has hung (seconds).
CLI_TIMEOUT_SECONDS = 120


def _busybox_image(user: str) -> BuiltImage:
    assert BUSYBOX is not None
    base = layer_tar(
        [
            E("bin", "dir", mode=0o755),
            E("bin/busybox", data=Path(BUSYBOX).read_bytes(), mode=0o755),
            E("bin/sh", "link", link="bin/busybox"),
        ]
    )
    marker = layer_tar([E("marker", data=user.encode())])
    return build_image([base, marker], {"User": user, "Cmd": ["sh"]})


def podgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "podgate", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_SECONDS,
        check=False,
    )


@pytest.fixture(scope="module")
def daemon() -> Iterator[RuntimeDaemon]:
    if os.geteuid() != 0:
        pytest.skip("root is not available")
    if BUSYBOX is None:
        pytest.skip("busybox-static is not installed")
    with state_root() as root, running_daemon(root) as d:
        yield d


@pytest.fixture
async def img(daemon: RuntimeDaemon) -> AsyncIterator[pb_grpc.ImageServiceStub]:
    async with grpc.aio.insecure_channel(daemon.cri_target) as channel:
        yield pb_grpc.ImageServiceStub(channel)


async def _status(img: pb_grpc.ImageServiceStub, ref: str) -> pb.ImageStatusResponse:
    return await img.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=ref)))


async def test_imported_images_through_the_image_service(
    daemon: RuntimeDaemon, img: pb_grpc.ImageServiceStub, tmp_path: Path
) -> None:
    uid_image, user_image = _busybox_image("1003:1004"), _busybox_image("www-data")
    layout, saved = tmp_path / "layout.tar", tmp_path / "saved.tar"
    write_oci_layout([(uid_image, f"{CT}/test-image-user-uid-group:latest")], layout, as_tar=True)
    write_docker_archive(
        [(user_image, [f"{CT}/test-image-tags:1", f"{CT}/test-image-tags:2"])], saved
    )
    fs_before = (await img.ImageFsInfo(pb.ImageFsInfoRequest())).image_filesystems[0]

    for archive in (layout, saved):
        out = podgate("images", "import", "--state-dir", str(daemon.state_dir), str(archive))
        assert out.returncode == 0, out.stderr
        assert "Loaded sha256:" in out.stdout

    listed = (await img.ListImages(pb.ListImagesRequest())).images
    assert sorted(i.id for i in listed) == sorted(
        [uid_image.config_digest, user_image.config_digest]
    )

    a = (await _status(img, f"{CT}/test-image-user-uid-group")).image
    assert a.id == uid_image.config_digest
    assert list(a.repo_tags) == [f"{CT}/test-image-user-uid-group:latest"]
    assert a.uid.value == 1003 and a.username == "" and a.size == uid_image.size
    b = (await _status(img, f"{CT}/test-image-tags:2")).image
    assert b.id == user_image.config_digest and not b.HasField("uid") and b.username == "www-data"
    assert sorted(b.repo_tags) == [f"{CT}/test-image-tags:1", f"{CT}/test-image-tags:2"]
    # Every kind of reference gives the identical message (critest compares them whole).
    hexid = b.id.removeprefix("sha256:")
    for ref in (f"{CT}/test-image-tags:1", b.id, hexid, hexid[:16]):
        assert (await _status(img, ref)).image == b, ref
    only = pb.ImageFilter(image=pb.ImageSpec(image=f"{CT}/test-image-tags:1"))
    assert (await img.ListImages(pb.ListImagesRequest(filter=only))).images == [b]

    verbose = await img.ImageStatus(
        pb.ImageStatusRequest(image=pb.ImageSpec(image=b.id), verbose=True)
    )
    assert '"chainID": "sha256:' in verbose.info["info"]
    unknown = await _status(img, "docker.io/library/never-imported:1")
    assert not unknown.HasField("image")

    fs = (await img.ImageFsInfo(pb.ImageFsInfoRequest())).image_filesystems[0]
    assert fs.fs_id.mountpoint == str(daemon.state_dir / "images")
    # Two busybox binaries' worth of compressed blobs and unpacked files, at least.
    grown = fs.used_bytes.value - fs_before.used_bytes.value
    assert grown >= uid_image.size + len(Path(str(BUSYBOX)).read_bytes())
    assert fs.inodes_used.value > fs_before.inodes_used.value

    out = podgate("images", "list", "--cri-socket", daemon.cri_socket)
    assert out.returncode == 0, out.stderr
    assert f"{CT}/test-image-tags" in out.stdout and "www-data" not in out.stdout

    # RemoveImage by one tag removes the image with all its names; unknown names succeed.
    await img.RemoveImage(
        pb.RemoveImageRequest(image=pb.ImageSpec(image=f"{CT}/test-image-tags:1"))
    )
    assert not (await _status(img, f"{CT}/test-image-tags:2")).HasField("image")
    assert not (await _status(img, b.id)).HasField("image")
    for ref in (f"{CT}/test-image-tags:1", "0" * 64, "sha256:" + "0" * 64):
        await img.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=ref)))
    blobs = daemon.state_dir / "images" / "content" / "blobs" / "sha256"
    assert not (blobs / user_image.config_digest.removeprefix("sha256:")).exists()
    assert (blobs / uid_image.config_digest.removeprefix("sha256:")).exists()

    out = podgate(
        "images", "remove", "--cri-socket", daemon.cri_socket, uid_image.config_digest[7:19]
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"Deleted: {uid_image.config_digest}"
    assert (await img.ListImages(pb.ListImagesRequest())).images == []
    assert sorted(p.name for p in blobs.iterdir()) == []
    out = podgate("images", "remove", "--cri-socket", daemon.cri_socket, "nothing:here")
    assert out.returncode == 1 and "no such image" in out.stderr


async def test_images_survive_a_daemon_crash(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("root is not available")
    if BUSYBOX is None:
        pytest.skip("busybox-static is not installed")
    image = _busybox_image("")
    layout = tmp_path / "layout"
    write_oci_layout([(image, "localhost:5000/crash:1")], layout)
    with state_root() as root:
        with running_daemon(root) as d:
            out = podgate("images", "import", "--state-dir", str(d.state_dir), str(layout))
            assert out.returncode == 0, out.stderr
            d.kill()
        with running_daemon(root) as d:
            async with grpc.aio.insecure_channel(d.cri_target) as channel:
                status = await _status(pb_grpc.ImageServiceStub(channel), "localhost:5000/crash:1")
            assert status.image.id == image.config_digest
