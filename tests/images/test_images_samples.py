"""The sample images `podgate up` builds from busybox-static: reproducible, imported once,
sharing their base layer, and working — the shell runs and the hello image serves HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.demo.sample_images import (
    BUSYBOX_IMAGE,
    HELLO_BODY,
    HELLO_IMAGE,
    SAMPLE_IMAGES,
    UDP_ECHO_IMAGE,
    SampleImageError,
    build_sample_images,
    ensure_sample_images,
)
from podgate.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root is not available")

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+) cri=unix://(\S+)")
# Bounds for the helper processes (seconds); generous for a loaded machine.
SERVE_TIMEOUT_SECONDS = 20.0
UP_READY_SECONDS = 60.0
STOP_SECONDS = 30.0


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    try:
        return dict(build_sample_images())
    except SampleImageError as exc:
        pytest.skip(f"busybox-static is not installed ({exc})")


def test_build_is_reproducible(built: dict[str, object]) -> None:
    again = build_sample_images()
    for name in SAMPLE_IMAGES:
        assert again[name].manifest_digest == built[name].manifest_digest  # type: ignore[attr-defined]


def test_examples_name_sample_images() -> None:
    """Every sample container names a sample image, or its example says why it has none."""
    named = set()
    for path in sorted((REPO / "examples").glob("*.json")):
        example = json.loads(path.read_text())
        for c in example["containers"]:
            if "image" in c:
                named.add(c["image"])
            else:
                assert "node's filesystem" in example["note"], path
    assert named == set(SAMPLE_IMAGES)


@contextlib.contextmanager
def mounted(store: ImageStore, name: str, where: Path) -> Iterator[Path]:
    rec = store.get(name)
    assert rec is not None
    lower = ":".join(str(p) for p in store.lowerdirs(rec.id))
    upper, work = where.with_name(where.name + "-upper"), where.with_name(where.name + "-work")
    for d in (where, upper, work):
        d.mkdir()
    # A writable upper layer, as a container's root gets (and overlayfs wants 2+ lowers without).
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_imported_once_shared_base_and_working(tmp_path: Path, built: dict[str, object]) -> None:
    store = ImageStore(tmp_path / "state")
    records = ensure_sample_images(store)
    assert [r.repo_tags for r in records] == [[BUSYBOX_IMAGE], [HELLO_IMAGE], [UDP_ECHO_IMAGE]]
    shell, hello, echo = records
    assert shell.chain_ids[0] == hello.chain_ids[0] == echo.chain_ids[0]
    assert len(store.snapshots.ids()) == 3
    assert hello.config.cmd[0] == "httpd" and shell.config.cmd == ["sh"]
    # A second start builds and imports nothing new.
    blobs = store.content.digests()
    assert ensure_sample_images(store) == records
    assert store.content.digests() == blobs

    with mounted(store, BUSYBOX_IMAGE, tmp_path / "shell") as root:
        out = subprocess.run(
            ["chroot", str(root), "/bin/sh", "-c", "id -un; ls /bin | grep -c .; echo ok"],
            capture_output=True, text=True, timeout=SERVE_TIMEOUT_SECONDS, check=True,
        )  # fmt: skip
        user, applets, ok = out.stdout.split()
        assert user == "root" and int(applets) > 100 and ok == "ok"
        assert os.lstat(root / "bin/sh").st_ino == os.lstat(root / "bin/busybox").st_ino

    port = _free_port()
    with mounted(store, HELLO_IMAGE, tmp_path / "hello") as root:
        args = [a if a != "8080" else f"127.0.0.1:{port}" for a in hello.config.cmd]
        proc = subprocess.Popen(["chroot", str(root), *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd="/")  # fmt: skip
        try:
            deadline = time.monotonic() + SERVE_TIMEOUT_SECONDS
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                        body = r.read()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "httpd in the hello image never answered"
                    time.sleep(0.1)
            assert hashlib.sha256(body).digest() == hashlib.sha256(HELLO_BODY).digest()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    # The udp-echo image's program answers every datagram with its own bytes.
    port = _free_udp_port()
    with mounted(store, UDP_ECHO_IMAGE, tmp_path / "echo") as root:
        assert echo.config.cmd == ["udp-echo", "9053"]
        proc = subprocess.Popen(["chroot", str(root), "udp-echo", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == f"udp-echo listening on port {port}\n".encode()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                client.settimeout(SERVE_TIMEOUT_SECONDS)
                for payload in (b"hi", os.urandom(65507)):  # the largest IPv4 UDP payload
                    client.sendto(payload, ("127.0.0.1", port))
                    data, peer = client.recvfrom(65536)
                    assert peer == ("127.0.0.1", port)
                    assert hashlib.sha256(data).digest() == hashlib.sha256(payload).digest()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.mark.e2e
def test_podgate_up_has_the_sample_images(built: dict[str, object]) -> None:
    state = Path(tempfile.mkdtemp(prefix="pgimg", dir="/tmp"))
    log_path = state / "up.log"
    argv = [sys.executable, "-m", "podgate", "up", "--state-dir", str(state / "s"), "--port", "0",
            "--examples", str(REPO / "examples")]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_READY_SECONDS
        while not (m := READY.search(log_path.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("podgate up printed no ready line:\n" + log_path.read_text())
            time.sleep(0.1)
        with grpc.insecure_channel(f"unix://{m[3]}") as channel:
            images = pb_grpc.ImageServiceStub(channel).ListImages(
                pb.ListImagesRequest(), timeout=30
            )
        tags = sorted(t for i in images.images for t in i.repo_tags)
        assert tags == sorted(SAMPLE_IMAGES)
        for i in images.images:
            assert i.id == built[i.repo_tags[0]].config_digest  # type: ignore[attr-defined]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        text = log_path.read_text()
        subprocess.run(["rm", "-rf", str(state)], check=False)
    assert proc.returncode == 0, text
