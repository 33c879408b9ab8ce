"""A pod's waiting PID 1 as a tiny static executable: `pause(2)` for ever, nothing else.

A PID namespace's PID 1 only has to exist; what it is matters for two things. Its memory
(coreutils' `sleep` maps libc: ~0.2 MiB PSS; an interpreter ~5.5 MiB) and its root directory:
the pod's processes see it as /proc/1, so a PID 1 rooted in the node's filesystem hands them
/proc/1/root into it. This program needs no file of the node: it is built here from its machine
code, runs from a memfd and can live in an empty root (podgate.linux.ns.enter_empty_root).

It ignores no signal itself: whoever starts it sets SIGCHLD to SIG_IGN first (exec keeps an
ignored disposition), so the kernel reaps the orphans it inherits; signals without a handler
sent to a namespace's PID 1 are dropped by the kernel, SIGKILL excepted.
"""

from __future__ import annotations

import platform
import struct
from typing import Final

__all__ = ["pause_elf"]

_BASE: Final = 0x400000  # where the one segment is mapped
_EHDR_BYTES: Final = 64
_PHDR_BYTES: Final = 56
_PT_LOAD: Final = 1
_PF_X, _PF_R = 1, 4
_ET_EXEC: Final = 2
_PAGE: Final = 0x1000

# Per machine: ELF e_machine and the code (GNU as listing). Other machines have none, and their
# pods' PID 1 stays `sleep` (podgate.linux.pidone).
_CODE: Final = {
    "x86_64": (
        62,  # EM_X86_64
        "b822000000"  # again: mov eax, 34 (pause)
        "0f05"  # syscall
        "ebf7",  # jmp again
    ),
}


def pause_elf(machine: str | None = None) -> bytes | None:
    """The executable for `machine` (default: this one), None where there is none."""
    entry = _CODE.get(machine or platform.machine())
    if entry is None:
        return None
    e_machine, listing = entry
    code = bytes.fromhex(listing)
    headers = _EHDR_BYTES + _PHDR_BYTES
    size = headers + len(code)
    ehdr = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # ELF64, little-endian, SysV
    ehdr += struct.pack(
        "<HHIQQQIHHHHHH",
        _ET_EXEC, e_machine, 1, _BASE + headers, _EHDR_BYTES, 0, 0,
        _EHDR_BYTES, _PHDR_BYTES, 1, 0, 0, 0,
    )  # fmt: skip
    text = struct.pack("<IIQQQQQQ", _PT_LOAD, _PF_R | _PF_X, 0, _BASE, _BASE, size, size, _PAGE)
    return ehdr + text + code
