"""The content store: digests verified while streaming, resumable ingests, atomic publication."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from podgate.images.content import (
    ContentStore,
    DigestMismatchError,
    InvalidDigestError,
    SizeMismatchError,
)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_write_commit_read(tmp_path: Path) -> None:
    store = ContentStore(tmp_path)
    data = os.urandom(3 << 20)
    d = _digest(data)
    assert not store.has(d)
    w = store.writer(d, len(data))
    assert w.offset == 0
    for i in range(0, len(data), 65536):
        w.write(memoryview(data)[i : i + 65536])
    path = w.commit()
    assert path == tmp_path / "blobs" / "sha256" / d.removeprefix("sha256:")
    assert store.has(d)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == d.removeprefix("sha256:")
    assert store.ingests() == []
    assert store.read_bytes(d, len(data)) == data
    with pytest.raises(Exception, match="larger than"):
        store.read_bytes(d, 100)
    store.delete(d)
    assert not store.has(d)


def test_digest_mismatch_refused_nothing_stored(tmp_path: Path) -> None:
    store = ContentStore(tmp_path)
    good = b"the bytes the manifest promised"
    bad = b"the bytes the registry sent!!!!"
    assert len(good) == len(bad)
    w = store.writer(_digest(good), len(good))
    w.write(bad)
    with pytest.raises(DigestMismatchError):
        w.commit()
    assert not store.has(_digest(good))
    assert list(store.blobs_dir.iterdir()) == []
    assert store.ingests() == []


def test_size_mismatch_refused(tmp_path: Path) -> None:
    store = ContentStore(tmp_path)
    data = b"x" * 100
    w = store.writer(_digest(data), 50)
    with pytest.raises(SizeMismatchError):
        w.write(data)
    assert store.ingests() == []
    w = store.writer(_digest(data), 200)
    w.write(data)
    with pytest.raises(SizeMismatchError):
        w.commit()
    assert store.ingests() == [] and list(store.blobs_dir.iterdir()) == []


def test_resume_rehashes_partial(tmp_path: Path) -> None:
    store = ContentStore(tmp_path)
    data = os.urandom(1 << 20)
    d = _digest(data)
    w = store.writer(d, len(data))
    w.write(data[:300_000])
    w.abort()
    assert len(store.ingests()) == 1
    w = store.writer(d, len(data))
    assert w.offset == 300_000
    w.write(data[w.offset :])
    w.commit()
    assert store.read_bytes(d, len(data)) == data


def test_resume_over_corrupted_partial_is_refused(tmp_path: Path) -> None:
    # The partial on disk is re-hashed, not trusted: a flipped byte is caught at commit.
    store = ContentStore(tmp_path)
    data = os.urandom(200_000)
    d = _digest(data)
    w = store.writer(d, len(data))
    w.write(data[:100_000])
    w.abort()
    partial = store.ingests()[0]
    raw = bytearray(partial.read_bytes())
    raw[5] ^= 0xFF
    partial.write_bytes(bytes(raw))
    w = store.writer(d, len(data))
    w.write(data[w.offset :])
    with pytest.raises(DigestMismatchError):
        w.commit()
    assert not store.has(d) and store.ingests() == []


def test_bad_digests(tmp_path: Path) -> None:
    store = ContentStore(tmp_path)
    for bad in ("sha256:../../etc/passwd", "sha512:" + "a" * 128, "sha256:" + "A" * 64, "x"):
        with pytest.raises(InvalidDigestError):
            store.writer(bad, 1)
        assert not store.has(bad)


def test_kill_mid_write_leaves_no_visible_blob(tmp_path: Path) -> None:
    data = os.urandom(4 << 20)
    d = _digest(data)
    (tmp_path / "payload").write_bytes(data)
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from podgate.images.content import ContentStore
        data = Path({str(tmp_path / "payload")!r}).read_bytes()
        w = ContentStore(Path({str(tmp_path / "store")!r})).writer({d!r}, len(data))
        w.write(data[: len(data) // 2])
        w._file.flush()
        print("half", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"half\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    store = ContentStore(tmp_path / "store")
    assert not store.has(d)
    assert list(store.blobs_dir.iterdir()) == []
    # The next attempt resumes from what reached the disk and ends with the right blob.
    w = store.writer(d, len(data))
    assert w.offset == len(data) // 2
    w.write(data[w.offset :])
    w.commit()
    assert store.has(d) and store.ingests() == []
    assert store.clean_ingests() == 0
