"""The images of the sample pods, built on this machine from Debian's busybox-static and
imported into the runtime's image store, so `podgate up` needs no registry.

    localhost/podgate/busybox:latest   busybox with every applet linked in /bin, CMD ["sh"]
    localhost/podgate/hello:latest     the same base layer + /www, busybox httpd on :8080
    localhost/podgate/udp-echo:latest  the same base layer + /bin/udp-echo (demo/udp_echo.py,
                                       x86-64 only), a UDP echo server on :9053

The images share their base layer (one snapshot on disk). The build is deterministic: the
same busybox binary gives the same image IDs, so a restart finds the images present and
builds nothing.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Final

from podgate.demo.udp_echo import UDP_ECHO_ELF
from podgate.images.builder import BuiltImage, build_image, dir_layer, write_oci_layout
from podgate.images.importer import import_archive
from podgate.images.store import ImageRecord, ImageStore
from podgate.images.unpack import WHITEOUT_PREFIX

__all__ = [
    "BUSYBOX_IMAGE",
    "HELLO_IMAGE",
    "SAMPLE_IMAGES",
    "UDP_ECHO_IMAGE",
    "SampleImageError",
    "ensure_sample_images",
]

BUSYBOX_IMAGE: Final = "localhost/podgate/busybox:latest"
HELLO_IMAGE: Final = "localhost/podgate/hello:latest"
UDP_ECHO_IMAGE: Final = "localhost/podgate/udp-echo:latest"
SAMPLE_IMAGES: Final = (BUSYBOX_IMAGE, HELLO_IMAGE, UDP_ECHO_IMAGE)
# Where Debian's busybox-static installs the binary (usr-merged systems have both).
BUSYBOX_PATHS: Final = ("/bin/busybox", "/usr/bin/busybox")
HELLO_PORT: Final = 8080
HELLO_BODY: Final = b"hello from podgate\n"
UDP_ECHO_PORT: Final = 9053
# Listing the applets is instant; more than this means a broken binary (seconds).
LIST_TIMEOUT_SECONDS: Final = 10
_PT_INTERP: Final = 3
_PASSWD: Final = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "www-data:x:33:33:www-data:/var/www:/bin/false\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
_GROUP: Final = "root:x:0:\nwww-data:x:33:\nnogroup:x:65534:\n"
_EPOCH: Final = 1_704_067_200  # fixed mtimes: reproducible layers


class SampleImageError(Exception):
    pass


def _is_static_elf(data: bytes) -> bool:
    """An ELF64 little-endian executable without a program interpreter."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        (p_type,) = struct.unpack_from("<I", data, phoff + i * phentsize)
        if p_type == _PT_INTERP:
            return False
    return True


def find_busybox() -> Path:
    for p in BUSYBOX_PATHS:
        path = Path(p)
        if path.is_file() and _is_static_elf(path.read_bytes()[:65536]):
            return path
    raise SampleImageError(
        "the sample images need a static busybox: install Debian's busybox-static"
    )


def _tree_layer(build: Path) -> bytes:
    for p in [*build.rglob("*"), build]:
        os.utime(p, (_EPOCH, _EPOCH), follow_symlinks=False)
    return dir_layer(build)


def _base_layer(busybox: Path, work: Path) -> bytes:
    root = work / "base"
    (root / "bin").mkdir(parents=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    (root / "bin" / "busybox").chmod(0o755)
    applets = subprocess.run(
        [str(busybox), "--list"],
        capture_output=True,
        text=True,
        check=True,
        timeout=LIST_TIMEOUT_SECONDS,
    ).stdout.split()
    for applet in applets:
        if applet != "busybox" and "/" not in applet and not applet.startswith(WHITEOUT_PREFIX):
            # Hard links, as in the CRI test image: the shell execs /bin/<applet>.
            (root / "bin" / applet).hardlink_to(root / "bin" / "busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(_PASSWD)
    (root / "etc" / "group").write_text(_GROUP)
    for d, mode in (("tmp", 0o1777), ("root", 0o700), ("var/www", 0o755), ("proc", 0o555),
                    ("sys", 0o555), ("dev", 0o755)):  # fmt: skip
        (root / d).mkdir(parents=True)
        (root / d).chmod(mode)
    return _tree_layer(root)


def _hello_layer(work: Path) -> bytes:
    root = work / "hello"
    (root / "www").mkdir(parents=True)
    (root / "www" / "index.html").write_bytes(HELLO_BODY)
    return _tree_layer(root)


def _udp_echo_layer(work: Path) -> bytes:
    root = work / "udp-echo"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "udp-echo").write_bytes(UDP_ECHO_ELF)
    (root / "bin" / "udp-echo").chmod(0o755)
    return _tree_layer(root)


def build_sample_images(busybox: Path | None = None) -> dict[str, BuiltImage]:
    busybox = busybox or find_busybox()
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    with tempfile.TemporaryDirectory(prefix="podgate-samples-") as tmp:
        work = Path(tmp)
        base = _base_layer(busybox, work)
        hello = _hello_layer(work)
        udp_echo = _udp_echo_layer(work)
    shell = build_image([base], {"Cmd": ["sh"], "Env": env}, compression="gzip")
    web = build_image(
        [base, hello],
        {
            "Cmd": ["httpd", "-f", "-v", "-p", str(HELLO_PORT), "-h", "/www"],
            "Env": env,
            "ExposedPorts": {f"{HELLO_PORT}/tcp": {}},
            "WorkingDir": "/www",
        },
        compression="gzip",
    )
    echo = build_image(
        [base, udp_echo],
        {
            "Cmd": ["udp-echo", str(UDP_ECHO_PORT)],
            "Env": env,
            "ExposedPorts": {f"{UDP_ECHO_PORT}/udp": {}},
        },
        compression="gzip",
    )
    return {BUSYBOX_IMAGE: shell, HELLO_IMAGE: web, UDP_ECHO_IMAGE: echo}


def ensure_sample_images(store: ImageStore) -> list[ImageRecord]:
    """Build and import the sample images unless the store already has them."""
    missing = [n for n in SAMPLE_IMAGES if store.get(n) is None]
    if missing:
        built = build_sample_images()
        with tempfile.TemporaryDirectory(prefix="podgate-samples-") as tmp:
            layout = Path(tmp) / "layout"
            write_oci_layout([(built[n], n) for n in missing], layout)
            import_archive(store, layout)
    records = [store.get(n) for n in SAMPLE_IMAGES]
    return [r for r in records if r is not None]
