"""PullImage through a real `podgate runtime` daemon's CRI socket, from real registries.

The daemon reads its registries from `--config FILE` (a TLS registry's CA and credentials);
tests check ImageStatus/ListImages answers, the 1 ms deadline, auth errors, and a daemon
killed with SIGKILL in the middle of a blob: after a restart the image is absent, the next
pull succeeds, and the store holds exactly the image's files.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from registry_support import (
    LoopbackCA,
    Registry,
    ThrottlingProxy,
    TokenServer,
    busybox_image,
    make_image,
    noise,
    push_image,
    running_registry,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "e2e"))
from runtime_e2e_support import (
    RuntimeDaemon,
    channel_options,
    running_daemon,
    state_root,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.images.snapshots import chain_ids

USER, PASSWORD = "kubelet", "cri-pass"
# Bound on one pull through the daemon on a loaded machine, seconds.
PULL_TIMEOUT_SECONDS = 120.0
# Poll period and bound while waiting for a partial download to appear.
POLL_SECONDS = 0.05
WAIT_SECONDS = 60.0


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the runtime creates namespaces and unpacks as owners")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    return LoopbackCA.create(tmp_path_factory.mktemp("cri-ca"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("cri-plain") / "reg") as reg:
        yield reg


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA) -> Iterator[Registry]:
    root = tmp_path_factory.mktemp("cri-tls") / "reg"
    with running_registry(root, tls=ca, users={USER: PASSWORD}) as reg:
        yield reg


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA) -> Iterator[Registry]:
    server = TokenServer(ca, {USER: PASSWORD})
    server.start()
    try:
        with running_registry(tmp_path_factory.mktemp("cri-tok") / "reg", token=server) as reg:
            yield reg
    finally:
        server.stop()


@pytest.fixture(scope="module")
def daemon(secure: Registry, ca: LoopbackCA) -> Iterator[RuntimeDaemon]:
    _require_root()
    with state_root() as root:
        config = root / "runtime.toml"
        config.write_text(
            f'[registries."{secure.host}"]\nca_file = "{ca.ca_file}"\n'
            f'username = "{USER}"\npassword = "{PASSWORD}"\n'
        )
        with running_daemon(root, ["--config", str(config)]) as d:
            yield d


@pytest.fixture
async def images(daemon: RuntimeDaemon) -> AsyncIterator[pb_grpc.ImageServiceStub]:
    async with _image_stub(daemon) as stub:
        yield stub


class _image_stub:
    def __init__(self, daemon: RuntimeDaemon) -> None:
        self.channel = grpc.aio.insecure_channel(daemon.cri_target, options=channel_options())

    async def __aenter__(self) -> pb_grpc.ImageServiceStub:
        return pb_grpc.ImageServiceStub(self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()


def _spec(ref: str) -> pb.ImageSpec:
    return pb.ImageSpec(image=ref)


async def test_pull_then_status_and_list(images: pb_grpc.ImageServiceStub, plain: Registry) -> None:
    image = busybox_image(label="cri-status")
    push_image(plain, "cri/status", "1.0", image)
    ref = f"{plain.host}/cri/status:1.0"
    pulled = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS
    )
    assert pulled.image_ref == image.config_digest
    by_name = await images.ImageStatus(pb.ImageStatusRequest(image=_spec(ref)))
    by_id = await images.ImageStatus(pb.ImageStatusRequest(image=_spec(pulled.image_ref)))
    digest_name = f"{plain.host}/cri/status@{image.digest}"
    by_digest = await images.ImageStatus(pb.ImageStatusRequest(image=_spec(digest_name)))
    assert by_name.image == by_id.image == by_digest.image
    assert by_name.image.id == image.config_digest
    assert list(by_name.image.repo_tags) == [ref]
    assert list(by_name.image.repo_digests) == [digest_name]
    assert by_name.image.size > 0
    listed = await images.ListImages(pb.ListImagesRequest())
    assert any(i.id == image.config_digest for i in listed.images)
    # Pulling again goes to the registry and answers the same ID.
    again = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS
    )
    assert again.image_ref == pulled.image_ref
    await images.RemoveImage(pb.RemoveImageRequest(image=_spec(ref)))
    gone = await images.ImageStatus(pb.ImageStatusRequest(image=_spec(ref)))
    assert not gone.HasField("image")


async def test_missing_image_is_not_found(
    images: pb_grpc.ImageServiceStub, plain: Registry
) -> None:
    ref = f"{plain.host}/cri/absent:nope"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await images.PullImage(pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == (
        f'failed to pull and unpack image "{ref}": failed to resolve reference "{ref}": '
        f"{ref}: not found"
    )


async def test_one_millisecond_deadline(images: pb_grpc.ImageServiceStub, plain: Registry) -> None:
    push_image(plain, "cri/deadline", "v1", busybox_image(label="deadline"))
    ref = f"{plain.host}/cri/deadline:v1"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await images.PullImage(pb.PullImageRequest(image=_spec(ref)), timeout=0.001)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = await images.ImageStatus(pb.ImageStatusRequest(image=_spec(ref)))
    assert not status.HasField("image")


async def test_tls_registry_with_config_credentials_and_request_auth(
    images: pb_grpc.ImageServiceStub, secure: Registry
) -> None:
    image = busybox_image(label="cri-tls")
    push_image(secure, "cri/private", "v1", image, username=USER, password=PASSWORD)
    ref = f"{secure.host}/cri/private:v1"
    # Credentials from the daemon's config file.
    pulled = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS
    )
    assert pulled.image_ref == image.config_digest
    # Credentials in the request win; wrong ones give a clear error naming the registry.
    bad = pb.AuthConfig(username=USER, password="wrong")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await images.PullImage(
            pb.PullImageRequest(image=_spec(ref), auth=bad), timeout=PULL_TIMEOUT_SECONDS
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert secure.host in info.value.details()
    assert "pull access denied" in info.value.details()
    good = pb.AuthConfig(auth="a3ViZWxldDpjcmktcGFzcw==")  # base64("kubelet:cri-pass")
    again = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref), auth=good), timeout=PULL_TIMEOUT_SECONDS
    )
    assert again.image_ref == image.config_digest


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


async def test_kill_mid_pull_restart_and_pull_again(plain: Registry) -> None:
    _require_root()
    big = noise("kill-9", 4 * 1024 * 1024)
    image = make_image(
        [{"bin/busybox": Path("/bin/busybox").read_bytes()}, {"data/big": big}], label="kill"
    )
    push_image(plain, "cri/kill", "v1", image)
    proxy = ThrottlingProxy(plain.port, rate=256 * 1024)
    ref = f"{proxy.host}/cri/kill:v1"
    try:
        with state_root() as root:
            store_root = root / "s" / "images"
            ingest = store_root / "content" / "ingest"
            with running_daemon(root) as first:
                async with _image_stub(first) as stub:
                    call = stub.PullImage(
                        pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS
                    )
                    deadline = time.monotonic() + WAIT_SECONDS
                    while time.monotonic() < deadline:
                        partial = [p for p in ingest.glob("*") if p.stat().st_size > 64 * 1024]
                        if partial:
                            break
                        await _sleep(POLL_SECONDS)
                    assert partial, "no partial download appeared"
                    first.kill()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert not list((store_root / "records").glob("*.json"))
            proxy.rate = None
            with running_daemon(root) as second:
                async with _image_stub(second) as stub:
                    status = await stub.ImageStatus(pb.ImageStatusRequest(image=_spec(ref)))
                    assert not status.HasField("image")
                    pulled = await stub.PullImage(
                        pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS
                    )
                    assert pulled.image_ref == image.config_digest
                    status = await stub.ImageStatus(pb.ImageStatusRequest(image=_spec(ref)))
                    assert status.image.id == image.config_digest
                # Count files: exactly the image's blobs, one record, its snapshots; no ingest.
                blobs = {p.name for p in (store_root / "content" / "blobs" / "sha256").iterdir()}
                assert blobs == {d[7:] for d, _ in image.blobs()} | {image.digest[7:]}
                assert list(ingest.iterdir()) == []
                assert [p.name for p in (store_root / "records").iterdir()] == [
                    f"{image.config_digest[7:]}.json"
                ]
                chains = chain_ids([layer.diff_id for layer in image.layers])
                snapshots = store_root / "snapshots"
                snapshot_dirs = {p.name for p in snapshots.iterdir() if p.name != "leases"}
                assert snapshot_dirs == {c[7:] for c in chains}
                assert not (snapshots / "leases").exists() or _files(snapshots / "leases") == []
                content_files = _files(store_root / "content")
                assert len(content_files) == len(blobs)
    finally:
        proxy.close()


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def test_concurrent_cri_pulls_download_once(
    images: pb_grpc.ImageServiceStub, plain: Registry
) -> None:
    image = busybox_image(label="cri-shared", extra={"data": noise("cri-shared", 500_000)})
    push_image(plain, "cri/shared", "v1", image)
    ref = f"{plain.host}/cri/shared:v1"

    def gets() -> list[str]:
        return [u for m, u in plain.requests() if m == "GET" and "/v2/cri/shared/" in u]

    before = len(gets())
    replies = await asyncio.gather(
        *(
            images.PullImage(pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS)
            for _ in range(4)
        )
    )
    assert {r.image_ref for r in replies} == {image.config_digest}
    fetched = gets()[before:]
    # One manifest request and at most one request per blob for all four calls (the busybox
    # layer may already be in the daemon's store from an earlier test).
    assert len(fetched) == len(set(fetched))
    assert fetched.count("/v2/cri/shared/manifests/v1") == 1
    own = {image.config_digest, image.layers[1].digest}
    assert {f"/v2/cri/shared/blobs/{d}" for d in own} <= set(fetched)


async def test_request_identity_and_registry_tokens(
    images: pb_grpc.ImageServiceStub, token_registry: Registry
) -> None:
    image = busybox_image(label="cri-token")
    push_image(token_registry, "cri/tok", "v1", image, username=USER, password=PASSWORD)
    server = token_registry.token_server
    assert server is not None
    ref = f"{token_registry.host}/cri/tok:v1"
    # No credentials: the token server refuses, and the error names the registry.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await images.PullImage(pb.PullImageRequest(image=_spec(ref)), timeout=PULL_TIMEOUT_SECONDS)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert token_registry.host in info.value.details()
    # An identity token (OAuth refresh token) from the request.
    server.refresh_tokens["cri-refresh"] = USER
    auth = pb.AuthConfig(identity_token="cri-refresh")
    pulled = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref), auth=auth), timeout=PULL_TIMEOUT_SECONDS
    )
    assert pulled.image_ref == image.config_digest
    # A registry token is sent as the bearer token itself.
    bearer = server.sign(USER, [{"type": "repository", "name": "cri/tok", "actions": ["pull"]}])
    before = len(server.requests)
    auth = pb.AuthConfig(registry_token=bearer)
    pulled = await images.PullImage(
        pb.PullImageRequest(image=_spec(ref), auth=auth), timeout=PULL_TIMEOUT_SECONDS
    )
    assert pulled.image_ref == image.config_digest
    assert len(server.requests) == before
