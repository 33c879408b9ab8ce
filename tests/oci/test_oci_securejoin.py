"""Paths resolved inside a root (openat2 RESOLVE_IN_ROOT and the userspace walk agree)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from podgate.oci import securejoin


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "a" / "b").mkdir(parents=True)
    (r / "a" / "b" / "file").write_text("inside")
    (tmp_path / "secret").write_text("outside")
    (r / "abs").symlink_to("/a/b")
    (r / "up").symlink_to("../../../..")
    (r / "a" / "rel").symlink_to("b/file")
    (r / "escape").symlink_to(str(tmp_path / "secret"))
    (r / "loop").symlink_to("loop")
    return r


@pytest.mark.parametrize(
    ("unsafe", "expected"),
    [
        ("a/b/file", "a/b/file"),
        ("/../../a/b/file", "a/b/file"),
        ("abs/file", "a/b/file"),
        ("up/a/b/file", "a/b/file"),
        ("a/rel", "a/b/file"),
        ("up/secret", "secret"),  # outside names are clamped to the root
        ("missing/../../x", "x"),
        ("", ""),
    ],
)
def test_secure_join(root: Path, unsafe: str, expected: str) -> None:
    assert securejoin.secure_join(str(root), unsafe) == os.path.join(str(root), expected).rstrip(
        "/"
    )


def test_escape_link_stays_inside(root: Path) -> None:
    joined = securejoin.secure_join(str(root), "escape")
    assert joined.startswith(str(root) + os.sep)
    with pytest.raises(FileNotFoundError):
        securejoin.read_in_root(str(root), "escape", 100)


def test_loop(root: Path) -> None:
    with pytest.raises(OSError) as info:
        securejoin.secure_join(str(root), "loop/x")
    assert info.value.errno == errno.ELOOP


@pytest.mark.parametrize("use_openat2", [True, False])
def test_read_in_root(root: Path, use_openat2: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if use_openat2 and not securejoin.has_openat2():
        pytest.skip("no openat2 (kernel older than 5.6)")
    monkeypatch.setattr(securejoin, "has_openat2", lambda: use_openat2)
    for path in ("a/b/file", "abs/file", "up/a/b/file", "/a/rel"):
        assert securejoin.read_in_root(str(root), path, 100) == b"inside"
    with pytest.raises(OSError):
        securejoin.read_in_root(str(root), "up/secret", 100)
