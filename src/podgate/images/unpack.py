"""Apply one OCI layer tar to an empty directory that becomes an overlayfs lower dir.

The directory holds only this layer's changes, in overlayfs's own form: a deleted entry
(``.wh.<name>`` in the tar) is a character device 0/0 named ``<name>``, an opaque directory
(``.wh..wh..opq``) carries the xattr ``trusted.overlay.opaque=y``. Mounted as lower dirs in
chain order, the snapshots then show the image's root filesystem.

The tar is hostile input. Every entry is created through directory file descriptors opened
component by component from the snapshot root with O_NOFOLLOW, so a ``..`` or absolute name,
a symlinked parent (in this layer or a lower one) or a hard link leaving the snapshot is
refused with UnsafeLayerError, never followed. The uncompressed stream is capped: past
``max_bytes`` the layer is refused. The caller unpacks into a temporary directory and
discards it on any error, so a refused layer leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import zstandard

__all__ = [
    "LayerError",
    "LayerTooLargeError",
    "UnpackResult",
    "UnsafeLayerError",
    "WrongDiffIDError",
    "apply_layer",
]

WHITEOUT_PREFIX: Final = ".wh."
OPAQUE_MARKER: Final = ".wh..wh..opq"
OVERLAY_XATTR_PREFIX: Final = "trusted.overlay."
OVERLAY_OPAQUE_XATTR: Final = OVERLAY_XATTR_PREFIX + "opaque"
PAX_XATTR_PREFIX: Final = "SCHILY.xattr."
# Bytes per read from the decompressor: one tar record multiple, big enough to amortise calls.
STREAM_CHUNK_BYTES: Final = 1 << 20
# Symlink-following budget is zero: every component below the root is opened like this.
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_GZIP_MAGIC: Final = b"\x1f\x8b"
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"


class LayerError(Exception):
    """The layer cannot be applied."""


class UnsafeLayerError(LayerError):
    """An entry would be written outside the snapshot."""


class LayerTooLargeError(LayerError):
    pass


class WrongDiffIDError(LayerError):
    pass


@dataclass(frozen=True)
class UnpackResult:
    diff_id: str  # sha256 of the uncompressed tar stream
    tar_bytes: int  # uncompressed stream length
    entries: int


class _CountingReader:
    """Reads the uncompressed tar: hashes it for the diff ID and enforces the size cap."""

    def __init__(self, raw: IO[bytes], max_bytes: int) -> None:
        self._raw = raw
        self._max = max_bytes
        self.hash = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n if n is not None and n >= 0 else STREAM_CHUNK_BYTES)
        self.count += len(data)
        if self.count > self._max:
            raise LayerTooLargeError(f"layer unpacks to more than {self._max} bytes")
        self.hash.update(data)
        return data

    def drain(self) -> None:
        while self.read(STREAM_CHUNK_BYTES):
            pass


class _Peek:
    """A stream with its first bytes already read (to sniff the compression)."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = head
        self._rest = rest

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n < 0 or n >= len(self._head):
                head, self._head = self._head, b""
                return head + self._rest.read(-1 if n < 0 else n - len(head))
            head, self._head = self._head[:n], self._head[n:]
            return head
        return self._rest.read(n)


@contextlib.contextmanager
def _decompressed(src: IO[bytes]) -> Iterator[IO[bytes]]:
    head = src.read(4)
    stream = _Peek(head, src)
    if head.startswith(_GZIP_MAGIC):
        with gzip.GzipFile(fileobj=stream, mode="rb") as g:  # type: ignore[call-overload]
            yield g
    elif head.startswith(_ZSTD_MAGIC):
        with zstandard.ZstdDecompressor().stream_reader(stream) as z:  # type: ignore[arg-type]
            yield z
    else:
        yield stream  # type: ignore[misc]


def _components(name: str) -> list[str]:
    """Split an entry name; refuse absolute names and any ``..``."""
    if name.startswith("/"):
        raise UnsafeLayerError(f"absolute entry name {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayerError(f"entry name {name!r} leaves the layer root")
    return parts


def _lookup(root_fd: int, parts: Sequence[str]) -> os.stat_result | None:
    """lstat of root/parts without following any symlink; None when absent or hidden."""
    fd = os.dup(root_fd)
    try:
        for comp in parts[:-1]:
            try:
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nfd
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
    finally:
        os.close(fd)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


class _Applier:
    def __init__(self, root_fd: int, lower_fds: Sequence[int], max_bytes: int) -> None:
        self.root_fd = root_fd
        self.lower_fds = lower_fds  # topmost first
        # The stream cap alone does not bound what is written: a GNU sparse entry declares a
        # size its few stream bytes expand to. File sizes count against the same cap.
        self.max_bytes = max_bytes
        self.file_bytes = 0
        self.created: set[tuple[str, ...]] = set()
        self.dir_times: list[tuple[tuple[str, ...], int]] = []

    def _lower_stat(self, parts: Sequence[str]) -> os.stat_result | None:
        for lfd in self.lower_fds:
            st = _lookup(lfd, parts)
            if st is not None:
                return None if _is_whiteout(st) else st
        return None

    def open_parent(self, parts: Sequence[str]) -> int:
        """An fd on the directory that holds parts[-1], created as needed, never via a symlink."""
        fd = os.dup(self.root_fd)
        try:
            for i, comp in enumerate(parts[:-1]):
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    lower = self._lower_stat(parts[: i + 1])
                    if lower is not None and stat.S_ISLNK(lower.st_mode):
                        raise UnsafeLayerError(
                            f"parent {'/'.join(parts[: i + 1])!r} is a symlink in a lower layer"
                        ) from None
                    mode = stat.S_IMODE(lower.st_mode) if lower is not None else 0o755
                    os.mkdir(comp, mode, dir_fd=fd)
                    if lower is not None:
                        os.chown(comp, lower.st_uid, lower.st_gid, dir_fd=fd)
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafeLayerError(
                            f"parent {'/'.join(parts[: i + 1])!r} is not a directory"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _remove(dfd: int, name: str, keep_dir: bool) -> None:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                for child in os.listdir(sub):
                    _Applier._remove(sub, child, False)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)

    def whiteout(self, parts: list[str], base: str) -> None:
        if base == OPAQUE_MARKER:
            dfd = self.open_parent([*parts, "x"])
            try:
                os.setxattr(dfd, OVERLAY_OPAQUE_XATTR, b"y")
            finally:
                os.close(dfd)
            return
        target = base[len(WHITEOUT_PREFIX) :]
        if target in ("", ".", "..") or "/" in target:
            raise UnsafeLayerError(f"invalid whiteout name {base!r}")
        tparts = (*parts, target)
        if tparts in self.created:
            return  # whiteouts never hide entries of their own layer
        dfd = self.open_parent(list(tparts))
        try:
            self._remove(dfd, target, keep_dir=False)
            os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=dfd)
        finally:
            os.close(dfd)

    def _copy_up(self, parts: list[str]) -> None:
        """A hard link to a file of a lower layer: bring the file into this layer first."""
        for lfd in self.lower_fds:
            st = _lookup(lfd, parts)
            if st is None:
                continue
            if not stat.S_ISREG(st.st_mode):
                break
            sfd = os.dup(lfd)
            try:
                for comp in parts[:-1]:
                    n = os.open(comp, _DIR_FLAGS, dir_fd=sfd)
                    os.close(sfd)
                    sfd = n
                src = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
            finally:
                os.close(sfd)
            dfd = self.open_parent(parts)
            try:
                dst = os.open(
                    parts[-1],
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=dfd,
                )
                with os.fdopen(src, "rb") as s, os.fdopen(dst, "wb") as d:
                    shutil.copyfileobj(s, d, STREAM_CHUNK_BYTES)
                    os.fchown(d.fileno(), st.st_uid, st.st_gid)
                    os.fchmod(d.fileno(), stat.S_IMODE(st.st_mode))
                os.utime(
                    parts[-1], ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd,
                    follow_symlinks=False,
                )  # fmt: skip
            finally:
                os.close(dfd)
            return
        raise UnsafeLayerError(f"hard link target {'/'.join(parts)!r} is not in the image")

    def entry(self, ti: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        parts = _components(ti.name)
        if not parts:
            return  # the root itself
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            self.whiteout(parts[:-1], base)
            return
        dfd = self.open_parent(parts)
        try:
            self._remove(dfd, base, keep_dir=ti.isdir())
            if ti.isdir():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(base, 0o700, dir_fd=dfd)
                self.dir_times.append((tuple(parts), int(ti.mtime)))
            elif ti.isreg():
                self.file_bytes += ti.size
                if self.file_bytes > self.max_bytes:
                    raise LayerTooLargeError(f"layer unpacks to more than {self.max_bytes} bytes")
                fd = os.open(
                    base,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=dfd,
                )
                with os.fdopen(fd, "wb") as out:
                    src = tf.extractfile(ti)
                    if src is not None:
                        shutil.copyfileobj(src, out, STREAM_CHUNK_BYTES)
            elif ti.issym():
                os.symlink(ti.linkname, base, dir_fd=dfd)
            elif ti.islnk():
                tparts = _components(ti.linkname)
                if not tparts:
                    raise UnsafeLayerError(f"hard link {ti.name!r} to the root")
                st = _lookup(self.root_fd, tparts)
                if st is None:
                    self._copy_up(tparts)
                    st = _lookup(self.root_fd, tparts)
                if st is None or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    raise UnsafeLayerError(f"hard link {ti.name!r} to {ti.linkname!r} refused")
                sfd = self.open_parent(tparts)
                try:
                    os.link(tparts[-1], base, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                finally:
                    os.close(sfd)
                self.created.add(tuple(parts))
                return  # a hard link shares the target's metadata
            elif ti.ischr() or ti.isblk() or ti.isfifo():
                kind = stat.S_IFCHR if ti.ischr() else stat.S_IFBLK if ti.isblk() else stat.S_IFIFO
                os.mknod(base, kind | 0o600, os.makedev(ti.devmajor, ti.devminor), dir_fd=dfd)
            else:
                raise LayerError(f"unsupported tar entry type {ti.type!r} for {ti.name!r}")
            self._metadata(dfd, base, ti)
            self.created.add(tuple(parts))
        finally:
            os.close(dfd)

    @staticmethod
    def _metadata(dfd: int, base: str, ti: tarfile.TarInfo) -> None:
        xattrs = {
            k[len(PAX_XATTR_PREFIX) :]: v
            for k, v in ti.pax_headers.items()
            if k.startswith(PAX_XATTR_PREFIX)
            # overlayfs's own attributes (redirects, opaque, metacopy) are podgate's to set:
            # from a layer they could make the mounted view read other paths.
            and not k[len(PAX_XATTR_PREFIX) :].startswith(OVERLAY_XATTR_PREFIX)
        }
        os.chown(base, ti.uid, ti.gid, dir_fd=dfd, follow_symlinks=False)
        if ti.issym():
            # Symlinks have no mode; xattrs on them go through /proc to avoid following.
            for k, v in xattrs.items():
                with contextlib.suppress(OSError):
                    os.setxattr(
                        f"/proc/self/fd/{dfd}/{base}",
                        k,
                        v.encode("utf-8", "surrogateescape"),
                        follow_symlinks=False,
                    )
            os.utime(base, ns=(int(ti.mtime * 10**9),) * 2, dir_fd=dfd, follow_symlinks=False)
            return
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if ti.isdir():
            flags |= os.O_DIRECTORY
        elif not ti.isreg():
            flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(base, flags, dir_fd=dfd)
        try:
            if ti.isreg() or ti.isdir():
                # chmod after chown: chown clears setuid/setgid bits.
                os.fchmod(fd, ti.mode & 0o7777)
                for k, v in xattrs.items():
                    with contextlib.suppress(OSError):
                        os.setxattr(fd, k, v.encode("utf-8", "surrogateescape"))
            else:
                os.chmod(f"/proc/self/fd/{fd}", ti.mode & 0o7777)
        finally:
            os.close(fd)
        if not ti.isdir():
            os.utime(base, ns=(int(ti.mtime * 10**9),) * 2, dir_fd=dfd, follow_symlinks=False)

    def finish(self) -> None:
        # Directory mtimes last, deepest first, so creating children does not bump them.
        for parts, mtime in sorted(self.dir_times, key=lambda p: -len(p[0])):
            dfd = self.open_parent(list(parts))
            try:
                os.utime(parts[-1], ns=(mtime * 10**9,) * 2, dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)


def apply_layer(
    src: IO[bytes],
    dest: Path,
    lowers: Sequence[Path],
    max_bytes: int,
    expect_diff_id: str | None = None,
) -> UnpackResult:
    """Unpack the (gzip, zstd or plain) tar `src` into the empty directory `dest`.

    `lowers` are the parent snapshots, topmost first: they are read (never written) to refuse
    symlinked parents and to copy up hard-link targets. On error `dest` is left partly filled;
    the caller discards it.
    """
    root_fd = os.open(dest, _DIR_FLAGS)
    lower_fds: list[int] = []
    try:
        for low in lowers:
            lower_fds.append(os.open(low, _DIR_FLAGS))
        applier = _Applier(root_fd, lower_fds, max_bytes)
        entries = 0
        with _decompressed(src) as plain:
            reader = _CountingReader(plain, max_bytes)
            try:
                with tarfile.open(fileobj=reader, mode="r|") as tf:  # type: ignore[call-overload]
                    for ti in tf:
                        if ti.type in (tarfile.XGLTYPE, tarfile.XHDTYPE):
                            continue
                        applier.entry(ti, tf)
                        entries += 1
            except tarfile.TarError as e:
                raise LayerError(f"bad layer tar: {e}") from e
            except (OSError, EOFError, zstandard.ZstdError) as e:
                if isinstance(e, OSError) and e.errno is not None:
                    raise  # the disk, not the layer (ENOSPC and friends)
                raise LayerError(f"bad layer stream: {e}") from e
            reader.drain()
        applier.finish()
        diff_id = "sha256:" + reader.hash.hexdigest()
        if expect_diff_id is not None and diff_id != expect_diff_id:
            raise WrongDiffIDError(f'wrong diff id calculated on extraction "{diff_id}"')
        return UnpackResult(diff_id, reader.count, entries)
    finally:
        for fd in lower_fds:
            os.close(fd)
        os.close(root_fd)
