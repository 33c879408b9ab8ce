"""Image records: registration, containerd-style lookups with critest's names, tag moves,
removal with garbage collection, crash recovery, usage figures, and offline import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from layers_support import E, layer_tar

from podgate.images.builder import BuiltImage, build_image, write_docker_archive, write_oci_layout
from podgate.images.content import DigestMismatchError
from podgate.images.importer import import_archive
from podgate.images.store import ImageStore, parse_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root is not available")

CT = "gcr.io/k8s-staging-cri-tools"
BASE = layer_tar([E("bin", "dir", mode=0o755), E("bin/busybox", data=b"B" * 4096, mode=0o755)])


def _image(marker: str, user: str = "", base: bytes = BASE) -> BuiltImage:
    top = layer_tar([E(marker, data=marker.encode())])
    return build_image([base, top], {"User": user, "Cmd": ["sh"], "Env": ["PATH=/bin"]})


def _store_blobs(store: ImageStore, img: BuiltImage) -> None:
    for d, data in img.blobs.items():
        store.content.write_blob(data, d)


def _orphans(store: ImageStore) -> list[str]:
    """Everything on disk that no record explains."""
    out = [p.name for p in store.root.glob(".tmp-*")]
    out += [p.name for p in store.records_dir.iterdir() if p.name.startswith(".")]
    out += [p.name for p in store.content.ingests()]
    out += [p.name for p in store.snapshots.root.iterdir() if p.name.startswith(".tmp")]
    used = {d for r in store.images() for d in (r.manifest_digest, r.config_digest, *r.layers)}
    out += [d for d in store.content.digests() if d not in used]
    snaps = {c for r in store.images() for c in r.chain_ids}
    out += [c for c in store.snapshots.ids() if c not in snaps]
    return out


def test_register_and_lookups_with_critest_names(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    img = _image("tags")
    _store_blobs(store, img)
    for t in ("1", "2", "3"):
        rec = store.register(img.manifest_digest, [f"{CT}/test-image-tags:{t}"])
    assert rec.id == img.config_digest
    assert rec.repo_tags == [f"{CT}/test-image-tags:{t}" for t in ("1", "2", "3")]
    assert rec.size == img.size > 0
    assert [r.id for r in store.images()] == [img.config_digest]
    digest_name = f"{CT}/test-image-tags@{img.manifest_digest}"
    store.register(img.manifest_digest, [digest_name])
    rec = store.get(img.config_digest)
    assert rec is not None and rec.repo_digests == [digest_name]
    hexid = img.config_digest.removeprefix("sha256:")
    for ref in (
        f"{CT}/test-image-tags:2",
        digest_name,
        img.config_digest,
        hexid,
        hexid[:12],
        "sha256:" + hexid[:12],
    ):
        assert store.get(ref) == rec, ref
    assert store.get(f"{CT}/test-image-tags") is None  # :latest was never tagged
    assert store.get("0" * 64) is None
    assert store.get("Not/A/Ref") is None
    # Records survive a restart unchanged.
    again = ImageStore(tmp_path)
    assert again.get(img.config_digest) == rec and again.recovered == 0
    assert again.lowerdirs(rec.id) == [store.snapshots.lowerdir(c) for c in reversed(rec.chain_ids)]


@pytest.mark.parametrize(
    ("user", "uid", "username"),
    [("", None, ""), ("1002", 1002, ""), ("www-data", None, "www-data"),
     ("1003:1004", 1003, ""), ("www-data:1004", None, "www-data")],
)  # fmt: skip
def test_user(tmp_path: Path, user: str, uid: int | None, username: str) -> None:
    assert parse_user(user) == (uid, username)
    store = ImageStore(tmp_path)
    img = _image("u", user)
    _store_blobs(store, img)
    rec = store.register(img.manifest_digest, [f"{CT}/test-image-user-x"])
    assert (rec.uid, rec.username, rec.config.user) == (uid, username, user)
    assert rec.config.cmd == ["sh"] and rec.config.env == ["PATH=/bin"]


def test_tag_moves_and_remove_gc(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    a, b = _image("a"), _image("b")
    with store.ingesting():  # both pulls in flight: no GC of b's blobs when a registers
        _store_blobs(store, a)
        _store_blobs(store, b)
        ra = store.register(
            a.manifest_digest, [f"{CT}/test-image-tag:test", f"{CT}/x@{a.manifest_digest}"]
        )
        store.register(b.manifest_digest, [f"{CT}/test-image-tag:test"])
    ra2 = store.get(ra.id)
    assert (
        ra2 is not None
        and ra2.repo_tags == []
        and ra2.repo_digests == [f"{CT}/x@{a.manifest_digest}"]
    )
    rb = store.get(f"{CT}/test-image-tag:test")
    assert rb is not None and rb.id == b.config_digest
    # The shared base layer is one snapshot.
    assert ra.chain_ids[0] == rb.chain_ids[0]
    assert len(store.snapshots.ids()) == 3
    assert store.remove(f"{CT}/x@{a.manifest_digest}") is not None
    assert store.get(ra.id) is None
    assert not any(
        store.content.has(d) for d in (a.manifest_digest, a.config_digest, a.layer_digests[1])
    )
    assert store.content.has(a.layer_digests[0])  # the shared base: still used by b
    assert sorted(store.snapshots.ids()) == sorted(rb.chain_ids)
    # A container's lease keeps its snapshots after the image is gone.
    store.snapshots.acquire("ctr-1", rb.chain_ids)
    assert store.remove(rb.id) is not None
    assert sorted(store.snapshots.ids()) == sorted(rb.chain_ids)
    store.snapshots.release("ctr-1")
    store.gc()
    assert store.snapshots.ids() == [] and store.content.digests() == []
    assert store.remove("docker.io/library/nothing:here") is None
    assert store.remove("0" * 64) is None


def test_untag(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    img = _image("t")
    _store_blobs(store, img)
    store.register(img.manifest_digest, ["a:1", "a:2"])
    rec = store.untag("a:1")
    assert rec is not None and rec.repo_tags == ["docker.io/library/a:2"]
    store.untag("a:2")
    assert store.images() == [] and store.content.digests() == []


def test_crash_leftovers_are_cleaned_on_start(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    kept = _image("kept")
    _store_blobs(store, kept)
    store.register(kept.manifest_digest, ["kept:1"])
    # A pull that died after storing blobs and unpacking one layer, before register():
    dead = _image("dead", base=layer_tar([E("other", data=b"o")]))
    _store_blobs(store, dead)
    store.unpack(dead.manifest_digest)
    # ... one more partial blob, a half-written record, a snapshot temp dir, an import dir.
    w = store.content.writer("sha256:" + "ab" * 32, 100)
    w.write(b"x" * 10)
    w.abort()
    (store.records_dir / ".deadbeef.json.1234.tmp").write_text("{")
    (store.snapshots.root / ".tmp-abc-123").mkdir()
    (store.root / ".tmp-import-xyz").mkdir()
    before = _orphans(store)
    assert len(before) == 4 + 3 + 2 + 1  # 4 files/dirs, 3 blobs, 2 snapshots, 1 ingest
    store2 = ImageStore(tmp_path)
    assert store2.recovered == len(before)
    assert _orphans(store2) == []
    assert store2.get("kept:1") is not None


def test_fs_info_counts_real_usage(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    empty = store.fs_info()
    img = build_image([layer_tar([E("big", data=os.urandom(1 << 20))])], {})
    _store_blobs(store, img)
    store.register(img.manifest_digest, ["big:1"])
    full = store.fs_info()
    assert full.mountpoint == str(tmp_path / "images")
    # 1 MiB compressed blob + 1 MiB unpacked file, at least.
    assert full.used_bytes - empty.used_bytes >= 2 << 20
    assert full.inodes_used > empty.inodes_used
    store.remove("big:1")
    assert store.fs_info().used_bytes < full.used_bytes


@pytest.mark.parametrize("as_tar", [False, True])
def test_import_oci_layout(tmp_path: Path, as_tar: bool) -> None:
    a, b = _image("a", "1002"), _image("b")
    dest = tmp_path / ("layout.tar" if as_tar else "layout")
    write_oci_layout(
        [(a, f"{CT}/test-image-latest:latest"), (b, "localhost:5000/b:v1")], dest, as_tar
    )
    store = ImageStore(tmp_path / "state")
    recs = import_archive(store, dest)
    assert [r.id for r in recs] == [a.config_digest, b.config_digest]
    ra = store.get(f"{CT}/test-image-latest")
    assert ra is not None and ra.uid == 1002 and ra.size == a.size
    assert store.get("localhost:5000/b:v1") is not None
    root = store.lowerdirs(ra.id)
    assert (root[0] / "a").read_bytes() == b"a"
    assert (root[1] / "bin/busybox").read_bytes() == b"B" * 4096
    assert _orphans(store) == [] and list(store.root.glob(".tmp-*")) == []


def test_import_docker_archive(tmp_path: Path) -> None:
    img = _image("d", "www-data:1004")
    dest = tmp_path / "saved.tar"
    write_docker_archive(
        [(img, ["busybox:1.36", "registry.k8s.io/e2e-test-images/busybox:1.29-2"])], dest
    )
    with tarfile.open(dest) as tf:
        assert "manifest.json" in tf.getnames()
    store = ImageStore(tmp_path / "state")
    (rec,) = import_archive(store, dest)
    assert rec.id == img.config_digest  # the same config bytes: the same image ID
    assert rec.repo_tags == [
        "docker.io/library/busybox:1.36",
        "registry.k8s.io/e2e-test-images/busybox:1.29-2",
    ]
    assert rec.username == "www-data" and rec.uid is None
    assert rec.diff_ids == img.diff_ids
    assert _orphans(store) == []


def test_import_refuses_corrupt_blob(tmp_path: Path) -> None:
    img = _image("c")
    dest = tmp_path / "layout"
    write_oci_layout([(img, "corrupt:1")], dest)
    blob = dest / "blobs/sha256" / img.layer_digests[1].removeprefix("sha256:")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    store = ImageStore(tmp_path / "state")
    with pytest.raises(DigestMismatchError):
        import_archive(store, dest)
    assert store.images() == [] and store.get("corrupt:1") is None
    assert store.content.digests() == [] and store.snapshots.ids() == []
    assert store.content.ingests() == []


def test_import_refuses_non_archives(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "state")
    (tmp_path / "junk").write_bytes(b"not a tar")
    with pytest.raises(Exception, match="cannot read"):
        import_archive(store, tmp_path / "junk")
    (tmp_path / "d").mkdir()
    with pytest.raises(Exception, match="neither"):
        import_archive(store, tmp_path / "d")
    (tmp_path / "d" / "manifest.json").write_text(json.dumps([{"Layers": []}]))
    with pytest.raises(Exception, match="malformed"):
        import_archive(store, tmp_path / "d")
    assert store.images() == [] and list(store.root.glob(".tmp-*")) == []


def test_two_store_instances_share_one_directory(tmp_path: Path) -> None:
    # The daemon's store and `podgate images import --state-dir` in another process.
    daemon = ImageStore(tmp_path)
    cli = ImageStore(tmp_path)
    old = _image("old")
    _store_blobs(daemon, old)
    daemon.register(old.manifest_digest, ["old:1"])
    new = _image("new")
    with cli.ingesting():
        _store_blobs(cli, new)
        # The daemon removes an image (and collects garbage) while the import is in flight:
        # the import's unnamed blobs survive, and a third instance starting now cleans nothing.
        assert daemon.remove("old:1") is not None
        assert all(daemon.content.has(d) for d in new.blobs)
        assert ImageStore(tmp_path).recovered == 0
        cli.register(new.manifest_digest, ["new:1"])
    rec = daemon.get("new:1")
    assert rec is not None and rec.id == new.config_digest
    assert [r.id for r in daemon.images()] == [new.config_digest]
    assert not daemon.content.has(old.manifest_digest)


def test_kill_mid_unpack_then_restart_leaves_no_orphans(tmp_path: Path) -> None:
    # A process stores an image's blobs and dies (SIGKILL) half-way through unpacking its
    # layer: the next start removes the temporary snapshot and the unnamed blobs.
    img = build_image([layer_tar([E(f"f{i}", data=os.urandom(64 << 10)) for i in range(64)])])
    (tmp_path / "blobs.json").write_text(json.dumps({d: b.hex() for d, b in img.blobs.items()}))
    (tmp_path / "layer.tar").write_bytes(img.layer_tars[0])
    script = f"""
import io, json, sys, time
from pathlib import Path
from podgate.images.store import ImageStore
store = ImageStore(Path({str(tmp_path / "state")!r}))
for d, h in json.loads(Path({str(tmp_path / "blobs.json")!r}).read_text()).items():
    store.content.write_blob(bytes.fromhex(h), d)
tar = Path({str(tmp_path / "layer.tar")!r}).read_bytes()
class Stalls(io.RawIOBase):
    pos = 0
    def readable(self): return True
    def readinto(self, b):
        if self.pos >= len(tar) // 2:
            print("half", flush=True)
            time.sleep(600)
        n = min(len(b), 4096, len(tar) // 2 - self.pos)
        b[:n] = tar[self.pos:self.pos + n]
        self.pos += n
        return n
store.snapshots.prepare({img.diff_ids[0]!r}, None, io.BufferedReader(Stalls()), None, 1 << 30)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"half\n"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    snaps = tmp_path / "state" / "images" / "snapshots"
    assert [p.name[:5] for p in snaps.iterdir() if p.name != "leases"] == [".tmp-"]
    store = ImageStore(tmp_path / "state")
    assert store.recovered == 1 + len(img.blobs)  # the temp snapshot, then every blob
    assert _orphans(store) == [] and store.images() == []
    assert [p.name for p in snaps.iterdir()] == ["leases"]


def test_import_docker_archive_with_linked_layers_and_refuse_links_out(tmp_path: Path) -> None:
    # Older `docker save` writes a repeated layer as a symlink to the first copy.
    img = build_image([BASE, BASE, layer_tar([E("top", data=b"t")])], {})
    src = tmp_path / "saved"
    src.mkdir()
    write_docker_archive([(img, ["linked:1"])], tmp_path / "saved.tar")
    with tarfile.open(tmp_path / "saved.tar") as tf:
        tf.extractall(src, filter="data")
    manifest = json.loads((src / "manifest.json").read_text())
    first = manifest[0]["Layers"][0]
    (src / "dup").mkdir()
    (src / "dup" / "layer.tar").symlink_to(Path("..") / first)
    manifest[0]["Layers"][1] = "dup/layer.tar"
    (src / "manifest.json").write_text(json.dumps(manifest))
    store = ImageStore(tmp_path / "state")
    (rec,) = import_archive(store, src)
    assert rec.diff_ids == img.diff_ids and store.get("linked:1") is not None

    (tmp_path / "secret").write_bytes(b"not yours")
    (src / "dup" / "layer.tar").unlink()
    (src / "dup" / "layer.tar").symlink_to(tmp_path / "secret")
    store2 = ImageStore(tmp_path / "state2")
    with pytest.raises(Exception, match="outside the archive"):
        import_archive(store2, src)
    assert store2.images() == [] and store2.content.digests() == []
