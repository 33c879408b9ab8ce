"""Build layer tars in memory for the tests: every entry type, hostile names, compression."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard


@dataclass
class E:
    name: str
    kind: str = "file"  # file dir sym link chr blk fifo
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 1_600_000_000
    link: str = ""
    dev: tuple[int, int] = (0, 0)
    xattrs: dict[str, str] = field(default_factory=dict)


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "sym": tarfile.SYMTYPE,
    "link": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def layer_tar(entries: Iterable[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.type = _TYPES[e.kind]
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, e.mtime
            ti.linkname = e.link
            ti.devmajor, ti.devminor = e.dev
            ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            if e.kind == "file":
                ti.size = len(e.data)
                tf.addfile(ti, io.BytesIO(e.data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tree_digest(root: Path) -> str:
    """A checksum of every name, type, mode, owner, link target and content under `root`."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for n in sorted([*dirnames, *filenames]):
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, root)}|{st.st_mode}|{st.st_uid}|{st.st_gid}|".encode())
            if os.path.islink(p):
                h.update(os.readlink(p).encode())
            elif os.path.isfile(p):
                h.update(Path(p).read_bytes())
    return h.hexdigest()
