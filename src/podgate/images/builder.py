"""A small OCI image writer: directories or in-memory tars → layers → an OCI layout or a
``docker save`` archive, with a proper image config (diff IDs, history, platform).

Deterministic: same input, same digests (sorted entries, fixed mtimes in the gzip header), so
tests and `podgate up` can name the images they build by digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import stat
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zstandard

__all__ = [
    "BuiltImage",
    "build_image",
    "dir_layer",
    "host_arch",
    "write_docker_archive",
    "write_oci_layout",
]

OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX: Final = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
OCI_LAYER: Final = "application/vnd.oci.image.layer.v1.tar"
REF_NAME_ANNOTATION: Final = "org.opencontainers.image.ref.name"
CONTAINERD_NAME_ANNOTATION: Final = "io.containerd.image.name"
# Go architecture names (containerd/platforms).
_GO_ARCH: Final = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}
# A fixed timestamp for reproducible archives (2024-01-01T00:00:00Z).
EPOCH: Final = 1_704_067_200


def host_arch() -> str:
    m = platform.machine()
    return _GO_ARCH.get(m, m)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def dir_layer(root: Path, prefix: str = "") -> bytes:
    """A layer tar of the tree at `root` (owners, modes, symlinks, hard links kept)."""
    buf = io.BytesIO()
    seen: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted([*dirnames, *filenames]):
                path = os.path.join(dirpath, name)
                arc = os.path.normpath(os.path.join(prefix, rel_dir, name))
                st = os.lstat(path)
                ti = tf.gettarinfo(path, arcname=arc)
                ti.uname = ti.gname = ""
                key = (st.st_dev, st.st_ino)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and key in seen:
                    ti.type, ti.linkname, ti.size = tarfile.LNKTYPE, seen[key], 0
                    tf.addfile(ti)
                    continue
                seen[key] = arc
                if stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        tf.addfile(ti, f)
                else:
                    tf.addfile(ti)
    return buf.getvalue()


@dataclass
class BuiltImage:
    blobs: dict[str, bytes]
    manifest_digest: str
    config_digest: str
    layer_digests: list[str]
    diff_ids: list[str]
    layer_tars: list[bytes] = field(repr=False, default_factory=list)

    @property
    def manifest(self) -> bytes:
        return self.blobs[self.manifest_digest]

    @property
    def size(self) -> int:
        """Compressed layers + config: what ImageStatus reports."""
        return sum(len(self.blobs[d]) for d in self.layer_digests) + len(
            self.blobs[self.config_digest]
        )


def _compress(tar: bytes, how: str) -> tuple[bytes, str]:
    if how == "gzip":
        return gzip.compress(tar, compresslevel=6, mtime=0), OCI_LAYER + "+gzip"
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(tar), OCI_LAYER + "+zstd"
    if how == "none":
        return tar, OCI_LAYER
    raise ValueError(f"unknown compression {how!r}")


def build_image(
    layers: Sequence[bytes],
    config: Mapping[str, Any] | None = None,
    compression: str = "gzip",
    arch: str | None = None,
) -> BuiltImage:
    """`layers` are uncompressed tars, base first; `config` the OCI `config` object."""
    blobs: dict[str, bytes] = {}
    descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    for tar in layers:
        data, media = _compress(tar, compression)
        d = _sha(data)
        blobs[d] = data
        diff_ids.append(_sha(tar))
        descs.append({"mediaType": media, "digest": d, "size": len(data)})
    cfg = {
        "architecture": arch or host_arch(),
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": dict(config or {}),
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "podgate"} for _ in layers],
    }
    cfg_bytes = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
    cfg_d = _sha(cfg_bytes)
    blobs[cfg_d] = cfg_bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_d, "size": len(cfg_bytes)},
        "layers": descs,
    }
    man_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    man_d = _sha(man_bytes)
    blobs[man_d] = man_bytes
    return BuiltImage(blobs, man_d, cfg_d, [d["digest"] for d in descs], diff_ids, list(layers))


def _index(images: Sequence[tuple[BuiltImage, str | None]]) -> bytes:
    manifests = []
    for img, name in images:
        desc: dict[str, Any] = {
            "mediaType": OCI_MANIFEST,
            "digest": img.manifest_digest,
            "size": len(img.manifest),
            "platform": {"architecture": host_arch(), "os": "linux"},
        }
        if name:
            tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
            desc["annotations"] = {CONTAINERD_NAME_ANNOTATION: name, REF_NAME_ANNOTATION: tag}
        manifests.append(desc)
    doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
    return json.dumps(doc, sort_keys=True, indent=2).encode()


def _files_oci(images: Sequence[tuple[BuiltImage, str | None]]) -> dict[str, bytes]:
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": _index(images)}
    for img, _ in images:
        for d, data in img.blobs.items():
            files[f"blobs/sha256/{d.removeprefix('sha256:')}"] = data
    return files


def _files_docker(images: Sequence[tuple[BuiltImage, Sequence[str]]]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    entries = []
    for img, tags in images:
        cfg_name = img.config_digest.removeprefix("sha256:") + ".json"
        files[cfg_name] = img.blobs[img.config_digest]
        layer_names = []
        for tar in img.layer_tars:
            n = f"{hashlib.sha256(tar).hexdigest()}/layer.tar"
            files[n] = tar
            layer_names.append(n)
        entries.append({"Config": cfg_name, "RepoTags": list(tags), "Layers": layer_names})
    files["manifest.json"] = json.dumps(entries).encode()
    return files


def _write(files: Mapping[str, bytes], dest: Path, as_tar: bool) -> None:
    if as_tar:
        with tarfile.open(dest, "w") as tf:
            dirs: set[str] = set()
            for name in sorted(files):
                parts = name.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        ti = tarfile.TarInfo(d)
                        ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, EPOCH
                        tf.addfile(ti)
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode, ti.mtime = len(files[name]), 0o644, EPOCH
                tf.addfile(ti, io.BytesIO(files[name]))
        return
    for name, data in files.items():
        p = dest / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def write_oci_layout(
    images: Sequence[tuple[BuiltImage, str | None]], dest: Path, as_tar: bool = False
) -> None:
    """An OCI image layout (directory, or a tar of one) holding `images` with their names."""
    _write(_files_oci(images), dest, as_tar)


def write_docker_archive(images: Sequence[tuple[BuiltImage, Sequence[str]]], dest: Path) -> None:
    """A ``docker save`` archive: manifest.json, <config>.json, <id>/layer.tar."""
    _write(_files_docker(images), dest, as_tar=True)
