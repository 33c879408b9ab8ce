"""Where a forked shim's private memory is: its private dirty pages by mapping.

Starts a helper forker (podgate.linux.forker, as the daemon does) and forks N container shims
from it, each running `sleep` in a runc container (a static busybox in a bundle of its own,
what the pod start bench's image containers go through) or, with `--no-oci`, as an imageless
container the shim execs itself. Once all run, each shim's /proc/PID/smaps is summed by
mapping ([anon]: pymalloc arenas and other anonymous memory, [heap]: the C heap, libpython's
data and bss, the stack, ...); the medians are printed, then the shims' containers are killed
and their exits checked.

    python -m bench.shimmem --shims 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from podgate.linux.forker import Forker
from podgate.linux.shim import ShimReady, ShimSpec, read_exit_file, start_shim

# A container's exit reaching its shim's exit file, seconds.
EXIT_TIMEOUT_SECONDS = 30.0


def smaps_by_mapping(pid: int) -> tuple[dict[str, int], dict[str, int]]:
    """(Private_Dirty KiB by mapping name, the smaps_rollup totals in KiB)."""
    by_mapping: collections.Counter[str] = collections.Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            path = fields[5] if len(fields) > 5 else "[anon]"
            name = path if path.startswith("[") else os.path.basename(path)
        elif fields and fields[0] == "Private_Dirty:":
            by_mapping[name] += int(fields[1])
    rollup = {
        f.split()[0].rstrip(":"): int(f.split()[1])
        for f in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    }
    return dict(by_mapping), rollup


def _bundle(directory: Path, busybox: str) -> None:
    rootfs = directory / "rootfs" / "bin"
    rootfs.mkdir(parents=True)
    shutil.copy(busybox, rootfs / "busybox")
    (rootfs / "sleep").symlink_to("busybox")
    subprocess.run(["runc", "spec"], cwd=directory, check=True)
    config = json.loads((directory / "config.json").read_text())
    config["process"] |= {"args": ["sleep", "1000"], "terminal": False}
    (directory / "config.json").write_text(json.dumps(config))


def _spec(directory: Path, index: int, oci: bool) -> ShimSpec:
    container = directory / f"c{index}"
    container.mkdir()
    spec = ShimSpec(
        container_id=f"shimmem-{os.getpid()}-{index}",
        command=["sleep", "1000"],
        exit_file=str(container / "exit"),
        attach_socket=str(container / "attach.sock"),
        ready_file=str(container / "ready"),
        log_file=str(container / "container.log"),
    )
    if oci:
        busybox = shutil.which("busybox")
        assert busybox is not None
        _bundle(container / "bundle", busybox)
        spec.oci = {
            "binary": shutil.which("runc") or "runc",
            "root": str(directory / "runc"),
            "log": str(container / "runc.log"),
            "bundle": str(container / "bundle"),
            "cgroup": "",
        }
    return spec


async def measure(shims: int, oci: bool) -> dict[str, object]:
    directory = Path(tempfile.mkdtemp(prefix="pgsm", dir="/tmp"))
    forker = Forker(str(directory / "forker.log"))
    readies: list[tuple[ShimSpec, ShimReady]] = []
    try:
        await forker.start()
        for i in range(shims):
            spec = _spec(directory, i, oci)
            readies.append((spec, await start_shim(spec, spawn=forker.spawn)))
        await asyncio.sleep(1.0)  # let the shims settle in their loops
        mappings = [smaps_by_mapping(ready.shim.pid) for _, ready in readies]
        assert forker.pid is not None
        _, forker_rollup = smaps_by_mapping(forker.pid)
    finally:
        for _, ready in readies:
            os.kill(ready.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_TIMEOUT_SECONDS
        pending = [spec for spec, _ in readies]
        while pending and time.monotonic() < deadline:
            pending = [s for s in pending if read_exit_file(s.exit_file) is None]
            await asyncio.sleep(0.05)
        forker.close()
        shutil.rmtree(directory, ignore_errors=True)
    if pending:
        raise RuntimeError(f"{len(pending)} shims wrote no exit file")
    names = sorted({n for by, _ in mappings for n in by})
    return {
        "shims": shims,
        "oci": oci,
        "private_dirty_kib": {
            n: statistics.median(by.get(n, 0) for by, _ in mappings) for n in names
        },
        "rollup_kib": {
            k: statistics.median(r[k] for _, r in mappings)
            for k in ("Pss", "Private_Dirty", "Shared_Dirty", "Rss")
        },
        "forker_kib": {k: forker_rollup[k] for k in ("Pss", "Rss")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shimmem", description=__doc__)
    parser.add_argument("--shims", type=int, default=3)
    parser.add_argument("--no-oci", dest="oci", action="store_false")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.shimmem: needs root (PID namespaces, runc)", file=sys.stderr)
        return 2
    if args.oci and not (shutil.which("runc") and shutil.which("busybox")):
        print("bench.shimmem: needs runc and busybox (or --no-oci)", file=sys.stderr)
        return 2
    result = asyncio.run(measure(args.shims, args.oci))
    roll, forker = result["rollup_kib"], result["forker_kib"]
    assert isinstance(roll, dict) and isinstance(forker, dict)
    path = "runc container" if args.oci else "imageless container"
    print(f"{args.shims} shims forked from one forker ({path}), medians, KiB:")
    print("  " + ", ".join(f"{k} {v:g}" for k, v in roll.items()))
    print(f"  forker: Pss {forker['Pss']}, Rss {forker['Rss']}")
    print("  private dirty by mapping:")
    by_mapping = result["private_dirty_kib"]
    assert isinstance(by_mapping, dict)
    for name, kib in sorted(by_mapping.items(), key=lambda item: -item[1]):
        if kib >= 8:
            print(f"    {kib:8g}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
