"""Layer unpacking into chain-ID snapshots: every entry type, whiteouts as overlayfs reads them,
and hostile tars refused with nothing written outside (or left inside) the store."""

from __future__ import annotations

import io
import os
import stat
import subprocess
from pathlib import Path

import pytest
from layers_support import E, compress, layer_tar, sha256, tree_digest

from podgate.images.snapshots import SnapshotStore, chain_ids
from podgate.images.unpack import LayerTooLargeError, UnsafeLayerError, WrongDiffIDError

MAX = 64 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root is not available")


def _prepare(store: SnapshotStore, tars: list[bytes], how: str = "plain") -> list[str]:
    chain = chain_ids([sha256(t) for t in tars])
    for i, t in enumerate(tars):
        store.prepare(chain[i], chain[i - 1] if i else None, io.BytesIO(compress(t, how)),
                      sha256(t), MAX)  # fmt: skip
    return chain


@pytest.mark.parametrize("how", ["plain", "gzip", "zstd"])
def test_entry_types_and_metadata(tmp_path: Path, how: str) -> None:
    tar = layer_tar(
        [
            E("bin", "dir", mode=0o755, mtime=1_500_000_000),
            E("bin/busybox", data=b"\x7fELF" + b"x" * 5000, mode=0o4755, uid=0, gid=0),
            E("bin/sh", "link", link="bin/busybox"),
            E("bin/ls", "sym", link="busybox"),
            E("home/app", "dir", mode=0o750, uid=1000, gid=1001),
            E("home/app/f", data=b"hi", mode=0o600, uid=1000, gid=1001, mtime=1_234_567_890),
            E(
                "home/app/x",
                data=b"x",
                xattrs={"user.podgate": "yes", "trusted.overlay.redirect": "/etc"},
            ),
            E("dev/null", "chr", mode=0o666, dev=(1, 3)),
            E("dev/loop9", "blk", mode=0o660, dev=(7, 9)),
            E("run/fifo", "fifo", mode=0o620),
            E("tmp", "dir", mode=0o1777),
        ]
    )
    store = SnapshotStore(tmp_path / "snap")
    (chain,) = _prepare(store, [tar], how)
    assert chain == sha256(tar)
    root = store.lowerdir(chain)
    st = os.lstat(root / "bin/busybox")
    assert stat.S_IMODE(st.st_mode) == 0o4755
    assert os.lstat(root / "bin/sh").st_ino == st.st_ino and st.st_nlink == 2
    assert os.readlink(root / "bin/ls") == "busybox"
    assert (root / "home/app/f").read_bytes() == b"hi"
    f = os.lstat(root / "home/app/f")
    assert (f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode), f.st_mtime) == (
        1000,
        1001,
        0o600,
        1_234_567_890,
    )
    d = os.lstat(root / "home/app")
    assert (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (1000, 1001, 0o750)
    assert os.lstat(root / "bin").st_mtime == 1_500_000_000
    assert os.getxattr(root / "home/app/x", "user.podgate") == b"yes"
    # overlayfs's own attributes are never taken from a layer.
    assert "trusted.overlay.redirect" not in os.listxattr(root / "home/app/x")
    n = os.lstat(root / "dev/null")
    assert stat.S_ISCHR(n.st_mode) and os.major(n.st_rdev) == 1 and os.minor(n.st_rdev) == 3
    b = os.lstat(root / "dev/loop9")
    assert stat.S_ISBLK(b.st_mode) and (os.major(b.st_rdev), os.minor(b.st_rdev)) == (7, 9)
    assert stat.S_ISFIFO(os.lstat(root / "run/fifo").st_mode)
    assert stat.S_IMODE(os.lstat(root / "tmp").st_mode) == 0o1777
    snap = store.get(chain)
    assert snap is not None and snap.size > 0 and snap.inodes >= 12


def test_whiteouts_and_opaque_dirs_as_overlayfs_sees_them(tmp_path: Path) -> None:
    base = layer_tar(
        [
            E("a", "dir", mode=0o755),
            E("a/x", data=b"x"),
            E("a/y", data=b"y"),
            E("b", "dir", mode=0o755),
            E("b/old1", data=b"1"),
            E("b/sub", "dir"),
            E("b/sub/old2", data=b"2"),
            E("c", "dir", mode=0o755),
            E("c/gone", "dir"),
            E("c/gone/deep", data=b"d"),
        ]
    )
    top = layer_tar(
        [
            E("a/.wh.x"),
            E("b/.wh..wh..opq"),
            E("b/new", data=b"n"),
            E("c/.wh.gone"),
            E("c/mine", data=b"m"),
            E("c/.wh.mine"),  # never hides an entry of its own layer
        ]
    )
    store = SnapshotStore(tmp_path / "snap")
    chain = _prepare(store, [base, top], "gzip")
    upper = store.lowerdir(chain[1])
    wh = os.lstat(upper / "a/x")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(upper / "b", "trusted.overlay.opaque") == b"y"
    assert not (upper / "a/.wh.x").exists() and not (upper / "b/.wh..wh..opq").exists()
    assert (upper / "c/mine").read_bytes() == b"m"

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lower = ":".join(str(p) for p in store.lowerdirs(chain))
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(mnt)],
                   check=True)  # fmt: skip
    try:
        assert sorted(os.listdir(mnt / "a")) == ["y"]
        assert sorted(os.listdir(mnt / "b")) == ["new"]
        assert sorted(os.listdir(mnt / "c")) == ["mine"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_hardlink_to_lower_layer_file_is_copied_up(tmp_path: Path) -> None:
    base = layer_tar([E("bin", "dir"), E("bin/busybox", data=b"BB", mode=0o755)])
    top = layer_tar([E("bin/cat", "link", link="bin/busybox")])
    store = SnapshotStore(tmp_path / "snap")
    chain = _prepare(store, [base, top])
    upper = store.lowerdir(chain[1])
    assert (upper / "bin/cat").read_bytes() == b"BB"
    assert os.lstat(upper / "bin/cat").st_ino == os.lstat(upper / "bin/busybox").st_ino
    # The lower layer is never written.
    assert os.lstat(store.lowerdir(chain[0]) / "bin/busybox").st_nlink == 1


def test_shared_base_stored_once_and_gc(tmp_path: Path) -> None:
    base = layer_tar([E("etc", "dir"), E("etc/os-release", data=b"podgate")])
    one = layer_tar([E("one", data=b"1")])
    two = layer_tar([E("two", data=b"2")])
    store = SnapshotStore(tmp_path / "snap")
    c1 = _prepare(store, [base, one])
    c2 = _prepare(store, [base, two])
    assert c1[0] == c2[0]
    assert sorted(store.ids()) == sorted({*c1, *c2})
    store.acquire("ctr1", c1)
    assert store.gc(c2) == []
    # c1's top is leased by the container: kept.
    assert store.has(c1[1])
    store.release("ctr1")
    assert store.gc(c2) == [c1[1]]
    assert store.has(c2[0]) and store.has(c2[1]) and not store.has(c1[1])
    assert store.gc([]) == sorted(c2)
    assert store.ids() == []


def _hostile(tmp_path: Path, layers: list[bytes], exc: type[Exception], how: str = "plain") -> None:
    outside = tmp_path / "outside"
    (outside / "etc").mkdir(parents=True)
    (outside / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    store = SnapshotStore(tmp_path / "snap")
    before = tree_digest(tmp_path)
    chain = chain_ids([sha256(t) for t in layers])
    for i, t in enumerate(layers[:-1]):
        store.prepare(chain[i], chain[i - 1] if i else None, io.BytesIO(t), None, MAX)
    kept = set(store.ids())
    with pytest.raises(exc):
        store.prepare(chain[-1], chain[-2] if len(chain) > 1 else None,
                      io.BytesIO(compress(layers[-1], how)), None, MAX)  # fmt: skip
    assert set(store.ids()) == kept
    leftovers = [p.name for p in store.root.iterdir() if p.name.startswith(".tmp")]
    assert leftovers == []
    for c in kept:
        store.remove(c)
    assert tree_digest(tmp_path) == before


def test_hostile_dotdot(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("ok", data=b"1"), E("../outside/etc/passwd", data=b"pwn")])],
             UnsafeLayerError)  # fmt: skip


def test_hostile_dotdot_deep(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("a/b/../../../../outside/x", data=b"pwn")])], UnsafeLayerError)


def test_hostile_absolute(tmp_path: Path) -> None:
    target = tmp_path / "outside" / "abs"
    _hostile(tmp_path, [layer_tar([E(str(target), data=b"pwn")])], UnsafeLayerError)
    assert not target.exists()


def test_hostile_symlink_parent(tmp_path: Path) -> None:
    out = str(tmp_path / "outside" / "etc")
    _hostile(tmp_path, [layer_tar([E("evil", "sym", link=out), E("evil/passwd", data=b"pwn")])],
             UnsafeLayerError)  # fmt: skip


def test_hostile_relative_symlink_parent(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("evil", "sym", link="../../../outside/etc"),
                                   E("evil/shadow", data=b"pwn")])], UnsafeLayerError)  # fmt: skip


def test_hostile_symlink_parent_in_lower_layer(tmp_path: Path) -> None:
    out = str(tmp_path / "outside" / "etc")
    _hostile(tmp_path, [layer_tar([E("evil", "sym", link=out)]),
                        layer_tar([E("evil/passwd", data=b"pwn")])], UnsafeLayerError)  # fmt: skip


def test_hostile_hardlink_out(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("l", "link", link="../outside/etc/passwd")])],
             UnsafeLayerError)  # fmt: skip


def test_hostile_hardlink_absolute(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("l", "link", link=str(tmp_path / "outside/etc/passwd"))])],
             UnsafeLayerError)  # fmt: skip


def test_hostile_hardlink_through_symlink(tmp_path: Path) -> None:
    out = str(tmp_path / "outside" / "etc")
    _hostile(tmp_path, [layer_tar([E("s", "sym", link=out), E("l", "link", link="s/passwd")])],
             UnsafeLayerError)  # fmt: skip


def test_hostile_whiteout_escape(tmp_path: Path) -> None:
    _hostile(tmp_path, [layer_tar([E("a/.wh..."), E("b", data=b"")])], UnsafeLayerError)


@pytest.mark.parametrize("how", ["plain", "gzip", "zstd"])
def test_oversize_layer_refused(tmp_path: Path, how: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    big = layer_tar([E("zeros", data=bytes(MAX + 1))])
    store = SnapshotStore(tmp_path / "snap")
    with pytest.raises(LayerTooLargeError):
        store.prepare(sha256(big), None, io.BytesIO(compress(big, how)), None, MAX)
    assert list(store.root.iterdir()) == [store.leases_dir]


def test_wrong_diff_id_refused(tmp_path: Path) -> None:
    tar = layer_tar([E("f", data=b"1")])
    store = SnapshotStore(tmp_path / "snap")
    with pytest.raises(WrongDiffIDError, match="wrong diff id"):
        store.prepare(sha256(tar), None, io.BytesIO(tar), sha256(b"other"), MAX)
    assert store.ids() == []


def test_crash_leftovers_cleaned(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snap")
    (store.root / ".tmp-0123-dead").mkdir()
    (store.root / ".tmp-0123-dead" / "fs").mkdir()
    (store.root / ("ab" * 32)).mkdir()  # renamed but meta lost: cannot happen, still cleaned
    assert store.clean() == 2
    assert list(store.root.iterdir()) == [store.leases_dir]


def test_sparse_bomb_refused(tmp_path: Path) -> None:
    # A GNU sparse entry: a few hundred bytes of tar that declare a file far over the cap.
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        f.truncate(MAX * 4)
        f.write(b"x")
    tar = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(tar), "-C", str(src), "sparse"], check=True)
    data = tar.read_bytes()
    assert len(data) < MAX // 1024
    store = SnapshotStore(tmp_path / "snap")
    with pytest.raises(LayerTooLargeError):
        store.prepare(sha256(data), None, io.BytesIO(data), None, MAX)
    assert list(store.root.iterdir()) == [store.leases_dir]
