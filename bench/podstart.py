"""Pod start and per-pod memory: `podgate runtime` against containerd 1.6 + runc, same run.

Both runtimes get the same image (tests/e2e/containerd_support.py's busybox archive: its
Entrypoint/Cmd is `sleep`; loaded with `podgate images import` and `ctr images import`) and
the same CRI calls for each pod:

    RunPodSandbox + CreateContainer (image by name, no command: the image's) + StartContainer,
    then ContainerStatus until RUNNING

timed from the first call to the RUNNING answer. Pods are started one after another,
alternating the runtimes, and all stay up until every pod has started; then the PSS
(/proc/PID/smaps_rollup) of each runtime's per-pod processes is summed per pod:

    podgate     the container's shim, plus the pod holder (and the process holding its
                namespaces when it is another) if the pod has one: here it has none, its
                namespaces are pinned by bind mounts
    containerd  containerd-shim-runc-v2 plus the sandbox ("pause") process

The container's own process (`sleep`) is the workload and counted for neither. The pods use
the node's network on both sides (containerd has no CNI here), their own PID namespace per
container and a pod IPC namespace. Everything is removed through CRI afterwards.

After them podgate starts sandboxed pods (runtime handler `sandboxed`: one, or
`--sandboxed-pods N`), measured the same way against the median plain pod.

    python -m bench.podstart --pods 20 [--sandboxed-pods N]
    python -m bench --podstart           # the same inside `make bench` (on by default as root)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.images import PodgateDaemon
from bench.report import REPORT_WIDTH, SectionTables, markdown_tables, print_tables

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT / "tests/e2e") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests/e2e"))

import containerd_support  # noqa: E402
import grpc  # noqa: E402

from podgate.cri import api_pb2 as pb  # noqa: E402
from podgate.cri import api_pb2_grpc as pb_grpc  # noqa: E402

DEFAULT_PODS = 20
TOOLS = ("podgate", "containerd")
# One CRI call on a loaded 2-core machine, seconds.
CALL_TIMEOUT_SECONDS = 60.0
# A started container reaching RUNNING, seconds.
RUNNING_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.005
# Importing the small busybox image into podgate's store, seconds.
IMPORT_TIMEOUT_SECONDS = 120.0
NAMESPACE = "bench"
# The runtime handler of podgate's sandboxed pods (the `agent` backend) by default.
SANDBOX_HANDLER = "sandboxed"

Progress = Callable[[str], None]


def unavailable() -> str | None:
    """Why the pod start section cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (namespaces, runc, containerd)"
    tools, why = containerd_support.missing_tools()
    return why if tools is None else None


def namespaces() -> pb.NamespaceOption:
    return pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)


def start_pod(
    rt: pb_grpc.RuntimeServiceStub, name: str, cgroup_parent: str, handler: str = ""
) -> dict[str, Any]:
    """The timed sequence for one pod (of runtime handler `handler`); the row has the ids and
    the seconds."""
    sandbox_config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=NAMESPACE, uid=str(uuid.uuid4())),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=namespaces()),
        ),
    )
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main"),
        image=pb.ImageSpec(image=containerd_support.IMAGE_NAME),
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(namespace_options=namespaces())
        ),
    )
    row: dict[str, Any] = {"error": None, "sandbox": "", "container": ""}
    started = time.monotonic()
    try:
        row["sandbox"] = rt.RunPodSandbox(
            pb.RunPodSandboxRequest(config=sandbox_config, runtime_handler=handler),
            timeout=CALL_TIMEOUT_SECONDS,
        ).pod_sandbox_id
        row["container"] = rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=row["sandbox"], config=config, sandbox_config=sandbox_config
            ),
            timeout=CALL_TIMEOUT_SECONDS,
        ).container_id
        rt.StartContainer(
            pb.StartContainerRequest(container_id=row["container"]), timeout=CALL_TIMEOUT_SECONDS
        )
        deadline = time.monotonic() + RUNNING_TIMEOUT_SECONDS
        while True:
            status = rt.ContainerStatus(
                pb.ContainerStatusRequest(container_id=row["container"]),
                timeout=CALL_TIMEOUT_SECONDS,
            ).status
            if status.state == pb.CONTAINER_RUNNING:
                break
            if status.state == pb.CONTAINER_EXITED or time.monotonic() > deadline:
                raise RuntimeError(f"container is {pb.ContainerState.Name(status.state)}")
            time.sleep(POLL_SECONDS)
    except (grpc.RpcError, RuntimeError) as exc:
        row["error"] = str(exc)[-500:]
    row["seconds"] = time.monotonic() - started
    return row


def pss_kib(pid: int) -> int | None:
    """Proportional set size of one process, KiB (None: it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return None


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _children(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if _ppid(int(entry)) == parent:
                    out.append(int(entry))
    return out


def podgate_pod_pids(state: Path, sandbox: str, container: str) -> dict[str, int]:
    """The container's shim, and the pod's holder processes if it has any (a pod without a
    shared PID namespace has its namespaces pinned by bind mounts, no process)."""
    pod = json.loads((state / "pods" / f"{sandbox}.json").read_text())
    ctr = json.loads((state / "containers" / f"{container}.json").read_text())
    pids = {"shim": ctr["shim"]["pid"]}
    if pod.get("holder"):
        pids["holder"] = pod["holder"]["pid"]
    if pod.get("ns_process") and pod["ns_process"]["pid"] != pod["holder"]["pid"]:
        pids["ns holder"] = pod["ns_process"]["pid"]
    return pids


def _descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        children = _children(todo.pop())
        out += children
        todo += children
    return out


# Helpers by module (`python -m MODULE`) or by `podgate` sub-command; forked helpers keep their
# forker's command line and name themselves (/proc/PID/comm).
_HELPER_ROLES = {"vmm": "muxer", "agent": "agent", "holder": "holder", "podgate-agent": "agent"}


def _helper_name(pid: int) -> str:
    """A helper's role from its name (a forked one) or its command line: the module after `-m`
    (or the `podgate` sub-command)."""
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm.startswith("podgate-"):
            return _HELPER_ROLES.get(comm, comm)
    with contextlib.suppress(OSError, ValueError, IndexError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        module = argv[argv.index("-m") + 1]
        name = argv[argv.index("-m") + 2] if module == "podgate" else module.rsplit(".", 1)[-1]
        return _HELPER_ROLES.get(name, name)
    return "process"


def podgate_sandboxed_pod_pids(state: Path, sandbox: str, container: str) -> dict[str, int]:
    """A sandboxed pod's processes: the container's shim, the sandbox shim and what it runs
    (the agent; a muxer of its own in older trees), the guest holder and the guest's namespace
    process (one process, "guest PID 1", when they are the same); not the container's own
    processes."""
    pod = json.loads((state / "pods" / f"{sandbox}.json").read_text())
    ctr = json.loads((state / "containers" / f"{container}.json").read_text())
    workload = ctr["process"]["pid"]
    excluded = {workload, *_descendants(workload)}
    pids = {"container shim": ctr["shim"]["pid"]}
    extra = pod.get("extra", {})
    roots = [
        (role, extra[key]["pid"])
        for key, role in (
            ("sandbox_shim", "sandbox shim"),
            ("guest_holder", "guest holder"),
            ("guest_ns_process", "guest ns process"),
        )
        if extra.get(key)
    ]
    if extra.get("guest_holder") == extra.get("guest_ns_process"):  # one process, PID 1
        roots = [(r if r == "sandbox shim" else "guest PID 1", p) for r, p in roots]
    for role, pid in roots:
        pids.setdefault(role, pid)
    for _, pid in roots:
        for found in _descendants(pid):
            if found in excluded or found in pids.values():
                continue
            name = _helper_name(found)
            key, n = name, 1
            while key in pids:
                n += 1
                key = f"{name}{n}"
            pids[key] = found
    return pids


def podgate_node_pids(daemon: int) -> dict[str, int]:
    """podgate's per-node helpers beside the daemon: the helper forker (the shims' parent
    interpreter; they share its unchanged pages) and its second stage, the sandbox shims'
    forker (its only child), once a sandboxed pod has started one."""
    for pid in _children(daemon):
        with contextlib.suppress(OSError):
            if b"podgate.linux.forker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                stages = _children(pid)
                return {"helper forker": pid} | ({"sandbox forker": stages[0]} if stages else {})
    return {}


def containerd_pod_pids(
    ctrd: containerd_support.Containerd, rt: pb_grpc.RuntimeServiceStub, container: str
) -> dict[str, int]:
    """The pod's shim and the sandbox process: the shim's children but the container's."""
    status = rt.ContainerStatus(
        pb.ContainerStatusRequest(container_id=container, verbose=True),
        timeout=CALL_TIMEOUT_SECONDS,
    )
    workload = int(json.loads(status.info["info"])["pid"])
    shim = _ppid(workload)
    if shim not in containerd_support._shims_of(ctrd.socket):
        raise RuntimeError(f"the parent of container process {workload} is not a shim")
    pause = [p for p in _children(shim) if p != workload]
    return {"shim": shim, **{f"pause{'' if i == 0 else i}": p for i, p in enumerate(pause)}}


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _remove(rt: pb_grpc.RuntimeServiceStub, sandboxes: list[str]) -> None:
    for sandbox in sandboxes:
        with contextlib.suppress(grpc.RpcError):
            rt.StopPodSandbox(
                pb.StopPodSandboxRequest(pod_sandbox_id=sandbox), timeout=CALL_TIMEOUT_SECONDS
            )
            rt.RemovePodSandbox(
                pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox), timeout=CALL_TIMEOUT_SECONDS
            )


@contextlib.contextmanager
def _runtimes(scratch: Path) -> Iterator[tuple[containerd_support.Containerd, PodgateDaemon]]:
    tools, why = containerd_support.missing_tools()
    if tools is None:
        raise RuntimeError(why)
    archive = scratch / "image.tar"
    containerd_support.write_image_archive(Path(tools.busybox), archive)
    daemon = PodgateDaemon(scratch / "d")
    try:
        subprocess.run(
            [sys.executable, "-m", "podgate", "images", "import", "--state-dir",
             str(daemon.state), str(archive)],
            check=True,
            capture_output=True,
            timeout=IMPORT_TIMEOUT_SECONDS,
        )  # fmt: skip
        with containerd_support.private_containerd(tools) as ctrd:
            yield ctrd, daemon
    finally:
        daemon.stop()


def run_podstart(pods: int, progress: Progress, sandboxed: int = 1) -> dict[str, Any]:
    """Start `pods` pods per runtime (alternating), then `sandboxed` sandboxed pods on podgate,
    measure, remove them; the section."""
    scratch = Path(tempfile.mkdtemp(prefix="pgp", dir="/tmp"))
    section: dict[str, Any] = {"pods": pods, "rows": [], "memory": {t: [] for t in TOOLS}}
    section["sandboxed"] = []
    more = f" --sandboxed-pods {sandboxed}" if sandboxed != 1 else ""
    section["command"] = (
        f"python -m bench.podstart --pods {pods}{more}  (RunPodSandbox + CreateContainer + "
        "StartContainer until RUNNING, image "
        f"{containerd_support.IMAGE_NAME} in both)"
    )
    try:
        with _runtimes(scratch) as (ctrd, daemon):
            podgate_rt = pb_grpc.RuntimeServiceStub(daemon.channel)
            stubs = {"podgate": podgate_rt, "containerd": ctrd.runtime}
            parents = {"podgate": "", "containerd": ctrd.cgroup_parent}
            made: dict[str, list[dict[str, Any]]] = {t: [] for t in TOOLS}
            try:
                for i in range(pods):
                    for tool in TOOLS if i % 2 == 0 else reversed(TOOLS):
                        progress(f"podstart: pod {i + 1}/{pods}: {tool}")
                        row = start_pod(stubs[tool], f"start-{tool}-{i}", parents[tool])
                        row |= {"tool": tool, "run": i}
                        section["rows"].append(row)
                        made[tool].append(row)
                for i in range(sandboxed):
                    progress(f"podstart: sandboxed pod {i + 1}/{sandboxed}: podgate")
                    row = start_pod(podgate_rt, f"start-sandboxed-{i}", "", SANDBOX_HANDLER)
                    row["sandboxed"] = True
                    section["sandboxed"].append(row)
                    if row["sandbox"]:
                        made["podgate"].append(row)
                progress("podstart: measuring PSS")
                for row in made["podgate"]:
                    if row["error"] is None and row.get("sandboxed"):
                        pids = podgate_sandboxed_pod_pids(
                            daemon.state, row["sandbox"], row["container"]
                        )
                        row["memory"] = _pss_sum(pids)
                    elif row["error"] is None:
                        pids = podgate_pod_pids(daemon.state, row["sandbox"], row["container"])
                        section["memory"]["podgate"].append(_pss_sum(pids))
                for row in made["containerd"]:
                    if row["error"] is None:
                        pids = containerd_pod_pids(ctrd, ctrd.runtime, row["container"])
                        section["memory"]["containerd"].append(_pss_sum(pids))
                section["node"] = {
                    f"podgate {role}": pss_kib(pid) or 0
                    for role, pid in podgate_node_pids(daemon.proc.pid).items()
                }
            finally:
                progress("podstart: removing the pods")
                for tool in TOOLS:
                    _remove(stubs[tool], [r["sandbox"] for r in made[tool] if r["sandbox"]])
                ctrd.sandboxes.clear()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    section["summary"] = summarize(section)
    section["sandboxed_summary"] = summarize_sandboxed(section)
    return section


def _pss_sum(pids: dict[str, int]) -> dict[str, Any]:
    values = {role: pss_kib(pid) or 0 for role, pid in pids.items()}
    return {"pids": len(pids), "kib": sum(values.values()), "by_process": values}


def summarize(section: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    medians: dict[str, dict[str, float]] = {}
    for tool in TOOLS:
        rows = [r for r in section["rows"] if r["tool"] == tool]
        ok = [r["seconds"] for r in rows if r["error"] is None]
        memory = [m["kib"] for m in section["memory"][tool]]
        entry: dict[str, Any] = {
            "tool": tool,
            "ok": len(ok),
            "errors": [r["error"] for r in rows if r["error"]],
            "p50": statistics.median(ok) if ok else None,
            "p99": nearest_rank(ok, 0.99) if ok else None,
            "pss_kib": statistics.median(memory) if memory else None,
            "processes": statistics.median([m["pids"] for m in section["memory"][tool]])
            if memory
            else None,
            "by_process": {
                role: statistics.median(
                    m["by_process"].get(role, 0) for m in section["memory"][tool]
                )
                for role in sorted({r for m in section["memory"][tool] for r in m["by_process"]})
            },
        }
        medians[tool] = entry
        out.append(entry)
    base = medians["containerd"]
    for entry in out:
        for key in ("p50", "p99", "pss_kib"):
            mine, theirs = entry[key], base[key]
            entry[f"{key}_ratio"] = mine / theirs if mine is not None and theirs else None
    return out


def summarize_sandboxed(section: dict[str, Any]) -> dict[str, Any] | None:
    """The sandboxed pods (medians) against the median plain pod of the same daemon."""
    rows = section.get("sandboxed") or []
    if not rows:
        return None
    plain = next(s for s in section["summary"] if s["tool"] == "podgate")
    ok = [r for r in rows if r["error"] is None]
    memory = [r["memory"] for r in ok if r.get("memory")]
    kib = statistics.median(m["kib"] for m in memory) if memory else None
    roles = sorted({role for m in memory for role in m["by_process"]})
    return {
        "pods": len(rows),
        "error": next((r["error"] for r in rows if r["error"]), None),
        "seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
        "pss_kib": kib,
        "processes": statistics.median(m["pids"] for m in memory) if memory else None,
        "by_process": {
            role: statistics.median(m["by_process"].get(role, 0) for m in memory) for role in roles
        },
        "plain_pss_kib": plain["pss_kib"],
        "plain_p50": plain["p50"],
        "pss_ratio": kib / plain["pss_kib"] if kib and plain["pss_kib"] else None,
    }


SANDBOXED_HEADERS = ("podgate pod", "start ms", "PSS/pod MiB", "procs/pod", "PSS × plain pod")


def _mib(kib: float | None) -> str:
    return "–" if kib is None else f"{kib / 1024:.1f}"


HEADERS = (
    "runtime",
    "pods ok",
    "start p50 ms",
    "start p99 ms",
    "p50 × containerd",
    "PSS/pod MiB",
    "procs/pod",
    "PSS × containerd",
)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def tables(section: dict[str, Any]) -> SectionTables:
    rows = [
        [
            s["tool"],
            f"{s['ok']}/{section['pods']}",
            _ms(s["p50"]),
            _ms(s["p99"]),
            _ratio(s["p50_ratio"]),
            "–" if s["pss_kib"] is None else f"{s['pss_kib'] / 1024:.1f}",
            "–" if s["processes"] is None else f"{s['processes']:g}",
            _ratio(s["pss_kib_ratio"]),
        ]
        for s in section["summary"]
    ]
    title = f"pod start (sandbox + container until RUNNING), {section['pods']} pods per runtime"
    note = (
        "p99 is the nearest rank (with 20 pods: the slowest). PSS/pod: median over the pods "
        "of the summed PSS of the runtime's per-pod processes, all pods up; podgate: shim (+ "
        "holder when the pod has one), containerd: shim + sandbox (pause) process; the "
        "container's own process is not counted."
    )
    out: SectionTables = [(title, note, HEADERS, rows)]
    sandboxed = section.get("sandboxed_summary")
    if sandboxed is not None:
        plain = next(s for s in section["summary"] if s["tool"] == "podgate")
        count = sandboxed["pods"]
        out.append(
            (
                f"{'one sandboxed pod' if count == 1 else f'{count} sandboxed pods'} (runtime "
                "handler sandboxed, the agent backend) against a plain pod, same daemon",
                "plain: the median of the pods above (start: p50); sandboxed: "
                + ("one pod" if count == 1 else f"the median of {count} pods")
                + " started after them, same image and calls; its processes: the container's "
                "shim, the sandbox shim (the muxer runs in it) and its agent, the guest's PID 1 "
                "(and the guest holder when it is another process); the container's own "
                "process is not counted.",
                SANDBOXED_HEADERS,
                [
                    [
                        "plain",
                        _ms(plain["p50"]),
                        _mib(plain["pss_kib"]),
                        "–" if plain["processes"] is None else f"{plain['processes']:g}",
                        _ratio(1.0 if plain["pss_kib"] else None),
                    ],
                    [
                        "sandboxed",
                        _ms(sandboxed["seconds"]),
                        _mib(sandboxed["pss_kib"]),
                        "–" if sandboxed["processes"] is None else f"{sandboxed['processes']:g}",
                        _ratio(sandboxed["pss_ratio"]),
                    ],
                ],
            )
        )
    return out


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"command: {section['command']}"]
    for s in section["summary"]:
        if s["by_process"]:
            parts = ", ".join(f"{r} {kib / 1024:.1f}" for r, kib in s["by_process"].items())
            notes.append(f"{s['tool']} PSS MiB per process (median): {parts}")
        notes += [f"{s['tool']} failed: {e}" for e in s["errors"]]
    sandboxed = section.get("sandboxed_summary")
    if sandboxed is not None:
        if sandboxed["by_process"]:
            parts = ", ".join(f"{r} {kib / 1024:.1f}" for r, kib in sandboxed["by_process"].items())
            median = " (median)" if sandboxed["pods"] > 1 else ""
            notes.append(f"sandboxed pod PSS MiB per process{median}: {parts}")
        if sandboxed["error"]:
            notes.append(f"sandboxed pod failed: {sandboxed['error']}")
    for role, kib in section.get("node", {}).items():
        sandboxed_only = role.endswith("sandbox forker")
        plain_pods = len(section["memory"]["podgate"])
        pods = max(1, len(section["sandboxed"]) if sandboxed_only else plain_pods)
        kind = "sandboxed pod" if sandboxed_only else "pod"
        notes.append(
            f"{role} (one per node, not in PSS/pod): {kib / 1024:.1f} MiB, "
            f"{kib / 1024 / pods:.2f} MiB per {kind} over {pods} {kind}s"
        )
    return notes


def markdown(section: dict[str, Any]) -> str:
    return markdown_tables(tables(section), _notes(section))


def print_report(section: dict[str, Any], console: Console) -> None:
    print_tables(tables(section), _notes(section), console)


def failed(section: dict[str, Any]) -> bool:
    sandboxed = section.get("sandboxed_summary")
    if sandboxed is not None and (sandboxed["error"] or not sandboxed["pss_kib"]):
        return True
    return any(s["errors"] or not s["ok"] for s in section["summary"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.podstart", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pods", type=int, default=DEFAULT_PODS)
    parser.add_argument(
        "--sandboxed-pods",
        type=int,
        default=1,
        help="sandboxed pods started after the plain ones (default 1)",
    )
    parser.add_argument("--json", type=Path, help="write the section as JSON here")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench.podstart: {why}", file=sys.stderr)
        return 2
    err = Console(stderr=True)
    section = run_podstart(
        args.pods, lambda m: err.print(f"[dim]{m}[/dim]"), sandboxed=args.sandboxed_pods
    )
    console = Console() if sys.stdout.isatty() else Console(width=REPORT_WIDTH)
    print_report(section, console)
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")
    return 1 if failed(section) else 0


if __name__ == "__main__":
    sys.exit(main())
