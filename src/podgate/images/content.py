"""The content store: blobs addressed by their sha256 digest, verified while they are written.

Layout under the root (containerd's, minus the metadata database):

    blobs/sha256/<hex>   committed blobs; a file here always matches its name
    ingest/<hex>         partial downloads, kept so an interrupted transfer resumes

A blob becomes visible only by `BlobWriter.commit()`: the data is hashed as it arrives (and
what a resumed ingest already holds is re-hashed from disk first), the size and digest are
checked, then the file is fsynced, renamed into blobs/ and the directory fsynced. A crash at
any point leaves at worst a partial file under ingest/, never a wrong blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Final

from podgate.files import rename_durably

__all__ = [
    "BlobWriter",
    "ContentError",
    "ContentStore",
    "DigestMismatchError",
    "InvalidDigestError",
    "SizeMismatchError",
    "parse_digest",
]

# Bytes read per call when re-hashing an ingest or copying a blob: large enough to amortise
# syscalls, small enough not to matter for memory.
READ_CHUNK_BYTES: Final = 1 << 20

_DIGEST_RE: Final = re.compile(r"^sha256:([a-f0-9]{64})$")


class ContentError(Exception):
    """A blob could not be stored or read."""


class InvalidDigestError(ContentError, ValueError):
    """Not a `sha256:<64 lowercase hex>` digest (the only algorithm podgate stores)."""


class DigestMismatchError(ContentError):
    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"digest mismatch: expected {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


class SizeMismatchError(ContentError):
    def __init__(self, digest: str, expected: int, actual: int) -> None:
        super().__init__(f"size mismatch for {digest}: expected {expected} bytes, got {actual}")
        self.digest = digest
        self.expected = expected
        self.actual = actual


def parse_digest(digest: str) -> str:
    """Return the hex part of a sha256 digest, or raise InvalidDigestError."""
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidDigestError(f"unsupported or malformed digest {digest!r}")
    return m.group(1)


class BlobWriter:
    """One resumable ingest. Not thread-safe; one writer per digest at a time."""

    def __init__(self, store: ContentStore, digest: str, size: int | None) -> None:
        self._store = store
        self.digest = digest
        self.size = size
        self._hex = parse_digest(digest)
        self.path = store.ingest_dir / self._hex
        self._hash = hashlib.sha256()
        # Re-hash whatever a previous attempt left: the partial is trusted only through its hash.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._file = os.fdopen(fd, "r+b")
        offset = 0
        while chunk := self._file.read(READ_CHUNK_BYTES):
            self._hash.update(chunk)
            offset += len(chunk)
        if size is not None and offset > size:
            # More than the descriptor promises: the partial cannot be right; start over.
            self._file.seek(0)
            self._file.truncate()
            self._hash = hashlib.sha256()
            offset = 0
        self.offset = offset
        self._closed = False

    def write(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise ContentError(f"writer for {self.digest} is closed")
        if self.size is not None and self.offset + len(data) > self.size:
            n = self.offset + len(data)
            self.abort(discard=True)
            raise SizeMismatchError(self.digest, self.size, n)
        self._file.write(data)
        self._hash.update(data)
        self.offset += len(data)

    def commit(self) -> Path:
        """Verify and publish the blob; on any mismatch the partial is deleted."""
        if self._closed:
            raise ContentError(f"writer for {self.digest} is closed")
        if self.size is not None and self.offset != self.size:
            n = self.offset
            self.abort(discard=True)
            raise SizeMismatchError(self.digest, self.size, n)
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self.digest:
            self.abort(discard=True)
            raise DigestMismatchError(self.digest, actual)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._closed = True
        target = self._store.blob_path(self.digest)
        os.chmod(self.path, 0o444)
        rename_durably(self.path, target)
        return target

    def abort(self, discard: bool = False) -> None:
        """Stop writing. The partial is kept for a later resume unless `discard` is set."""
        if not self._closed:
            self._file.close()
            self._closed = True
        if discard:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ContentStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.ingest_dir = self.root / "ingest"
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.ingest_dir.mkdir(parents=True, exist_ok=True)

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / parse_digest(digest)

    def has(self, digest: str) -> bool:
        try:
            return self.blob_path(digest).is_file()
        except InvalidDigestError:
            return False

    def size(self, digest: str) -> int:
        return self.blob_path(digest).stat().st_size

    def read_bytes(self, digest: str, limit: int) -> bytes:
        """Read a small blob (manifest, config) whole; refuse one larger than `limit` bytes."""
        path = self.blob_path(digest)
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ContentError(f"blob {digest} is larger than {limit} bytes")
        return data

    def writer(self, digest: str, size: int | None) -> BlobWriter:
        return BlobWriter(self, digest, size)

    def write_blob(self, data: bytes, digest: str | None = None) -> str:
        """Store `data` in one go (manifests, configs); returns its digest."""
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        digest = digest or actual
        if self.has(digest):
            if digest != actual:
                raise DigestMismatchError(digest, actual)
            return digest
        w = self.writer(digest, len(data))
        w.write(data)
        w.commit()
        return digest

    def delete(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.blob_path(digest))

    def digests(self) -> list[str]:
        return sorted(
            "sha256:" + p.name
            for p in self.blobs_dir.iterdir()
            if _DIGEST_RE.match("sha256:" + p.name)
        )

    def ingests(self) -> list[Path]:
        return sorted(self.ingest_dir.iterdir())

    def clean_ingests(self) -> int:
        """Drop every partial ingest (on start, when no writer runs); returns the count."""
        n = 0
        for p in self.ingests():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
        return n
