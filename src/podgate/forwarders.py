"""Forwarders run inside a container to reach one of its ports over their stdio: the probe that
finds one, and the command for each. Shared by the exec backend (through podgate's runtime) and
the gateway's exec forwarder (through any CRI runtime's Exec); plain data, no I/O.
"""

from __future__ import annotations

from typing import Final

# socat's copy buffer: its 8 KiB default costs a wake-up per 8 KiB.
SOCAT_BUFFER_BYTES: Final = 128 * 1024

NO_TOOL: Final = "no port-forward tool in the container: install socat, busybox or python3"

# stdin → 127.0.0.1:PORT (then ::1) → stdout, with half-close both ways.
PYTHON_FORWARDER: Final = r"""
import os, socket, sys, threading
port, err = int(sys.argv[1]), None
for host in ("127.0.0.1", "::1"):
    try:
        conn = socket.create_connection((host, port))
        break
    except OSError as e:
        err = e
else:
    sys.exit(f"connect to localhost:{port}: {err}")
def upload():
    while data := os.read(0, 65536):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
uploader = threading.Thread(target=upload, daemon=True)
uploader.start()
while data := conn.recv(65536):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]
os.close(1)
uploader.join()
"""

# Prints the first forwarder the container has; $1 is the runtime's own interpreter.
PROBE_SCRIPT: Final = r"""
for py in "$1" python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import podgate.agent' >/dev/null 2>&1; then
    echo "podgate $(command -v "$py")"; exit 0
  fi
done
if command -v socat >/dev/null 2>&1; then echo socat; exit 0; fi
if command -v busybox >/dev/null 2>&1 && busybox --list | grep -qx nc; then echo busybox; exit 0; fi
if command -v python3 >/dev/null 2>&1; then echo python3; exit 0; fi
echo none
"""


def forwarder_argv(tool: str, port: int, *, half_close_grace: float) -> list[str]:
    """The command for `tool` as the probe names it ("podgate PATH", "socat", ...).

    `half_close_grace`: how long socat keeps the other direction open after one side ends,
    seconds (the relay's own grace, so both ends agree)."""
    name, _, python = tool.partition(" ")
    if name == "podgate":
        return [python, "-m", "podgate", "agent", "forward", str(port)]
    if name == "socat":
        grace = f"{half_close_grace:g}"
        return ["socat", "-b", str(SOCAT_BUFFER_BYTES), "-t", grace, "-", f"TCP:127.0.0.1:{port}"]
    if name == "busybox":
        return ["busybox", "nc", "127.0.0.1", str(port)]
    if name == "python3":
        return ["python3", "-c", PYTHON_FORWARDER, str(port)]
    raise ValueError(f"unknown forwarder {tool!r}")


def localhost_refused_message(port: int, ipv4: str, ipv6: str) -> str:
    """containerd's netns dial error (trailing space included), said of the sandbox."""
    return f"failed to connect to localhost:{port} inside the sandbox, IPv4: {ipv4} IPv6 {ipv6} "
