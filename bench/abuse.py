"""Streams under abuse, through `podgate up` with stock kubectl (issue: "streams under abuse").

Both parts start `podgate up` (runtime and gateway in one process) with one sample pod,
`data`, whose server listens on the pod's loopback: ECHO_PORT echoes until the client's EOF,
STALL_PORT accepts and never reads. Two users: `admin` (the client certificate `podgate up`
writes) runs kubectl; `flooder` (a bearer token added to the token file) runs the flood.

- PING flood (`--pingflood`): `kubectl exec data -- echo <n>` EXECS times one after another,
  quiet (the peer), then again while FLOOD_PROCESSES raw SPDY clients upgrade a port-forward
  request and send nothing but PING frames, reconnecting whenever the gateway ends the session.
  Reported: exec p50/p99 both times, what the flooders met (GOAWAY, or the connection closed),
  and the growth of the process's RSS over the flood.
- Soak (`--soak`): FORWARDS `kubectl port-forward` processes, each with one worker opening
  and closing connections one after another, every connection echoing CONNECTION_BYTES
  checked by sha256, until TOTAL bytes moved (both directions counted); beside them one PING
  flood client and one connection pushing into the never-reading port. Reported: bytes moved
  and lost, rate, and the process's RSS: before, peak, after.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rich.console import Console

from bench.authflood import percentile
from bench.portforward import find_kubectl
from bench.procs import Child, ChildError, ProcessSet, cpu_seconds
from bench.report import SectionTables, markdown_tables, print_tables
from podgate.linux.proc import signal_process
from podgate.model import ProcessRef
from podgate.node.pki import write_kubeconfig

REPO: Final = Path(__file__).resolve().parents[1]
ECHO_PORT: Final = 7000
STALL_PORT: Final = 7004
DATA_SERVER: Final = f"""
import os, signal, socket, threading
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
def echo(c):
    with c:
        while d := c.recv(262144):
            c.sendall(d)
held = []
def serve(port, handler):
    s = socket.create_server(("127.0.0.1", port), backlog=256)
    while True:
        c, _ = s.accept()
        threading.Thread(target=handler, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=({STALL_PORT}, held.append), daemon=True).start()
serve({ECHO_PORT}, echo)
"""
READY_LINE: Final = r"podgate ready api=https://127\.0\.0\.1:(\d+) kubeconfig=(\S+)"
# From starting `podgate up` to its ready line.
UP_READY_SECONDS: Final = 90.0
# After SIGTERM, how long `podgate up` may take to remove its pod (then SIGKILL).
UP_STOP_SECONDS: Final = 60.0
# Bound on one kubectl exec, and on kubectl port-forward getting ready.
KUBECTL_TIMEOUT_SECONDS: Final = 60.0
# The bounds: exec p99 during the flood, RSS growth (flood and soak).
P99_BOUND_SECONDS: Final = 1.0
RSS_BOUND_BYTES: Final = 64 * 1024 * 1024
# RSS is sampled this often while a part runs.
RSS_SAMPLE_SECONDS: Final = 0.2

# PING flood defaults: execs per period, flood client processes, and the bound on how many
# sessions one flood client opens (each is flooded until the gateway ends it).
EXECS: Final = 50
FLOOD_PROCESSES: Final = 2
FLOOD_SESSIONS_MAX: Final = 100_000
# PING frames per write of a flood client (12 bytes each).
PING_BATCH: Final = 512

# Soak defaults.
SOAK_FORWARDS: Final = 64
# kubectl port-forwards per user: under the gateway's cap of one user's streams to one pod
# (DEFAULT_MAX_STREAMS_PER_USER_PER_POD, 32), which a forward's connections count against.
PER_USER: Final = 16
SOAK_TOTAL_BYTES: Final = 10 * 1024**3
SOAK_CONNECTION_BYTES: Final = 8 * 1024 * 1024
# The soak's time bound: it stops (and says so) when this passes before TOTAL was moved.
SOAK_SECONDS: Final = 1800.0
# Chunk a soak connection writes at a time; the echo comes back in pieces of any size.
SOAK_CHUNK_BYTES: Final = 256 * 1024

# One PING flood client: as the user whose token is argv[3], upgrade a port-forward request to
# SPDY/3.1, then write PING frames until the gateway ends the session; again, until the
# deadline, SIGTERM or the session bound. Prints one JSON line of what it met.
FLOOD_CLIENT: Final = r"""
import json, signal, socket, ssl, sys, threading, time
from podgate.proto.spdy import Role, SpdyConnection
from podgate.proto.spdy.events import GoAwayReceived, PingAcknowledged
from podgate.proto.spdy.frames import encode_ping
port, seconds, token, ca, pod, sessions_max, batch = (
    int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
    int(sys.argv[6]), int(sys.argv[7]))
ctx = ssl.create_default_context(cafile=ca)
request = (f"POST /api/v1/namespaces/default/pods/{pod}/portforward HTTP/1.1\r\n"
           f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
           "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
           "X-Stream-Protocol-Version: portforward.k8s.io\r\nContent-Length: 0\r\n\r\n").encode()
pings = b"".join(encode_ping(2 * i + 1) for i in range(batch))
st = dict(sessions=0, upgraded=0, goaway=0, closed=0, open_at_deadline=0, interrupted=0,
          refused=0, pings_sent=0, echoes=0, errors=0)
current = threading.Event()  # the session being flooded ends
deadline = time.monotonic() + seconds
class Stop(Exception):
    pass
def stop(*_):
    raise Stop  # out of a blocked write too
signal.signal(signal.SIGTERM, stop)
def read(s, core, ended):
    try:
        while data := s.recv(1 << 16):
            for e in core.receive_data(data):
                if isinstance(e, GoAwayReceived):
                    st["goaway"] += 1
                    ended.set()
                    return
                st["echoes"] += isinstance(e, PingAcknowledged)
    except Exception:
        pass
    st["closed"] += 1
    ended.set()
def flood():
  while time.monotonic() < deadline and st["sessions"] < sessions_max:
      st["sessions"] += 1
      try:
          with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                               server_hostname="127.0.0.1") as s:
              s.sendall(request)
              head = b""
              while b"\r\n\r\n" not in head:
                  chunk = s.recv(65536)
                  if not chunk:
                      raise ConnectionError("closed before the answer")
                  head += chunk
              head, _, rest = head.partition(b"\r\n\r\n")
              if not head.startswith(b"HTTP/1.1 101"):
                  st["refused"] += 1
                  time.sleep(0.1)
                  continue
              st["upgraded"] += 1
              core = SpdyConnection(Role.CLIENT)
              if rest:
                  core.receive_data(rest)
              global current
              current = ended = threading.Event()
              reader = threading.Thread(target=read, args=(s, core, ended), daemon=True)
              reader.start()
              try:
                  while not ended.is_set() and time.monotonic() < deadline:
                      s.sendall(pings)
                      st["pings_sent"] += batch
              except OSError:
                  pass
              ended.wait(10)
              if not ended.is_set():
                  st["open_at_deadline"] += 1
                  s.shutdown(socket.SHUT_RDWR)
              reader.join(10)
      except (OSError, ssl.SSLError):
          st["errors"] += 1
try:
    current.set()
    flood()
except Stop:
    st["interrupted"] += not current.is_set()  # stopped while its session was flooded
print(json.dumps(st))
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """The peak RSS of one process while a `with` block runs (sampled by a thread)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = rss_bytes(pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_SECONDS):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.peak = max(self.peak, rss_bytes(self.pid))


@dataclass
class Up:
    """A running `podgate up` with the `data` pod, and the flooder's credentials."""

    pid: int
    port: int
    kubeconfig: str  # admin, client certificate
    ca: str
    flooder_token: str
    env: dict[str, str]  # kubectl's: an empty HOME of its own
    root: Path
    log: Path  # what `podgate up` logs

    def warnings(self) -> list[str]:
        """The warning and error lines `podgate up` logged so far (what the report quotes
        when connections failed)."""
        text = self.log.read_text(errors="replace")
        return [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln]

    def user_kubeconfig(self, name: str) -> str:
        """A kubeconfig for one more user (a bearer token, group system:masters): the gateway
        caps one user's streams to one pod, so the soak's forwards are spread over users."""
        token = secrets.token_hex(16)
        with open(self.root / "s" / "node" / "tokens.csv", "a") as f:
            f.write(f'{token},{name},{name},"system:masters"\n')
        path = self.root / f"kubeconfig-{name}"
        write_kubeconfig(
            path, f"https://127.0.0.1:{self.port}", Path(self.ca), user=name, token=token
        )
        return str(path)


def stop_up(up: Child) -> None:
    """SIGTERM and UP_STOP_SECONDS for `podgate up` to remove its pod (the bench's usual 5 s
    are too short after many connections), then SIGKILL."""
    if up.proc.poll() is None:
        up.proc.send_signal(signal.SIGTERM)
        try:
            up.proc.wait(UP_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            up.proc.wait()


def _remove_state(root: Path) -> None:
    """Whatever `podgate up` left under `root` (it was killed, or failed to stop a pod):
    the processes its state records (pid and start time, so a reused pid is never hit),
    those naming the directory, its mounts, then the directory."""
    for kind in ("pods", "containers"):
        for path in sorted((root / "s" / kind).glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                record = json.loads(path.read_text())
                for key in ("process", "shim", "ns_process", "holder"):
                    if record.get(key):
                        signal_process(ProcessRef(**record[key]), signal.SIGKILL)
    mark = str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if mark in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
    mounts = [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{root}/")
    ]
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def running_up(procs: ProcessSet) -> Iterator[Up]:
    root = Path(tempfile.mkdtemp(prefix="pgab", dir="/tmp"))  # short: unix socket paths
    up: Child | None = None
    try:
        examples = root / "ex"
        examples.mkdir()
        spec = {
            "pod": {
                "metadata": {"name": "data", "namespace": "default", "uid": "bench-data"},
                "hostname": "data",
            },
            "containers": [
                {
                    "name": "srv",
                    "ports": [ECHO_PORT, STALL_PORT],
                    "command": ["python3", "-c", DATA_SERVER],
                }
            ],
        }
        (examples / "data.json").write_text(json.dumps(spec))
        state = root / "s"
        argv = [sys.executable, "-m", "podgate", "up", "--state-dir", str(state), "--port", "0"]
        up = procs.start("up", [*argv, "--examples", str(examples), "--no-nri"])
        match = up.wait_for(READY_LINE, timeout=UP_READY_SECONDS)[0]
        node = state / "node"
        token = secrets.token_hex(16)
        with open(node / "tokens.csv", "a") as f:
            f.write(f'{token},flooder,flooder,"system:masters"\n')
        home = root / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECTL_")}
        env["HOME"] = str(home)
        ca = str(node / "pki" / "ca.crt")
        yield Up(up.pid, int(match[1]), match[2], ca, token, env, root, up.err_path)
    finally:
        try:
            if up is not None:
                stop_up(up)
        finally:
            _remove_state(root)


def start_flooders(procs: ProcessSet, up: Up, count: int, seconds: float) -> list[Any]:
    client = procs.workdir / "pingflood.py"
    client.write_text(FLOOD_CLIENT)
    argv = [
        sys.executable, str(client), str(up.port), str(seconds), up.flooder_token, up.ca,
        "data", str(FLOOD_SESSIONS_MAX), str(PING_BATCH),
    ]  # fmt: skip
    return [procs.start(f"pingflood{i}", argv) for i in range(count)]


def flood_results(flooders: list[Any], timeout: float) -> dict[str, int]:
    total: dict[str, int] = {}
    for child in flooders:
        child.proc.wait(timeout)
        lines = [ln for ln in child.out_path.read_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise ChildError(f"flood client printed nothing: {child.stderr_tail()}")
        for key, value in json.loads(lines[-1]).items():
            total[key] = total.get(key, 0) + value
    return total


def exec_loop(kubectl: str, up: Up, count: int) -> tuple[list[float], list[str]]:
    """`kubectl exec data -- echo <i>` `count` times; latencies and what went wrong."""
    latencies: list[float] = []
    failures: list[str] = []
    for i in range(count):
        started = time.monotonic()
        done = subprocess.run(
            [kubectl, "--kubeconfig", up.kubeconfig, "exec", "data", "--", "echo", f"ok {i}"],
            capture_output=True,
            timeout=KUBECTL_TIMEOUT_SECONDS,
            env=up.env,
            check=False,
        )
        latencies.append(time.monotonic() - started)
        if done.returncode != 0 or done.stdout != f"ok {i}\n".encode():
            failures.append(f"exec {i}: rc={done.returncode} {done.stdout[:80]!r} {done.stderr!r}")
    return latencies, failures


def _stats(latencies: list[float], failures: list[str]) -> dict[str, Any]:
    return {
        "n": len(latencies),
        "failures": failures,
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "max": max(latencies),
    }


def run_pingflood(
    kubectl_path: str | None,
    progress: Callable[[str], None],
    execs: int = EXECS,
    flood_processes: int = FLOOD_PROCESSES,
) -> dict[str, Any] | None:
    kubectl = find_kubectl(kubectl_path) or shutil.which("kubectl")
    if kubectl is None:
        progress("pingflood: no kubectl, part skipped")
        return None
    with ProcessSet(cwd=REPO) as procs, running_up(procs) as up:
        exec_loop(kubectl, up, 2)  # warm-up: first session, imports
        progress(f"pingflood: {execs} quiet kubectl execs")
        cpu_before = cpu_seconds(up.pid)
        quiet = _stats(*exec_loop(kubectl, up, execs))
        quiet_cpu = cpu_seconds(up.pid) - cpu_before
        # The flood runs until the exec loop is done (SIGTERM); the deadline only bounds it.
        bound = KUBECTL_TIMEOUT_SECONDS * execs
        progress(f"pingflood: {flood_processes} PING flood clients, {execs} execs beside them")
        cpu_quiet = quiet_cpu
        with RssSampler(up.pid) as rss:
            cpu_before = cpu_seconds(up.pid)
            flooders = start_flooders(procs, up, flood_processes, bound)
            time.sleep(0.5)  # the flood under way before the first exec
            busy = _stats(*exec_loop(kubectl, up, execs))
            cpu_flood = cpu_seconds(up.pid) - cpu_before
            still_flooding = all(f.proc.poll() is None for f in flooders)
            flood_cpu = 0.0
            for f in flooders:
                flood_cpu += f.cpu_seconds()
                f.stop()
            flood = flood_results(flooders, KUBECTL_TIMEOUT_SECONDS)
    growth = rss.peak - rss.start
    return {
        "execs": execs,
        "flood_processes": flood_processes,
        "flood_outlasted_execs": still_flooding,
        "up_cpu_quiet": cpu_quiet,
        "up_cpu_flood": cpu_flood,
        "flood_clients_cpu": flood_cpu,
        "flood": flood,
        "quiet": quiet,
        "busy": busy,
        "p99_ratio": busy["p99"] / quiet["p99"],
        "rss_start": rss.start,
        "rss_peak": rss.peak,
        "rss_growth": growth,
        "bounds": {
            "p99_under_1s": busy["p99"] <= P99_BOUND_SECONDS,
            "rss_under_64mb": growth <= RSS_BOUND_BYTES,
        },
    }


def pingflood_failed(data: dict[str, Any]) -> bool:
    """Correctness and memory are hard; p99 is reported (timing is noisy on a shared host)."""
    return bool(
        data["quiet"]["failures"]
        or data["busy"]["failures"]
        or not data["bounds"]["rss_under_64mb"]
        or data["flood"].get("upgraded", 0) == 0
        or data["flood"].get("open_at_deadline", 0) == data["flood"].get("upgraded", 0)
    )


# --- soak -------------------------------------------------------------------------------------


@dataclass
class Forward:
    proc: subprocess.Popen[bytes]
    port: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_forward(kubectl: str, up: Up, remote: int, kubeconfig: str) -> Forward:
    port = _free_port()
    proc = subprocess.Popen(
        [kubectl, "--kubeconfig", kubeconfig, "port-forward", "pod/data", f"{port}:{remote}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=up.env,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + KUBECTL_TIMEOUT_SECONDS
    line = b""
    while b"Forwarding from" not in line:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise ChildError(f"kubectl port-forward not ready (rc={proc.poll()})")
        line = proc.stdout.readline()
    return Forward(proc, port)


def echo_connection(port: int, size: int) -> tuple[bool, int]:
    """One connection: write `size` random bytes, read the echo back; (same sha256, bytes
    echoed)."""
    sent, got = hashlib.sha256(), hashlib.sha256()
    received = 0
    errors: list[BaseException] = []
    with socket.create_connection(("127.0.0.1", port), timeout=KUBECTL_TIMEOUT_SECONDS) as sock:

        def send() -> None:
            try:
                left = size
                while left > 0:
                    chunk = os.urandom(min(left, SOAK_CHUNK_BYTES))
                    sent.update(chunk)
                    sock.sendall(chunk)
                    left -= len(chunk)
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                errors.append(exc)

        writer = threading.Thread(target=send, daemon=True)
        writer.start()
        try:
            while data := sock.recv(SOAK_CHUNK_BYTES):
                got.update(data)
                received += len(data)
        finally:
            writer.join(KUBECTL_TIMEOUT_SECONDS)
    return not errors and received == size and got.digest() == sent.digest(), received


def _stall_pusher(port: int, stop: threading.Event) -> int:
    """Keep one connection pushing into the never-reading port; bytes the path took."""
    pushed = 0
    chunk = bytes(SOAK_CHUNK_BYTES)
    with socket.create_connection(("127.0.0.1", port), timeout=KUBECTL_TIMEOUT_SECONDS) as sock:
        sock.setblocking(False)
        while not stop.wait(0.05):
            with contextlib.suppress(BlockingIOError):
                pushed += sock.send(chunk)
    return pushed


def run_soak(
    kubectl_path: str | None,
    progress: Callable[[str], None],
    forwards: int = SOAK_FORWARDS,
    total: int = SOAK_TOTAL_BYTES,
    connection_bytes: int = SOAK_CONNECTION_BYTES,
    seconds: float = SOAK_SECONDS,
) -> dict[str, Any] | None:
    kubectl = find_kubectl(kubectl_path) or shutil.which("kubectl")
    if kubectl is None:
        progress("soak: no kubectl, part skipped")
        return None
    # `total` counts both directions: each connection moves twice what it echoes.
    per_connection = min(connection_bytes, max(1, total // (2 * forwards)))
    connections = -(-total // (2 * per_connection))
    lock = threading.Lock()
    tally = {"connections": 0, "bad": 0, "echoed": 0, "errors": 0}
    first_errors: list[str] = []
    with ProcessSet(cwd=REPO) as procs, running_up(procs) as up:
        started: list[Forward] = []
        try:
            progress(f"soak: {forwards} kubectl port-forwards")
            users = [up.user_kubeconfig(f"soak{i}") for i in range(-(-forwards // PER_USER))]
            for i in range(forwards):
                started.append(start_forward(kubectl, up, ECHO_PORT, users[i // PER_USER]))
            stall = start_forward(kubectl, up, STALL_PORT, up.kubeconfig)
            started.append(stall)
            for fw in started[:forwards]:  # warm: every forward's first session made
                echo_connection(fw.port, 1024)
            time.sleep(1.0)
            deadline = time.monotonic() + seconds
            todo = iter(range(connections))

            def worker(fw: Forward) -> None:
                while time.monotonic() < deadline:
                    with lock:
                        if next(todo, None) is None:
                            return
                    try:
                        ok, echoed = echo_connection(fw.port, per_connection)
                    except OSError as exc:
                        ok, echoed = False, 0
                        with lock:
                            tally["errors"] += 1
                            if len(first_errors) < 5:
                                first_errors.append(f"{type(exc).__name__}: {exc}")
                    with lock:
                        tally["connections"] += 1
                        tally["bad"] += not ok
                        tally["echoed"] += echoed

            progress(
                f"soak: {connections} connections of {per_connection >> 20} MiB echoed, "
                "beside a PING flood and a never-reading pod"
            )
            stop = threading.Event()
            with RssSampler(up.pid) as rss, ThreadPoolExecutor(forwards + 1) as pool:
                flooders = start_flooders(procs, up, 1, seconds)
                pusher = pool.submit(_stall_pusher, stall.port, stop)
                began = time.monotonic()
                for _ in pool.map(worker, started[:forwards]):
                    pass
                elapsed = time.monotonic() - began
                stop.set()
                pushed = pusher.result()
                flooders[0].stop()
            time.sleep(2.0)
            rss_after = rss_bytes(up.pid)
            warnings = up.warnings()
        finally:
            for fw in started:
                if fw.proc.poll() is None:
                    fw.proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    fw.proc.wait(10)
                if fw.proc.poll() is None:
                    fw.proc.kill()
                    fw.proc.wait()
                if fw.proc.stdout is not None:
                    fw.proc.stdout.close()
    moved = 2 * tally["echoed"]  # each echoed byte crossed the path both ways
    expected = 2 * per_connection * tally["connections"]
    return {
        "forwards": forwards,
        "connection_bytes": per_connection,
        "connections": tally["connections"],
        "planned_connections": connections,
        "bad_connections": tally["bad"],
        "errors": tally["errors"],
        "first_errors": first_errors,
        "moved_bytes": moved,
        "lost_bytes": expected - moved,
        "seconds": elapsed,
        "rate": moved / elapsed,
        "stalled_pushed": pushed,
        "rss_start": rss.start,
        "rss_peak": rss.peak,
        "rss_after": rss_after,
        "rss_growth": rss.peak - rss.start,
        "bounds": {"rss_under_64mb": rss.peak - rss.start <= RSS_BOUND_BYTES},
        "warnings": len(warnings),
        "first_warnings": warnings[:10],
    }


def soak_failed(data: dict[str, Any]) -> bool:
    return bool(
        data["bad_connections"]
        or data["lost_bytes"]
        or data["connections"] < data["planned_connections"]
        or not data["bounds"]["rss_under_64mb"]
    )


# --- report -----------------------------------------------------------------------------------

MIB: Final = 1024 * 1024


def _tables(data: dict[str, Any]) -> SectionTables:
    tables: SectionTables = []
    ping = data.get("pingflood")
    if ping is not None:
        rows = [
            [
                name,
                str(part["n"]),
                f"{part['p50'] * 1000:.0f}",
                f"{part['p99'] * 1000:.0f}",
                f"{part['max'] * 1000:.0f}",
                f"{part['p99'] / ping['quiet']['p99']:.2f}",
                str(len(part["failures"])),
            ]
            for name, part in (("quiet", ping["quiet"]), ("PING flood", ping["busy"]))
        ]
        f = ping["flood"]
        tables.append(
            (
                "kubectl exec through `podgate up`, quiet and during another user's PING flood",
                "Sequential `kubectl exec data -- echo ok <n>` (process start included); "
                "× quiet = p99 against the quiet period's p99 in the same run.",
                ("period", "n", "p50 ms", "p99 ms", "max ms", "p99 × quiet", "failed"),
                rows,
            )
        )
        tables.append(
            (
                "The PING flood",
                f"{ping['flood_processes']} client processes; sessions upgraded, ended by "
                "GOAWAY / closed / still open when stopped; RSS of `podgate up` in MiB; CPU "
                "seconds of `podgate up` over the quiet and the flood period, and of the clients.",
                ("sessions", "GOAWAY", "closed", "open", "PINGs sent", "echoed",
                 "RSS start", "RSS growth", "CPU quiet", "CPU flood", "clients CPU",
                 "p99 ≤ 1 s", "RSS ≤ 64 MB"),
                [[
                    str(f.get("upgraded", 0)), str(f.get("goaway", 0)), str(f.get("closed", 0)),
                    str(f.get("open_at_deadline", 0)), str(f.get("pings_sent", 0)),
                    str(f.get("echoes", 0)), f"{ping['rss_start'] / MIB:.0f}",
                    f"{ping['rss_growth'] / MIB:.1f}", f"{ping['up_cpu_quiet']:.1f}",
                    f"{ping['up_cpu_flood']:.1f}", f"{ping['flood_clients_cpu']:.1f}",
                    "yes" if ping["bounds"]["p99_under_1s"] else "NO",
                    "yes" if ping["bounds"]["rss_under_64mb"] else "NO",
                ]],
            )
        )  # fmt: skip
    soak = data.get("soak")
    if soak is not None:
        tables.append(
            (
                "Soak: kubectl port-forwards with churn, a PING flood and a never-reading pod",
                "Each connection echoes its bytes, checked by sha256; moved = both directions; "
                "RSS of `podgate up` (runtime and gateway) in MiB.",
                ("forwards", "connections", "MiB each", "moved GiB", "lost bytes", "bad",
                 "s", "MB/s", "RSS start", "peak", "after", "growth ≤ 64 MB"),
                [[
                    str(soak["forwards"]), f"{soak['connections']}/{soak['planned_connections']}",
                    f"{soak['connection_bytes'] / MIB:g}", f"{soak['moved_bytes'] / 1024**3:.2f}",
                    str(soak["lost_bytes"]), str(soak["bad_connections"]),
                    f"{soak['seconds']:.0f}", f"{soak['rate'] / 1e6:.0f}",
                    f"{soak['rss_start'] / MIB:.0f}", f"{soak['rss_peak'] / MIB:.0f}",
                    f"{soak['rss_after'] / MIB:.0f}",
                    "yes" if soak["bounds"]["rss_under_64mb"] else "NO",
                ]],
            )
        )  # fmt: skip
    return tables


def print_report(data: dict[str, Any], console: Console) -> None:
    print_tables(_tables(data), [], console)


def markdown(data: dict[str, Any]) -> str:
    return markdown_tables(_tables(data), [])


def failed(data: dict[str, Any]) -> bool:
    ping, soak = data.get("pingflood"), data.get("soak")
    return (ping is not None and pingflood_failed(ping)) or (soak is not None and soak_failed(soak))
