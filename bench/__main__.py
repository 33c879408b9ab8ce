"""`python -m bench` (`make bench`): port-forward throughput and connection-setup benchmarks.

    make bench
    make bench BENCH_ARGS="--size 256M --runs 5"
    python -m bench --paths direct,podgate-spdy --directions download --conns 0

Prints the tables and writes every run plus the summaries to bench/results/latest.json
(and the tables as Markdown next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from bench import abuse as bench_abuse
from bench import authflood as bench_authflood
from bench import containerd as bench_containerd
from bench import forward as bench_forward
from bench import gateway as bench_gateway
from bench import images as bench_images
from bench import manyforwards as bench_manyforwards
from bench import podstart as bench_podstart
from bench import proxy as bench_proxy
from bench import runtime as bench_runtime
from bench import startup as bench_startup
from bench.common import LOOP_CHOICES, PARTS, format_size, parse_size
from bench.portforward import DIRECTIONS, PATH_NAMES, Options, run_all
from bench.procs import ChildError
from bench.report import REPORT_WIDTH, markdown, path_descriptions, print_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
        return names

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Port-forward benchmarks on loopback. Paths:\n" + path_descriptions(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("1G"),
        help="bytes per run and direction (default 1G; binary units)",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per benchmark (default 3)")
    parser.add_argument(
        "--paths",
        type=_names(PATH_NAMES),
        default=list(PATH_NAMES),
        help="comma-separated subset of the paths (default: all)",
    )
    parser.add_argument(
        "--directions",
        type=_names(DIRECTIONS),
        default=list(DIRECTIONS),
        help="upload, download or both (default)",
    )
    parser.add_argument(
        "--conns",
        type=int,
        default=2000,
        help="new connections per connection run (0: skip; default 2000)",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=200,
        help="new sessions per session run (0: skip; default 200)",
    )
    parser.add_argument(
        "--conn-budget",
        type=float,
        default=20.0,
        help="seconds one connection run may take (default 20)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=120.0,
        help="seconds one throughput run may take (default 120)",
    )
    parser.add_argument(
        "--no-throughput", action="store_true", help="only the connection benchmarks"
    )
    parser.add_argument("--skip-kubectl", action="store_true", help="leave out the kubectl paths")
    parser.add_argument("--skip-socat", action="store_true", help="leave out socat")
    parser.add_argument(
        "--loop",
        choices=LOOP_CHOICES,
        default="podgate",
        help="event loop of the podgate servers and clients (default: podgate's own choice, "
        "uvloop when installed)",
    )
    parser.add_argument("--uvloop", action="store_true", help="same as --loop uvloop")
    parser.add_argument("--kubectl", help="kubectl 1.33 binary (default: next to kubectl)")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="run each podgate server under cProfile, stats written here",
    )
    parser.add_argument(
        "--only",
        type=_names(PARTS),
        default=None,
        help="comma-separated parts to run, every other part off (parts: "
        + ", ".join(PARTS)
        + "; an empty list runs only the loopback paths)",
    )
    parser.add_argument(
        "--runtime",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also port-forward into a real pod through `podgate runtime` (default: on as root)",
    )
    parser.add_argument(
        "--runtime-paths",
        type=_names(bench_runtime.RUNTIME_PATH_NAMES),
        default=list(bench_runtime.RUNTIME_PATH_NAMES),
        help="comma-separated subset of the runtime paths (default: all)",
    )
    parser.add_argument(
        "--containerd",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure containerd 1.6 live against podgate runtime: bulk port-forward, new "
        "connections, new sessions, exec flood (default: on as root)",
    )
    parser.add_argument(
        "--gateway",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run kubectl port-forward and exec floods through `podgate node` into a real "
        "pod (default: on as root, unless --skip-kubectl)",
    )
    parser.add_argument(
        "--gateway-paths",
        type=_names(bench_gateway.GATEWAY_PATH_NAMES),
        default=list(bench_gateway.DEFAULT_GATEWAY_PATHS),
        help="comma-separated gateway port-forward paths (default: all but the demo-* paths)",
    )
    parser.add_argument(
        "--flood-seconds",
        type=float,
        help="how long each exec flood through the gateway writes (default "
        f"{bench_gateway.FLOOD_SECONDS:g} at --size 1G, proportionally less for smaller sizes, "
        f"at least {bench_gateway.MIN_FLOOD_SECONDS:g})",
    )
    parser.add_argument(
        "--forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also compare podgate port-forward with kubectl port-forward through `podgate "
        "node` into a real pod: TCP, connection setup, UDP (default: on as root, unless "
        "--skip-kubectl)",
    )
    parser.add_argument(
        "--forward-paths",
        type=_names(bench_forward.FORWARD_PATH_NAMES),
        default=list(bench_forward.DEFAULT_FORWARD_PATHS),
        help="comma-separated forward paths (default: all but the *-spdy ones)",
    )
    parser.add_argument(
        "--udp-datagrams",
        type=int,
        help="datagrams per UDP run of the forward part, 0 skips (default "
        f"{bench_forward.UDP_DATAGRAMS} at --size 1G, proportionally fewer for smaller sizes)",
    )
    parser.add_argument(
        "--startup-runs",
        type=int,
        default=bench_startup.RUNS,
        help=f"runs of the command start-up timings, 0 skips (default {bench_startup.RUNS})",
    )
    parser.add_argument(
        "--images",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also pull + unpack an image from a local registry: podgate vs containerd 1.6 "
        "(default: on as root)",
    )
    parser.add_argument(
        "--image-size",
        type=parse_size,
        default=bench_images.DEFAULT_IMAGE_SIZE,
        help="bytes of the generated image of the images part (default 50M)",
    )
    parser.add_argument(
        "--podstart",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time pod start and measure per-pod memory: podgate vs containerd 1.6 + "
        "runc, same image (default: on as root)",
    )
    parser.add_argument(
        "--podstart-pods",
        type=int,
        default=bench_podstart.DEFAULT_PODS,
        help=f"pods per runtime in the pod start part (default {bench_podstart.DEFAULT_PODS})",
    )
    parser.add_argument(
        "--authflood",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time kubectl exec through `podgate demo` quiet and during an anonymous "
        "request flood (default: on, unless --skip-kubectl)",
    )
    parser.add_argument(
        "--authflood-seconds",
        type=float,
        default=bench_authflood.FLOOD_SECONDS,
        help=f"length of the anonymous flood (default {bench_authflood.FLOOD_SECONDS:g})",
    )
    parser.add_argument(
        "--pingflood",
        action="store_true",
        help="also time kubectl exec through `podgate up` quiet and while another user floods "
        "SPDY PINGs; the RSS growth over the flood (as root; off by default)",
    )
    parser.add_argument(
        "--pingflood-execs",
        type=int,
        default=bench_abuse.EXECS,
        help=f"kubectl execs per period of the PING flood part (default {bench_abuse.EXECS})",
    )
    parser.add_argument(
        "--soak",
        action="store_true",
        help="also soak `podgate up` with kubectl port-forwards and connection churn beside a "
        "PING flood and a never-reading pod, sha256 per connection (as root; off by default)",
    )
    parser.add_argument(
        "--soak-forwards",
        type=int,
        default=bench_abuse.SOAK_FORWARDS,
        help=f"concurrent kubectl port-forwards of the soak (default {bench_abuse.SOAK_FORWARDS})",
    )
    parser.add_argument(
        "--soak-size",
        type=parse_size,
        default=bench_abuse.SOAK_TOTAL_BYTES,
        help="bytes the soak moves, both directions counted (default 10G)",
    )
    parser.add_argument(
        "--soak-connection-size",
        type=parse_size,
        default=bench_abuse.SOAK_CONNECTION_BYTES,
        help="bytes echoed per soak connection (default 8M)",
    )
    parser.add_argument(
        "--soak-seconds",
        type=float,
        default=bench_abuse.SOAK_SECONDS,
        help=f"time bound of the soak (default {bench_abuse.SOAK_SECONDS:g})",
    )
    parser.add_argument(
        "--manyforwards",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also hold thousands of concurrent forwards to one pod through the gateway, one "
        "kubectl port-forward per user (default: on as root, unless --skip-kubectl)",
    )
    parser.add_argument(
        "--manyforwards-conns",
        type=int,
        default=bench_manyforwards.PER_USER,
        help="connections per user in that part "
        f"(default {bench_manyforwards.PER_USER}, {bench_manyforwards.USERS} users)",
    )
    parser.add_argument(
        "--proxy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure `podgate proxy` in front of a private containerd: unary call latency "
        "and port-forward throughput against containerd's own (default: on as root)",
    )
    parser.add_argument(
        "--proxy-calls",
        type=int,
        default=None,
        help=f"unary calls per method and path (default {bench_proxy.DEFAULT_CALLS} at --size "
        f"1G, proportionally fewer for smaller sizes, at least {bench_proxy.MIN_CALLS})",
    )
    parser.add_argument(
        "--proxy-size",
        type=parse_size,
        default=None,
        help="bytes each way per proxy port-forward run (default 64M, at most --size)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS_DIR / "latest.json",
        help="where to write the results (default bench/results/latest.json)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        help="where to write the tables as Markdown (default: next to --json)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.only is not None:
        for part in PARTS:
            wanted, asked = part in args.only, getattr(args, part)
            if asked is not None and asked != wanted:
                switch = f"--{part}" if asked else f"--no-{part}"
                parser.error(f"{switch} contradicts --only {','.join(args.only)}")
            setattr(args, part, wanted)
    return args


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup of every child


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = [
        p
        for p in args.paths
        if not (args.skip_kubectl and p.startswith("kubectl"))
        and not (args.skip_socat and p == "socat")
    ]
    if "direct" not in paths:
        paths.insert(0, "direct")  # every ratio needs its peer
    options = Options(
        size=args.size,
        runs=args.runs,
        paths=paths,
        directions=args.directions,
        conns=args.conns,
        sessions=args.sessions,
        conn_budget=args.conn_budget,
        run_timeout=args.run_timeout,
        throughput=not args.no_throughput,
        loop="uvloop" if args.uvloop else args.loop,
        kubectl=args.kubectl,
        profile_dir=args.profile_dir,
    )
    console = Console() if sys.stdout.isatty() else Console(width=REPORT_WIDTH)
    err = Console(stderr=True)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    err.print(
        f"bench: {format_size(options.size)} x {options.runs} run(s), paths: {', '.join(paths)}"
    )

    def progress(msg: str) -> None:
        err.print(f"[dim]{msg}[/dim]")

    with_runtime = args.runtime if args.runtime is not None else os.geteuid() == 0
    runtime = None
    # Every gateway path is kubectl: --skip-kubectl leaves the part out unless asked for.
    with_gateway = (
        args.gateway if args.gateway is not None else os.geteuid() == 0 and not args.skip_kubectl
    )
    gateway = None
    with_containerd = args.containerd if args.containerd is not None else os.geteuid() == 0
    versus = None
    with_forward = (
        args.forward if args.forward is not None else os.geteuid() == 0 and not args.skip_kubectl
    )
    forward = None
    startup = None
    with_images = args.images if args.images is not None else os.geteuid() == 0
    images = None
    with_podstart = args.podstart if args.podstart is not None else os.geteuid() == 0
    podstart = None
    with_authflood = args.authflood if args.authflood is not None else not args.skip_kubectl
    authflood = None
    with_manyforwards = (
        args.manyforwards
        if args.manyforwards is not None
        else os.geteuid() == 0 and not args.skip_kubectl
    )
    manyforwards = None
    with_proxy = args.proxy if args.proxy is not None else os.geteuid() == 0
    proxy = None
    abuse: dict[str, Any] = {}
    try:
        if args.startup_runs > 0:
            startup = bench_startup.run_startup(args.startup_runs, progress)
        results = run_all(options, progress=progress)
        if with_runtime and options.throughput:
            runtime = bench_runtime.run_runtime(options, args.runtime_paths, progress)
        if with_containerd:
            flood = args.flood_seconds or bench_gateway.default_flood_seconds(options.size)
            versus = bench_containerd.run_versus(options, progress, flood)
        if with_gateway and options.throughput:
            gateway = bench_gateway.run_gateway(
                options, progress, args.flood_seconds, args.gateway_paths
            )
        if with_forward:
            forward = bench_forward.run_forward(
                options, progress, args.forward_paths, args.udp_datagrams
            )
        if with_images:
            why = bench_images.unavailable()
            if why is None:
                images = bench_images.run_images(args.image_size, options.runs, progress)
            else:
                err.print(f"[yellow]images part skipped: {why}[/yellow]")
        if with_podstart:
            why = bench_podstart.unavailable()
            if why is None:
                podstart = bench_podstart.run_podstart(args.podstart_pods, progress)
            else:
                err.print(f"[yellow]pod start part skipped: {why}[/yellow]")
        if with_authflood:
            authflood = bench_authflood.run_authflood(
                args.kubectl, progress, args.authflood_seconds
            )
        if args.pingflood:
            ping = bench_abuse.run_pingflood(args.kubectl, progress, args.pingflood_execs)
            if ping is not None:
                abuse["pingflood"] = ping
        if args.soak:
            soak = bench_abuse.run_soak(
                args.kubectl,
                progress,
                forwards=args.soak_forwards,
                total=args.soak_size,
                connection_bytes=args.soak_connection_size,
                seconds=args.soak_seconds,
            )
            if soak is not None:
                abuse["soak"] = soak
        if with_manyforwards:
            manyforwards = bench_manyforwards.run_manyforwards(
                args.kubectl, progress, per_user=args.manyforwards_conns
            )
        if with_proxy:
            proxy_size = args.proxy_size or min(bench_proxy.DEFAULT_SIZE, options.size)
            proxy_calls = args.proxy_calls or bench_proxy.default_calls(options.size)
            proxy = bench_proxy.run_proxy(proxy_calls, proxy_size, options.runs, progress)
    except ChildError as exc:
        err.print(f"[red]bench failed: {exc}[/red]")
        return 1
    except KeyboardInterrupt:
        err.print("[red]interrupted; every started process was stopped[/red]")
        return 130
    data = results.as_dict()
    if runtime is not None:
        data["runtime"] = runtime
    if versus is not None:
        data["containerd"] = versus
    if gateway is not None:
        data["gateway"] = gateway
    if forward is not None:
        data["forward"] = forward
    if startup is not None:
        data["startup"] = startup
    if images is not None:
        data["images"] = images
    if podstart is not None:
        data["podstart"] = podstart
    if authflood is not None:
        data["authflood"] = authflood
    if manyforwards is not None:
        data["manyforwards"] = manyforwards
    if proxy is not None:
        data["proxy"] = proxy
    if abuse:
        data["abuse"] = abuse
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    md_path = args.markdown or args.json.with_suffix(".md")
    md_path.write_text(
        markdown(data)
        + ("\n" + bench_runtime.markdown(runtime) if runtime is not None else "")
        + ("\n" + bench_containerd.markdown(versus) if versus is not None else "")
        + ("\n" + bench_gateway.markdown(gateway) if gateway is not None else "")
        + ("\n" + bench_forward.markdown(forward) if forward is not None else "")
        + ("\n" + bench_startup.markdown(startup) if startup is not None else "")
        + ("\n" + bench_images.markdown(images) if images is not None else "")
        + ("\n" + bench_podstart.markdown(podstart) if podstart is not None else "")
        + ("\n" + bench_authflood.markdown(authflood) if authflood is not None else "")
        + ("\n" + bench_manyforwards.markdown(manyforwards) if manyforwards is not None else "")
        + ("\n" + bench_proxy.markdown(proxy) if proxy is not None else "")
        + ("\n" + bench_abuse.markdown(abuse) if abuse else "")
    )
    print_report(data, console)
    if runtime is not None:
        bench_runtime.print_report(runtime, console)
    if versus is not None:
        bench_containerd.print_report(versus, console)
    if gateway is not None:
        bench_gateway.print_report(gateway, console)
    if forward is not None:
        bench_forward.print_report(forward, console)
    if startup is not None:
        bench_startup.print_report(startup, console)
    if images is not None:
        bench_images.print_report(images, console)
    if podstart is not None:
        bench_podstart.print_report(podstart, console)
    if authflood is not None:
        bench_authflood.print_report(authflood, console)
    if manyforwards is not None:
        bench_manyforwards.print_report(manyforwards, console)
    if proxy is not None:
        bench_proxy.print_report(proxy, console)
    if abuse:
        bench_abuse.print_report(abuse, console)
    console.print(f"results: {args.json} and {md_path}")
    failed = [s for s in data["summary"]["throughput"] + data["summary"]["conns"] if s["errors"]]
    if gateway is not None and bench_gateway.failed(gateway):
        return 1
    if versus is not None and bench_containerd.failed(versus):
        return 1
    if forward is not None and bench_forward.failed(forward):
        return 1
    if images is not None and bench_images.failed(images):
        return 1
    if podstart is not None and bench_podstart.failed(podstart):
        return 1
    if authflood is not None and bench_authflood.failed(authflood):
        return 1
    if manyforwards is not None and bench_manyforwards.failed(manyforwards):
        return 1
    if proxy is not None and bench_proxy.failed(proxy):
        return 1
    if abuse and bench_abuse.failed(abuse):
        return 1
    return 1 if failed or (runtime is not None and bench_runtime.failed(runtime)) else 0


if __name__ == "__main__":
    sys.exit(main())
