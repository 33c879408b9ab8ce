"""The one atomic-write helper: whole files, permissions from the start, durable names."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from podgate import files
from podgate.files import atomic_write

SRC = Path(__file__).resolve().parents[1] / "src" / "podgate"


def test_replaces_whole_with_mode_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"old")
    atomic_write(path, b"new contents", mode=0o640)
    assert path.read_bytes() == b"new contents"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]


def test_create_once_keeps_the_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "lease"
    atomic_write(path, b"first", replace=False)
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", replace=False)
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease"]


def test_file_then_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    atomic_write(tmp_path / "x", b"data")
    assert synced == ["file", "dir"]


def test_no_other_module_renames_files_into_place() -> None:
    """Every atomic write goes through podgate.files (so none forgets the directory fsync)."""
    pattern = re.compile(r"\bos\.(replace|rename)\(|\.rename\(|\bos\.link\(")
    # Not atomic writes: a layer's hardlink entries are links between files being unpacked.
    not_writes = {"images/unpack.py"}
    offenders = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if path.name != "files.py"
        and "_pb2" not in path.name
        and str(path.relative_to(SRC)) not in not_writes
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
