"""A minimal container root for tests: Debian's busybox-static with its applets installed as
symlinks, plus /etc/passwd and /etc/group with a few users and groups (imported by module
name; keep the name unique)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

BUSYBOX = "/bin/busybox"
# A dynamically linked ELF names its interpreter within its first page.
ELF_HEAD_BYTES = 4096
PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    "www-data:x:33:33:www-data:/var/www:/bin/false\n"
    "default-user:x:1000:1000::/home/default-user:/bin/sh\n"
)
GROUP = (
    "root:x:0:\n"
    "tty:x:5:\n"
    "www-data:x:33:\n"
    "staff:x:50:\n"
    "default-user:x:1000:default-user\n"
    "predefined:x:50000:default-user\n"
    "nogroup:x:65534:\n"
)


def require_busybox() -> str:
    if not os.path.exists(BUSYBOX):
        pytest.skip("busybox-static is not installed")
    with open(BUSYBOX, "rb") as f:
        head = f.read(ELF_HEAD_BYTES)
    if b"ld-linux" in head or b"ld-musl" in head:  # a program interpreter: dynamically linked
        pytest.skip("busybox-static is not installed (/bin/busybox is dynamically linked)")
    return BUSYBOX


def make_rootfs(path: Path) -> Path:
    """A busybox root at `path` (created)."""
    busybox = require_busybox()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "root"):
        (path / d).mkdir(parents=True, exist_ok=True)
    os.chmod(path / "tmp", 0o1777)
    shutil.copy2(busybox, path / "bin" / "busybox")
    subprocess.run(
        ["chroot", str(path), "/bin/busybox", "--install", "-s"], check=True, capture_output=True
    )
    (path / "etc" / "passwd").write_text(PASSWD)
    (path / "etc" / "group").write_text(GROUP)
    return path
