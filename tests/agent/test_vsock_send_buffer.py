"""Both ends of a unix dial-back widen their send buffer; other families keep theirs."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from podgate.linux.vsock import UNIX_SEND_BUFFER_BYTES, widen_send_buffer


def _wmem_max() -> int:
    return int(Path("/proc/sys/net/core/wmem_max").read_text())


def test_a_unix_socket_gets_the_wide_send_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        before = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        widen_send_buffer(a)
        after = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    # The kernel doubles what it is asked for; unprivileged, net.core.wmem_max caps the ask.
    allowed = UNIX_SEND_BUFFER_BYTES if os.geteuid() == 0 else _wmem_max()
    assert after == 2 * min(UNIX_SEND_BUFFER_BYTES, allowed)
    assert after > before


def test_a_tcp_socket_keeps_its_send_buffer() -> None:
    with socket.socket() as sock:
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        widen_send_buffer(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
