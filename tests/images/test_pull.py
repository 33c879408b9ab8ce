"""The Puller end to end in-process: a real docker-registry, the real image store."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from layers_support import E, layer_tar
from registry_support import (
    OCI_LAYER_GZIP,
    Layer,
    LoopbackCA,
    Pusher,
    Registry,
    ThrottlingProxy,
    busybox_image,
    image_from_layers,
    layer_from_files,
    make_image,
    make_index,
    noise,
    push_image,
    running_registry,
)

from podgate.images.config import Credentials, Endpoint, RegistryConfig, RegistryHost
from podgate.images.manifests import Descriptor
from podgate.images.platforms import host_platform
from podgate.images.pull import Puller, ResourceError, UnpackError
from podgate.images.registry import (
    AuthError,
    NotFoundError,
    UnavailableError,
    VerificationError,
)
from podgate.images.store import ImageStore

USER, PASSWORD = "puller", "pull-pass"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("pullreg") / "reg") as reg:
        yield reg


def blob_gets(registry: Registry, repo: str) -> list[str]:
    return [
        uri
        for method, uri in registry.requests()
        if method == "GET" and f"/v2/{repo}/blobs/" in uri
    ]


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())


class Recording:
    def __init__(self) -> None:
        self.bytes = 0
        self.layers_done: list[str] = []
        self.layers: list[Descriptor] = []
        self.unpacked = False

    def resolved(self, reference: str, digest: str, layers: Sequence[Descriptor]) -> None:
        self.layers = list(layers)

    def advanced(self, digest: str, nbytes: int) -> None:
        self.bytes += nbytes

    def layer_done(self, digest: str, cached: bool) -> None:
        self.layers_done.append(digest)

    def unpacking(self) -> None:
        self.unpacked = True


async def test_pull_by_tag_registers_an_unpacked_image(registry: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="pull-tag")
    push_image(registry, "pull/tag", "v1", image)
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    seen = Recording()
    try:
        rec = await puller.pull_image(f"{registry.host}/pull/tag:v1", progress=seen)
    finally:
        await puller.aclose()
    assert rec.id == image.config_digest
    assert rec.repo_tags == [f"{registry.host}/pull/tag:v1"]
    assert rec.repo_digests == [f"{registry.host}/pull/tag@{image.digest}"]
    assert rec.size > 0
    assert store.get(f"{registry.host}/pull/tag:v1") == rec
    assert store.get(rec.id) == rec
    # The unpacked root holds busybox byte for byte.
    dirs = store.lowerdirs(rec.id)
    found = [d / "bin/busybox" for d in dirs if (d / "bin/busybox").exists()]
    assert found and found[0].read_bytes() == Path("/bin/busybox").read_bytes()
    assert seen.bytes == sum(len(layer.blob) for layer in image.layers)
    assert sorted(seen.layers_done) == sorted(layer.digest for layer in image.layers)
    assert seen.unpacked
    for digest, data in image.blobs():
        assert store.content.blob_path(digest).read_bytes() == data
    assert store.content.ingests() == []


async def test_pull_by_digest_records_the_requested_name(
    registry: Registry, tmp_path: Path
) -> None:
    image = busybox_image(docker=True, label="pull-digest")
    push_image(registry, "pull/digest", "v1", image)
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    try:
        image_id = await puller.pull(f"{registry.host}/pull/digest@{image.digest}")
    finally:
        await puller.aclose()
    rec = store.get(image_id)
    assert rec is not None
    assert rec.repo_tags == []
    assert rec.repo_digests == [f"{registry.host}/pull/digest@{image.digest}"]


async def test_pull_from_a_manifest_list_takes_the_host_platform(
    registry: Registry, tmp_path: Path
) -> None:
    node = host_platform()
    foreign = "arm64" if node.architecture != "arm64" else "amd64"
    native = busybox_image(docker=True, architecture=node.architecture, label="list-native")
    other = make_image([{"etc/foreign": noise("foreign", 4096)}], docker=True, architecture=foreign)
    index = make_index([other, native], docker=True)
    pusher = Pusher(registry)
    try:
        pusher.index("pull/list", "multi", index)
    finally:
        pusher.close()
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    try:
        rec = await puller.pull_image(f"{registry.host}/pull/list:multi")
    finally:
        await puller.aclose()
    assert rec.id == native.config_digest
    # The repo digest is the index's, as the registry served it.
    assert rec.repo_digests == [f"{registry.host}/pull/list@{index.digest}"]
    assert store.content.has(index.digest)
    assert not store.content.has(other.config_digest)
    assert not store.content.has(other.layers[0].digest)


async def test_missing_image_is_not_found_as_containerd_words_it(
    registry: Registry, tmp_path: Path
) -> None:
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    ref = f"{registry.host}/pull/absent:v9"
    try:
        with pytest.raises(NotFoundError) as info:
            await puller.pull(ref)
    finally:
        await puller.aclose()
    assert str(info.value) == (
        f'failed to pull and unpack image "{ref}": failed to resolve reference "{ref}": '
        f"{ref}: not found"
    )


async def test_tampered_layer_fails_the_pull_and_leaves_nothing(
    registry: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="pull-tampered", extra={"etc/junk": noise("tamper", 50_000)})
    push_image(registry, "pull/tampered", "v1", image)
    data_file = registry.blob_data_path(image.layers[1].digest)
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0x01
    data_file.write_bytes(bytes(raw))
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    try:
        with pytest.raises(VerificationError, match="digest mismatch"):
            await puller.pull(f"{registry.host}/pull/tampered:v1")
    finally:
        await puller.aclose()
    assert store.get(f"{registry.host}/pull/tampered:v1") is None
    assert store.images() == []
    # Garbage collection after the failed pull leaves no blob and no snapshot; the tampered
    # bytes are gone. A sibling download stopped half-way may keep its partial for a retry.
    tampered = image.layers[1].digest
    assert store.content.digests() == []
    assert store.snapshots.ids() == []
    partials = {p.name for p in store.content.ingests()}
    assert tampered[7:] not in partials
    assert partials <= {image.layers[0].digest[7:]}


async def test_concurrent_pulls_share_one_download(registry: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="pull-shared", extra={"data": noise("shared", 300_000)})
    push_image(registry, "pull/shared", "v1", image)
    before = len(blob_gets(registry, "pull/shared"))
    store = ImageStore(tmp_path / "state")
    puller = Puller(store)
    try:
        ids = await asyncio.gather(
            *(puller.pull(f"{registry.host}/pull/shared:v1") for _ in range(5))
        )
    finally:
        await puller.aclose()
    assert set(ids) == {image.config_digest}
    gets = blob_gets(registry, "pull/shared")[before:]
    assert sorted(gets) == sorted(f"/v2/pull/shared/blobs/{d}" for d, _ in image.blobs())


async def test_cancelled_pull_leaves_no_image_and_the_next_pull_resumes(
    registry: Registry, tmp_path: Path
) -> None:
    big = noise("slow", 3 * 1024 * 1024)
    image = make_image([{"bin/busybox": Path("/bin/busybox").read_bytes()}, {"big": big}])
    push_image(registry, "pull/slow", "v1", image)
    proxy = ThrottlingProxy(registry.port, rate=512 * 1024)
    store = ImageStore(tmp_path / "state")
    ref = f"{proxy.host}/pull/slow:v1"
    seen = Recording()
    puller = Puller(store)
    try:
        task = asyncio.create_task(puller.pull_image(ref, progress=seen))
        # Cancel once part of a layer has arrived (bounded wait).
        for _ in range(600):
            if seen.bytes > 256 * 1024:
                break
            await asyncio.sleep(0.05)
        assert 0 < seen.bytes < sum(len(layer.blob) for layer in image.layers)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.get(ref) is None and store.images() == []
        partial = store.content.ingests()
        assert partial, "the interrupted download left no partial ingest to resume"
        proxy.rate = None
        rec = await puller.pull_image(ref)
    finally:
        await puller.aclose()
        proxy.close()
    assert rec.id == image.config_digest
    assert store.content.ingests() == []
    for digest, data in image.blobs():
        assert (
            hashlib.sha256(store.content.blob_path(digest).read_bytes()).hexdigest() == digest[7:]
        )
        assert len(data) == store.content.size(digest)


async def test_wrong_password_names_the_registry(tmp_path: Path) -> None:
    ca = LoopbackCA.create(tmp_path / "ca")
    with running_registry(tmp_path / "reg", tls=ca, users={USER: PASSWORD}) as reg:
        push_image(
            reg,
            "pull/private",
            "v1",
            busybox_image(label="private"),
            username=USER,
            password=PASSWORD,
        )
        config = RegistryConfig({reg.host: RegistryHost(reg.host, ca_file=str(ca.ca_file))})
        store = ImageStore(tmp_path / "state")
        puller = Puller(store, config)
        try:
            with pytest.raises(AuthError) as info:
                await puller.pull(f"{reg.host}/pull/private:v1", Credentials(USER, "bad"))
            assert reg.host in str(info.value)
            # The request's credentials win over none configured, and work when right.
            image_id = await puller.pull(f"{reg.host}/pull/private:v1", Credentials(USER, PASSWORD))
        finally:
            await puller.aclose()
        assert store.get(image_id) is not None


async def test_docker_hub_name_through_a_loopback_mirror(
    registry: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="hub")
    push_image(registry, "library/hubtest", "latest", image)
    config = RegistryConfig(
        {
            "docker.io": RegistryHost(
                "docker.io", mirrors=(Endpoint("http", registry.host, mirror=True),), origin=False
            )
        }
    )
    store = ImageStore(tmp_path / "state")
    puller = Puller(store, config)
    try:
        rec = await puller.pull_image("hubtest")
    finally:
        await puller.aclose()
    assert rec.repo_tags == ["docker.io/library/hubtest:latest"]
    assert rec.repo_digests == [f"docker.io/library/hubtest@{image.digest}"]


async def test_registry_gone_mid_blob_then_the_next_pull_resumes(
    registry: Registry, tmp_path: Path
) -> None:
    image = make_image(
        [{"bin/busybox": Path("/bin/busybox").read_bytes()}, {"big": noise("gone", 3 << 20)}]
    )
    push_image(registry, "pull/gone", "v1", image)
    proxy = ThrottlingProxy(registry.port, rate=512 * 1024)
    store = ImageStore(tmp_path / "state")
    ref = f"{proxy.host}/pull/gone:v1"
    seen = Recording()
    puller = Puller(store)
    try:
        task = asyncio.create_task(puller.pull_image(ref, progress=seen))
        for _ in range(600):
            if seen.bytes > 256 * 1024 or task.done():
                break
            await asyncio.sleep(0.05)
        proxy.cut()
        with pytest.raises(UnavailableError, match=proxy.host):
            await task
        assert store.images() == []
        assert store.content.ingests(), "no partial download kept for the next pull"
        proxy.rate = None
        rec = await puller.pull_image(ref)
    finally:
        await puller.aclose()
        proxy.close()
    assert rec.id == image.config_digest
    assert store.content.ingests() == []


async def test_disk_full_fails_the_pull_cleanly(registry: Registry, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    image = make_image([{"big": noise("full", 3 << 20)}])
    push_image(registry, "pull/full", "v1", image)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        store = ImageStore(small / "state")
        puller = Puller(store)
        try:
            with pytest.raises(ResourceError, match="No space left on device"):
                await puller.pull(f"{registry.host}/pull/full:v1")
        finally:
            await puller.aclose()
        assert store.images() == []
        assert store.content.digests() == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


async def test_hostile_layer_is_refused_and_nothing_outside_the_store_changes(
    registry: Registry, tmp_path: Path
) -> None:
    outside = tmp_path / "escape"
    good = layer_from_files({"bin/busybox": Path("/bin/busybox").read_bytes()})
    raw = layer_tar([E("etc/ok", data=b"fine\n"), E("../../../../escape", data=b"owned\n")])
    hostile = Layer(
        gzip.compress(raw, mtime=0), "sha256:" + hashlib.sha256(raw).hexdigest(), OCI_LAYER_GZIP
    )
    image = image_from_layers([good, hostile])
    push_image(registry, "pull/hostile", "v1", image)
    state = tmp_path / "a" / "b" / "c" / "state"
    store = ImageStore(state)
    puller = Puller(store)
    try:
        with pytest.raises(UnpackError, match="failed to pull and unpack image"):
            await puller.pull(f"{registry.host}/pull/hostile:v1")
    finally:
        await puller.aclose()
    assert not outside.exists()
    assert not list(tmp_path.rglob("escape"))
    assert store.images() == []
    assert store.snapshots.ids() == []
    assert store.content.digests() == []
