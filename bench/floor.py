"""What this machine allows a relay: socat's C relay, plain and over TLS, and the client's check.

`python -m bench.floor [--size 1G] [--runs 3]` moves `size` bytes through a relay on loopback,
each direction, and reports GB/s and the relay's CPU-s/GB (user + system, the kernel's work on
its sockets included):

- `direct`: client to server, no relay (the ceiling of every relayed path here);
- `socat`: `socat -b 262144 TCP-LISTEN TCP` (a relay in C, 256 KiB per read and write);
- `socat-tls`: the same with `OPENSSL-LISTEN` (TLS 1.3 from this interpreter's ssl client):
  the floor of any TLS-terminating relay without kernel TLS.

It also times this interpreter's sha256, what a client checking every byte pays per GB. The
figures bound what podgate's relays can reach on the same machine (see bench/README.md
"What a relay costs here").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import ssl
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

from bench.common import format_size, parse_size
from bench.procs import ProcessSet, run_seconds
from podgate.node.pki import ensure_pki

CHUNK: Final = 1 << 20
SOCAT_BLOCK: Final = 256 * 1024
# How long socat gets to listen; a transfer's bound.
READY_SECONDS: Final = 10.0
TRANSFER_SECONDS: Final = 300.0
PATHS: Final = ("direct", "socat", "socat-tls")


def _listener() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


def _wait_listening(port: int) -> None:
    """Until a socket listens on 127.0.0.1:port (read from /proc: a probe connection would be
    the one connection a non-forking socat serves)."""
    want = f"0100007F:{port:04X}"
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            if any(f[1] == want and f[3] == "0A" for f in (line.split() for line in table)):
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {READY_SECONDS:.0f} s")


def _sink(conn: socket.socket, digest: Any) -> int:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    while n := conn.recv_into(buf):
        digest.update(view[:n])
        total += n
    return total


def _pattern(size: int) -> tuple[bytes, bytes]:
    """The block a sender repeats (cut to `size`) and the sha256 of all `size` bytes, computed
    before the clock starts so that only the receiver's check is timed."""
    block = os.urandom(CHUNK)
    digest = hashlib.sha256()
    for start in range(0, size, CHUNK):
        digest.update(block[: min(CHUNK, size - start)])
    return block, digest.digest()


def _source(conn: socket.socket, size: int, block: bytes) -> None:
    view = memoryview(block)
    sent = 0
    while sent < size:
        take = min(CHUNK, size - sent)
        conn.sendall(view[:take])
        sent += take


def _transfer(
    client: socket.socket, server: socket.socket, size: int, upload: bool
) -> tuple[float, bool]:
    """Move `size` bytes client -> server (upload) or server -> client; seconds and whether
    the receiver's sha256 is the sender's."""
    block, expected = _pattern(size)
    digest = hashlib.sha256()
    sender, receiver = (client, server) if upload else (server, client)
    received: list[int] = []

    def receive() -> None:
        received.append(_sink(receiver, digest))

    thread = threading.Thread(target=receive)
    start = time.perf_counter()
    thread.start()
    _source(sender, size, block)
    sender.shutdown(socket.SHUT_WR)
    thread.join(TRANSFER_SECONDS)
    seconds = time.perf_counter() - start
    return seconds, received == [size] and digest.digest() == expected


def _exited_cpu_seconds(pid: int) -> float:
    """CPU of a child that has exited, read before it is reaped (a reaped one has no /proc)."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    return run_seconds(pid)


def _one(path: str, size: int, upload: bool, procs: ProcessSet, pem: Path) -> dict[str, Any]:
    server_listener = _listener()
    server_port = server_listener.getsockname()[1]
    relay = None
    port = server_port
    if path != "direct":
        front = _listener()
        port = front.getsockname()[1]
        front.close()
        listen = (
            f"OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,cert={pem},verify=0"
            if path == "socat-tls"
            else f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr"
        )
        socat = shutil.which("socat") or "socat"
        relay = procs.start(
            f"{path}-{port}",
            [socat, "-b", str(SOCAT_BLOCK), listen, f"TCP:127.0.0.1:{server_port}"],
        )
        _wait_listening(port)
    client = socket.create_connection(("127.0.0.1", port))
    if path == "socat-tls":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        # socat ends its side without close_notify when the server's side ends.
        ctx.options |= ssl.OP_IGNORE_UNEXPECTED_EOF
        client = ctx.wrap_socket(client)
    server, _ = server_listener.accept()
    server_listener.close()
    cipher = client.cipher() if isinstance(client, ssl.SSLSocket) else None
    before = run_seconds(relay.pid) if relay else 0.0
    seconds, ok = _transfer(client, server, size, upload)
    client.close()
    server.close()
    cpu = (_exited_cpu_seconds(relay.pid) if relay else 0.0) - before
    return {
        "path": path,
        "direction": "upload" if upload else "download",
        "seconds": seconds,
        "bytes": size,
        "ok": ok,
        "relay_cpu_s_per_gb": cpu / (size / 1e9) if relay else None,
        "cipher": cipher[0] if cipher else "",
    }


def sha256_seconds_per_gb(size: int = 256 * CHUNK) -> float:
    """CPU-s/GB of this interpreter's sha256 (a checking client or server pays it per byte)."""
    block = os.urandom(CHUNK)
    digest = hashlib.sha256()
    start = time.process_time()
    for _ in range(size // CHUNK):
        digest.update(block)
    return (time.process_time() - start) / (size / 1e9)


def run_floor(size: int, runs: int, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="podgate-floor-") as tmp, ProcessSet() as procs:
        pki = ensure_pki(Path(tmp) / "pki")
        pem = Path(tmp) / "server.pem"
        pem.write_bytes(pki.server_key.read_bytes() + pki.server_cert.read_bytes())
        for run in range(runs):
            for path in paths:
                for upload in (True, False):
                    rows.append({"run": run, **_one(path, size, upload, procs, pem)})
    return {"size": size, "runs": runs, "sha256_s_per_gb": sha256_seconds_per_gb(), "rows": rows}


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for path in dict.fromkeys(r["path"] for r in data["rows"]):
        for direction in ("upload", "download"):
            rows = [r for r in data["rows"] if r["path"] == path and r["direction"] == direction]
            rates = [r["bytes"] / r["seconds"] / 1e9 for r in rows]
            cpu = [r["relay_cpu_s_per_gb"] for r in rows if r["relay_cpu_s_per_gb"] is not None]
            out.append(
                {
                    "path": path,
                    "direction": direction,
                    "gb_s": statistics.median(rates),
                    "gb_s_min": min(rates),
                    "gb_s_max": max(rates),
                    "relay_cpu_s_per_gb": statistics.median(cpu) if cpu else None,
                    "verified": sum(r["ok"] for r in rows),
                    "runs": len(rows),
                    "cipher": rows[0]["cipher"],
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.floor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"), help="bytes per run")
    parser.add_argument("--runs", type=int, default=3, help="rounds of every path and direction")
    args = parser.parse_args(argv)
    if shutil.which("socat") is None:
        parser.error("socat is not installed (apt-get install socat)")
    data = run_floor(args.size, args.runs)
    print(
        f"{format_size(args.size)} x {args.runs}; "
        f"this interpreter's sha256: {data['sha256_s_per_gb']:.2f} CPU-s/GB"
    )
    print("| path | dir | GB/s (min–max) | relay CPU-s/GB | verified | cipher |")
    print("|---|---|---|---|---|---|")
    for row in summarize(data):
        cpu = row["relay_cpu_s_per_gb"]
        print(
            f"| {row['path']} | {row['direction']} | {row['gb_s']:.2f} "
            f"({row['gb_s_min']:.2f}–{row['gb_s_max']:.2f}) | "
            f"{'–' if cpu is None else f'{cpu:.2f}'} | {row['verified']}/{row['runs']} | "
            f"{row['cipher'] or '–'} |"
        )
    return 0 if all(r["ok"] for r in data["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
