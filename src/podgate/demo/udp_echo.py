"""A UDP echo server as a tiny static x86-64 Linux executable, for the `udp-echo` sample image.

busybox has no UDP server applet (Debian's `nc` speaks TCP only), so the sample image carries
this program instead of running python3 from the node's filesystem. It is built here from its
machine code, listed instruction by instruction (GNU as, Intel syntax), so the image stays
reproducible and needs no compiler:

    udp-echo PORT     bind 0.0.0.0:PORT, print "udp-echo listening on port PORT", then send
                      every datagram (up to 64 KiB) back to its sender, for ever

Exit status 2: PORT is missing or not in 1..65535; otherwise a failing socket() or bind() exits
with its errno. The receive buffer lives in a separate read-write segment (no W+X mapping).
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = ["ARCHITECTURE", "UDP_ECHO_ELF", "udp_echo_elf"]

ARCHITECTURE: Final = "amd64"
_BASE: Final = 0x400000  # where the code segment is mapped
_BUFFER: Final = 0x410000  # the receive buffer (`mov esi, 0x410000` below)
_BUFFER_BYTES: Final = 0x10000  # 64 KiB, the largest UDP payload
_PAGE: Final = 0x1000
_EHDR_BYTES: Final = 64
_PHDR_BYTES: Final = 56
_PT_LOAD: Final = 1
_PF_X, _PF_W, _PF_R = 1, 2, 4
_EM_X86_64: Final = 62
_ET_EXEC: Final = 2

# Syscalls: 41 socket, 49 bind, 1 write, 45 recvfrom, 44 sendto, 60 exit. At entry the stack
# holds argc, argv[0], argv[1], ...; r14/r15 keep argv[1] and its length, r12 the port in
# network order, r13 the socket; [rsp] is the sockaddr_in, [rsp+24] its length.
_CODE: Final = (
    # _start:
    "488b742410"  # mov rsi, [rsp+16]
    "4885f6"  # test rsi, rsi
    "0f8420010000"  # jz usage
    "4989f6"  # mov r14, rsi
    "31c0"  # xor eax, eax
    # parse:
    "0fb60e"  # movzx ecx, byte ptr [rsi]
    "85c9"  # test ecx, ecx
    "7421"  # jz parsed
    "83e930"  # sub ecx, 48
    "83f909"  # cmp ecx, 9
    "0f8708010000"  # ja usage
    "6bc00a"  # imul eax, eax, 10
    "01c8"  # add eax, ecx
    "3dffff0000"  # cmp eax, 65535
    "0f87f8000000"  # ja usage
    "48ffc6"  # inc rsi
    "ebd8"  # jmp parse
    # parsed:
    "85c0"  # test eax, eax
    "0f84eb000000"  # jz usage
    "4c29f6"  # sub rsi, r14
    "4989f7"  # mov r15, rsi
    "86e0"  # xchg al, ah
    "4189c4"  # mov r12d, eax
    "b829000000"  # mov eax, 41
    "bf02000000"  # mov edi, 2
    "be02000000"  # mov esi, 2
    "31d2"  # xor edx, edx
    "0f05"  # syscall
    "85c0"  # test eax, eax
    "0f88cc000000"  # js fail
    "4189c5"  # mov r13d, eax
    "4883ec20"  # sub rsp, 32
    "31c0"  # xor eax, eax
    "48890424"  # mov [rsp], rax
    "4889442408"  # mov [rsp+8], rax
    "66c704240200"  # mov word ptr [rsp], 2
    "664489642402"  # mov [rsp+2], r12w
    "b831000000"  # mov eax, 49
    "4489ef"  # mov edi, r13d
    "4889e6"  # mov rsi, rsp
    "ba10000000"  # mov edx, 16
    "0f05"  # syscall
    "85c0"  # test eax, eax
    "0f8894000000"  # js fail
    "b801000000"  # mov eax, 1
    "bf01000000"  # mov edi, 1
    "488d358e000000"  # lea rsi, [rip+msg]
    "ba1b000000"  # mov edx, 27
    "0f05"  # syscall
    "b801000000"  # mov eax, 1
    "bf01000000"  # mov edi, 1
    "4c89f6"  # mov rsi, r14
    "4c89fa"  # mov rdx, r15
    "0f05"  # syscall
    "b801000000"  # mov eax, 1
    "bf01000000"  # mov edi, 1
    "488d357f000000"  # lea rsi, [rip+newline]
    "ba01000000"  # mov edx, 1
    "0f05"  # syscall
    # again:
    "c744241810000000"  # mov dword ptr [rsp+24], 16
    "b82d000000"  # mov eax, 45
    "4489ef"  # mov edi, r13d
    "be00004100"  # mov esi, 0x410000
    "ba00000100"  # mov edx, 0x10000
    "4531d2"  # xor r10d, r10d
    "4989e0"  # mov r8, rsp
    "4c8d4c2418"  # lea r9, [rsp+24]
    "0f05"  # syscall
    "4885c0"  # test rax, rax
    "78d4"  # js again
    "4889c2"  # mov rdx, rax
    "b82c000000"  # mov eax, 44
    "4489ef"  # mov edi, r13d
    "be00004100"  # mov esi, 0x410000
    "4531d2"  # xor r10d, r10d
    "4989e0"  # mov r8, rsp
    "448b4c2418"  # mov r9d, [rsp+24]
    "0f05"  # syscall
    "ebb5"  # jmp again
    # usage:
    "bf02000000"  # mov edi, 2
    "eb04"  # jmp leave
    # fail:
    "f7d8"  # neg eax
    "89c7"  # mov edi, eax
    # leave:
    "b83c000000"  # mov eax, 60
    "0f05"  # syscall
)
_MESSAGE: Final = b"udp-echo listening on port \n"  # 27 bytes, then argv[1], then the newline


def udp_echo_elf() -> bytes:
    code = bytes.fromhex("".join(_CODE)) + _MESSAGE
    headers = _EHDR_BYTES + 2 * _PHDR_BYTES
    entry = _BASE + headers
    ehdr = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # ELF64, little-endian, SysV
    ehdr += struct.pack(
        "<HHIQQQIHHHHHH",
        _ET_EXEC, _EM_X86_64, 1, entry, _EHDR_BYTES, 0, 0,
        _EHDR_BYTES, _PHDR_BYTES, 2, 0, 0, 0,
    )  # fmt: skip
    size = headers + len(code)
    text = struct.pack("<IIQQQQQQ", _PT_LOAD, _PF_R | _PF_X, 0, _BASE, _BASE, size, size, _PAGE)
    bss = struct.pack(
        "<IIQQQQQQ", _PT_LOAD, _PF_R | _PF_W, 0, _BUFFER, _BUFFER, 0, _BUFFER_BYTES, _PAGE
    )
    return ehdr + text + bss + code


UDP_ECHO_ELF: Final = udp_echo_elf()
