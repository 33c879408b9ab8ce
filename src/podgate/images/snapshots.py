"""Snapshots: one directory per layer, keyed by its OCI chain ID, used as overlayfs lower dirs.

Layout under the root:

    <hex>/fs          the layer's changes (see unpack.py), an overlay lower dir
    <hex>/meta.json   {"chain_id", "diff_id", "parent", "size", "inodes"}
    leases/<id>.json  chain IDs a container holds (acquire/release)
    .tmp-*            a layer being unpacked or a snapshot being deleted

A snapshot appears by one rename of a fully unpacked temporary directory, so after a crash a
snapshot either exists whole or not at all; `clean()` on start removes leftover .tmp-* dirs.
Sharing is by key: two images with a common base hold the same chain IDs, stored once. What
is kept is decided by `gc(in_use)`: the chain IDs of every image record plus every lease.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from podgate.files import fsync_directory, rename_durably
from podgate.images.unpack import UnpackResult, apply_layer
from podgate.linux.proc import atomic_write_json

__all__ = ["Snapshot", "SnapshotStore", "chain_ids"]

TMP_PREFIX: Final = ".tmp-"
_CHAIN_RE: Final = re.compile(r"^sha256:([a-f0-9]{64})$")
_LEASE_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """OCI image-spec: ChainID(1) = DiffID(1), ChainID(n) = sha256(ChainID(n-1) " " DiffID(n))."""
    out: list[str] = []
    for d in diff_ids:
        if not out:
            out.append(d)
        else:
            out.append("sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


def _hex(chain_id: str) -> str:
    m = _CHAIN_RE.match(chain_id)
    if m is None:
        raise ValueError(f"malformed chain id {chain_id!r}")
    return m.group(1)


@dataclass(frozen=True)
class Snapshot:
    chain_id: str
    diff_id: str
    parent: str | None
    size: int  # bytes of the unpacked files (st_blocks), for ImageFsInfo
    inodes: int
    path: Path  # the lower dir


def _usage(root: Path) -> tuple[int, int]:
    """Bytes allocated and inodes under `root`, each hard-linked inode counted once."""
    seen: set[int] = set()
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (dirpath, *(os.path.join(dirpath, f) for f in (*dirnames, *filenames))):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(n)
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    size += st.st_blocks * 512
    return size, len(seen)


class SnapshotStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.leases_dir = self.root / "leases"
        self.leases_dir.mkdir(parents=True, exist_ok=True)

    # -- lookups ---------------------------------------------------------------------------------

    def dir(self, chain_id: str) -> Path:
        return self.root / _hex(chain_id)

    def lowerdir(self, chain_id: str) -> Path:
        return self.dir(chain_id) / "fs"

    def has(self, chain_id: str) -> bool:
        return (self.dir(chain_id) / "meta.json").is_file()

    def get(self, chain_id: str) -> Snapshot | None:
        try:
            meta = json.loads((self.dir(chain_id) / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return Snapshot(
            chain_id, meta["diff_id"], meta["parent"], meta["size"], meta["inodes"],
            self.lowerdir(chain_id),
        )  # fmt: skip

    def ids(self) -> list[str]:
        return sorted(
            "sha256:" + p.name for p in self.root.iterdir() if _CHAIN_RE.match("sha256:" + p.name)
        )

    def lowerdirs(self, chain: Sequence[str]) -> list[Path]:
        """Overlay lowerdir order for an image whose chain IDs are `chain` (base first)."""
        missing = [c for c in chain if not self.has(c)]
        if missing:
            raise FileNotFoundError(f"snapshot {missing[0]} is not unpacked")
        return [self.lowerdir(c) for c in reversed(chain)]

    # -- creation --------------------------------------------------------------------------------

    def prepare(
        self,
        chain_id: str,
        parent: str | None,
        layer: IO[bytes],
        diff_id: str | None,
        max_bytes: int,
    ) -> Snapshot:
        """Unpack `layer` on top of `parent` as snapshot `chain_id`; no-op if it exists."""
        existing = self.get(chain_id)
        if existing is not None:
            return existing
        parents: list[Path] = []
        p = parent
        while p is not None:
            snap = self.get(p)
            if snap is None:
                raise FileNotFoundError(f"parent snapshot {p} is not unpacked")
            parents.append(snap.path)
            p = snap.parent
        tmp = self.root / f"{TMP_PREFIX}{_hex(chain_id)[:12]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o700)
        try:
            fs = tmp / "fs"
            fs.mkdir(mode=0o755)
            result: UnpackResult = apply_layer(layer, fs, parents, max_bytes, diff_id)
            size, inodes = _usage(fs)
            meta = {
                "chain_id": chain_id,
                "diff_id": result.diff_id,
                "parent": parent,
                "size": size,
                "inodes": inodes,
            }
            atomic_write_json(str(tmp / "meta.json"), meta)
            expected = chain_ids([parent, result.diff_id])[-1] if parent else result.diff_id
            if expected != chain_id:
                raise ValueError(f"layer chain id is {expected}, expected {chain_id}")
            fsync_directory(tmp)
            try:
                rename_durably(tmp, self.dir(chain_id), replace=False)
            except OSError:
                if not self.has(chain_id):  # lost a race with an identical unpack: fine
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        snap = self.get(chain_id)
        assert snap is not None
        return snap

    # -- leases and removal ----------------------------------------------------------------------

    def acquire(self, lease: str, chain: Sequence[str]) -> list[Path]:
        """A container holds `chain` until `release(lease)`; returns its overlay lower dirs."""
        if not _LEASE_RE.match(lease):
            raise ValueError(f"bad lease id {lease!r}")
        dirs = self.lowerdirs(chain)
        atomic_write_json(str(self.leases_dir / f"{lease}.json"), list(chain))
        return dirs

    def release(self, lease: str) -> None:
        if not _LEASE_RE.match(lease):
            raise ValueError(f"bad lease id {lease!r}")
        with contextlib.suppress(FileNotFoundError):
            (self.leases_dir / f"{lease}.json").unlink()

    def leases(self) -> list[str]:
        """The ids holding leases."""
        return sorted(p.stem for p in self.leases_dir.glob("*.json"))

    def leased(self) -> set[str]:
        held: set[str] = set()
        for p in self.leases_dir.glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                held.update(json.loads(p.read_text()))
        return held

    def remove(self, chain_id: str) -> None:
        d = self.dir(chain_id)
        if not d.exists():
            return
        # Rename first so a crash mid-delete leaves a .tmp- dir (cleaned on start), not a
        # half-deleted snapshot that looks whole.
        trash = self.root / f"{TMP_PREFIX}del-{_hex(chain_id)[:12]}-{uuid.uuid4().hex[:8]}"
        rename_durably(d, trash, replace=False)
        shutil.rmtree(trash, ignore_errors=True)

    def gc(self, in_use: Iterable[str]) -> list[str]:
        keep = set(in_use) | self.leased()
        removed = [c for c in self.ids() if c not in keep]
        for c in removed:
            self.remove(c)
        return removed

    def clean(self) -> int:
        """Remove leftovers of a crash (temp dirs, snapshots without meta); returns the count."""
        n = 0
        for p in self.root.iterdir():
            orphan = p.name.startswith(TMP_PREFIX) or (
                _CHAIN_RE.match("sha256:" + p.name) and not (p / "meta.json").is_file()
            )
            if orphan:
                shutil.rmtree(p, ignore_errors=True)
                n += 1
        for p in self.leases_dir.iterdir():
            if p.name.startswith("."):
                p.unlink(missing_ok=True)
                n += 1
        return n
