"""Image pull + unpack from a local registry: podgate against containerd 1.6, same run.

One docker-registry on 127.0.0.1 (plain HTTP) holds a generated multi-layer image of
`--image-size` bytes (default 50 MiB; deterministic, incompressible content in files of
1 MiB, busybox in the base layer). Each run pulls it cold into an empty store:

    podgate     `podgate images pull REF` into a fresh state directory: resolve, download
                (parallel layers), verify, unpack into snapshots, register (a new process:
                interpreter start-up included)
    podgate-cri CRI PullImage on a running `podgate runtime` (what a kubelet does); the
                image is removed (RemoveImage) between runs
    containerd  `ctr -a <private containerd> -n k8s.io images pull --plain-http REF`: the
                same steps; the image and its content are removed (`images rm --sync`)
                between runs

Wall time is from process start to exit (podgate-cri: the call). CPU is user+system seconds:
for podgate the pull process; for podgate-cri the daemon's delta; for containerd the ctr
process plus the containerd daemon's own delta (ctr fetches, the daemon stores and unpacks).
podgate's unpack throughput (uncompressed layer bytes / seconds spent applying layers, summed
per layer while others still download, and registering) comes from its log line.

    python -m bench.images --image-size 50M --runs 3
    python -m bench --images           # the same inside `make bench` (on by default as root)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import format_size, parse_size
from bench.procs import cpu_seconds
from bench.report import REPORT_WIDTH, SectionTables, markdown_tables, print_tables

REPO_ROOT = Path(__file__).resolve().parents[1]
for _support in ("tests/images", "tests/e2e"):
    if str(REPO_ROOT / _support) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _support))

import containerd_support  # noqa: E402
import registry_support  # noqa: E402

DEFAULT_IMAGE_SIZE = 50 * 1024 * 1024
# Layers the generated image is cut into (plus the busybox base layer).
DATA_LAYERS = 5
# Bytes per generated file inside a layer.
FILE_BYTES = 1024 * 1024
# One cold pull of the image on a loaded 2-core machine, seconds.
PULL_TIMEOUT_SECONDS = 600.0
# Removing the image from containerd and collecting its content, seconds.
CLEANUP_TIMEOUT_SECONDS = 120.0
REPO = "bench/pull"
TAG = "v1"
TOOLS = ("podgate", "podgate-cri", "containerd")
# The daemon prints this once its CRI socket serves.
READY_LINE = re.compile(r"^podgate runtime ready cri=unix://(\S+) ", re.MULTILINE)
# Interpreter start, state load and both servers, on a loaded machine.
DAEMON_READY_SECONDS = 60.0
_UNPACK_LINE = re.compile(r"registered \(unpacked in (?P<seconds>[0-9.]+)s\)")

PODGATE_PULL = (sys.executable, "-m", "podgate", "images", "pull")

Progress = Callable[[str], None]


def unavailable() -> str | None:
    """Why the images section cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (containerd and unpacking as owners)"
    if not os.access(registry_support.REGISTRY_BIN, os.X_OK):
        return "docker-registry is not installed"
    tools, why = containerd_support.missing_tools()
    if tools is None:
        return why
    return None


def build_image(size: int) -> tuple[registry_support.BuiltImage, int]:
    """The image and its uncompressed layer bytes (what unpacking writes)."""
    per_layer = max(size // DATA_LAYERS, 1)
    layers: list[dict[str, bytes]] = [{"bin/busybox": registry_support.BUSYBOX.read_bytes()}]
    for i in range(DATA_LAYERS):
        files: dict[str, bytes] = {}
        left, n = per_layer, 0
        while left > 0:
            chunk = min(FILE_BYTES, left)
            files[f"data/layer{i}/file{n:04d}"] = registry_support.noise(f"bench-{i}-{n}", chunk)
            left -= chunk
            n += 1
        layers.append(files)
    image = registry_support.make_image(layers, label="bench")
    tar_bytes = sum(_tar_size(lay) for lay in image.layers)
    return image, tar_bytes


def _tar_size(layer: registry_support.Layer) -> int:
    return len(gzip.decompress(layer.blob))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pull_podgate(ref: str, scratch: Path) -> dict[str, Any]:
    state = scratch / "podgate-state"
    shutil.rmtree(state, ignore_errors=True)
    cpu0 = _children_cpu()
    started = time.monotonic()
    done = subprocess.run(
        [*PODGATE_PULL, "--state-dir", str(state), "--progress", "plain", ref],
        capture_output=True,
        text=True,
        timeout=PULL_TIMEOUT_SECONDS,
        check=False,
    )
    wall = time.monotonic() - started
    cpu = _children_cpu() - cpu0
    row: dict[str, Any] = {"tool": "podgate", "wall": wall, "cpu": cpu, "error": None}
    if done.returncode != 0:
        row["error"] = done.stderr.strip()[-500:]
        return row
    row["image_id"] = done.stdout.strip()
    found = _UNPACK_LINE.search(done.stderr)
    row["unpack_seconds"] = float(found["seconds"]) if found else None
    shutil.rmtree(state, ignore_errors=True)
    return row


def pull_containerd(ctrd: containerd_support.Containerd, ref: str, image_id: str) -> dict[str, Any]:
    ctr = [ctrd.tools.ctr, "-a", str(ctrd.socket), "-n", containerd_support.CRI_NAMESPACE]
    assert ctrd.proc is not None
    daemon_cpu0 = cpu_seconds(ctrd.proc.pid)
    cpu0 = _children_cpu()
    started = time.monotonic()
    done = subprocess.run(
        [*ctr, "images", "pull", "--plain-http", "--snapshotter", ctrd.snapshotter, ref],
        capture_output=True,
        text=True,
        timeout=PULL_TIMEOUT_SECONDS,
        check=False,
    )
    wall = time.monotonic() - started
    cpu = _children_cpu() - cpu0 + cpu_seconds(ctrd.proc.pid) - daemon_cpu0
    row: dict[str, Any] = {"tool": "containerd", "wall": wall, "cpu": cpu, "error": None}
    if done.returncode != 0:
        row["error"] = (done.stderr or done.stdout).strip()[-500:]
    # The CRI plugin names every image in k8s.io by its ID too: both names must go for the
    # content and snapshots to be collected, so the next run is cold.
    subprocess.run(
        [*ctr, "images", "rm", "--sync", ref, image_id],
        capture_output=True,
        timeout=CLEANUP_TIMEOUT_SECONDS,
        check=False,
    )
    return row


class PodgateDaemon:
    """`podgate runtime` on a short state directory, for CRI PullImage runs."""

    def __init__(self, scratch: Path) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        self.state = scratch / "s"
        self.log = scratch / "daemon.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "podgate",
                    "runtime",
                    "--state-dir",
                    str(self.state),
                    "--no-nri",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + DAEMON_READY_SECONDS
        while True:
            found = READY_LINE.search(self.log.read_text(errors="replace"))
            if found:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    "podgate runtime did not start:\n" + self.log.read_text()[-2000:]
                )
            time.sleep(0.05)
        import grpc

        from podgate.cri import api_pb2, api_pb2_grpc

        self.pb = api_pb2
        self.channel = grpc.insecure_channel(f"unix://{found[1]}")
        self.stub = api_pb2_grpc.ImageServiceStub(self.channel)

    def pull(self, ref: str) -> dict[str, Any]:
        import grpc

        cpu0 = cpu_seconds(self.proc.pid)
        seen = len(_UNPACK_LINE.findall(self.log.read_text(errors="replace")))
        started = time.monotonic()
        row: dict[str, Any] = {"tool": "podgate-cri", "error": None}
        try:
            reply = self.stub.PullImage(
                self.pb.PullImageRequest(image=self.pb.ImageSpec(image=ref)),
                timeout=PULL_TIMEOUT_SECONDS,
            )
            row["image_id"] = reply.image_ref
        except grpc.RpcError as exc:
            row["error"] = str(exc)[-500:]
        row["wall"] = time.monotonic() - started
        row["cpu"] = cpu_seconds(self.proc.pid) - cpu0
        unpacks = _UNPACK_LINE.findall(self.log.read_text(errors="replace"))
        row["unpack_seconds"] = float(unpacks[-1]) if len(unpacks) > seen else None
        self.stub.RemoveImage(
            self.pb.RemoveImageRequest(image=self.pb.ImageSpec(image=ref)),
            timeout=CLEANUP_TIMEOUT_SECONDS,
        )
        return row

    def stop(self) -> None:
        with contextlib.suppress(AttributeError):
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def _podgate_daemon(scratch: Path) -> Iterator[PodgateDaemon]:
    daemon = PodgateDaemon(scratch)
    try:
        yield daemon
    finally:
        daemon.stop()


@contextlib.contextmanager
def _containerd() -> Iterator[containerd_support.Containerd]:
    tools, why = containerd_support.missing_tools()
    if tools is None:
        raise RuntimeError(why)
    with containerd_support.private_containerd(tools) as ctrd:
        yield ctrd


def run_images(size: int, runs: int, progress: Progress) -> dict[str, Any]:
    """Every run of both tools, interleaved, and the summary."""
    scratch = Path(tempfile.mkdtemp(prefix="pgi", dir="/tmp"))
    section: dict[str, Any] = {"size": size, "runs": runs, "rows": [], "command": ""}
    try:
        progress(f"images: building a {format_size(size)} image")
        image, tar_bytes = build_image(size)
        section["compressed_bytes"] = sum(len(lay.blob) for lay in image.layers)
        section["unpacked_bytes"] = tar_bytes
        section["layers"] = len(image.layers)
        with registry_support.running_registry(scratch / "registry") as registry:
            registry_support.push_image(registry, REPO, TAG, image)
            ref = f"{registry.host}/{REPO}:{TAG}"
            section["command"] = (
                f"podgate images pull --state-dir DIR {ref}  vs  "
                f"ctr -a SOCK -n k8s.io images pull --plain-http {ref}"
            )
            with _containerd() as ctrd, _podgate_daemon(scratch / "d") as daemon:
                for i in range(runs):
                    for tool in TOOLS:
                        progress(f"images: run {i + 1}/{runs}: {tool}")
                        if tool == "podgate":
                            row = pull_podgate(ref, scratch)
                        elif tool == "podgate-cri":
                            row = daemon.pull(ref)
                        else:
                            row = pull_containerd(ctrd, ref, image.config_digest)
                        pulled = row.get("image_id", image.config_digest)
                        if row["error"] is None and pulled != image.config_digest:
                            row["error"] = f"pulled {pulled}, not {image.config_digest}"
                        row["run"] = i
                        section["rows"].append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    section["summary"] = summarize(section)
    return section


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(section: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    rows = section["rows"]
    by_run: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_run.setdefault(r["run"], {})[r["tool"]] = r
    for tool in TOOLS:
        ok = [r for r in rows if r["tool"] == tool and r["error"] is None]
        ratios = [
            pair[tool]["wall"] / pair["containerd"]["wall"]
            for pair in by_run.values()
            if all(t in pair and pair[t]["error"] is None for t in (tool, "containerd"))
        ]
        unpack = [
            section["unpacked_bytes"] / r["unpack_seconds"] / 1e6
            for r in ok
            if r.get("unpack_seconds")
        ]
        out.append(
            {
                "tool": tool,
                "ok": len(ok),
                "errors": [r["error"] for r in rows if r["tool"] == tool and r["error"]],
                "wall": _spread([r["wall"] for r in ok]),
                "cpu": _spread([r["cpu"] for r in ok]),
                "pull_mbps": _spread([section["compressed_bytes"] / r["wall"] / 1e6 for r in ok]),
                "unpack_mbps": _spread(unpack),
                "wall_vs_containerd": _spread(ratios) if tool != "containerd" else None,
            }
        )
    return out


def _fmt(spread: dict[str, float] | None, digits: int = 2) -> str:
    if spread is None:
        return "–"
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}–{spread['max']:.{digits}f})"


HEADERS = (
    "tool",
    "runs ok",
    "wall s (min–max)",
    "CPU s (min–max)",
    "pull MB/s",
    "unpack MB/s",
    "wall × containerd",
)


def tables(section: dict[str, Any]) -> SectionTables:
    rows = [
        [
            s["tool"],
            f"{s['ok']}/{section['runs']}",
            _fmt(s["wall"]),
            _fmt(s["cpu"]),
            _fmt(s["pull_mbps"], 1),
            _fmt(s["unpack_mbps"], 1),
            _fmt(s["wall_vs_containerd"]),
        ]
        for s in section["summary"]
    ]
    title = (
        f"image pull + unpack, {section['compressed_bytes'] / 1e6:.1f} MB in "
        f"{section['layers']} layers ({section['unpacked_bytes'] / 1e6:.1f} MB unpacked), "
        f"cold, median of {section['runs']} run(s)"
    )
    note = (
        "MB = 10^6 bytes. pull MB/s = compressed bytes / wall time; unpack MB/s = unpacked "
        "bytes / podgate's seconds applying layers and registering. CPU: podgate's pull "
        "process, the podgate daemon (podgate-cri), ctr plus the containerd daemon."
    )
    return [(title, note, HEADERS, rows)]


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"command: {section['command']}"]
    for s in section["summary"]:
        notes += [f"{s['tool']} failed: {e}" for e in s["errors"]]
    return notes


def print_report(section: dict[str, Any], console: Console) -> None:
    print_tables(tables(section), _notes(section), console)


def markdown(section: dict[str, Any]) -> str:
    return markdown_tables(tables(section), _notes(section))


def failed(section: dict[str, Any]) -> bool:
    return any(s["errors"] or not s["ok"] for s in section["summary"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.images", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--image-size", type=parse_size, default=DEFAULT_IMAGE_SIZE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the section as JSON here")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench.images: {why}", file=sys.stderr)
        return 2
    err = Console(stderr=True)
    section = run_images(args.image_size, args.runs, lambda m: err.print(f"[dim]{m}[/dim]"))
    console = Console() if sys.stdout.isatty() else Console(width=REPORT_WIDTH)
    print_report(section, console)
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")
    return 1 if failed(section) else 0


if __name__ == "__main__":
    sys.exit(main())
