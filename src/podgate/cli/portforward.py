"""`podgate port-forward`: kubectl's port-forward, made to survive."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.live import Live

from podgate.aio.loop import run
from podgate.aio.tasks import cancel_and_wait
from podgate.cli.logs import setup_logging
from podgate.forward.engine import (
    EXIT_CODE_HELP,
    GONE_TIMEOUT_SECONDS,
    EngineOptions,
    ExitCode,
    ListenError,
    TargetForward,
    Transport,
    worst,
)
from podgate.forward.render import (
    LIVE_REFRESH_PER_SECOND,
    JsonRenderer,
    LiveEvents,
    PlainRenderer,
    status_table,
)
from podgate.forward.specs import (
    SpecError,
    TargetSpec,
    check_local_ports,
    load_targets_file,
    parse_addresses,
    parse_port_specs,
    parse_target,
)
from podgate.forward.status import EventKind, ForwardStatus
from podgate.kubeconfig import ApiServer, KubeconfigError, load

F = Callable[..., Any]


def kubeconfig_options(f: F) -> F:
    """--kubeconfig, --context and -n/--namespace, as kubectl spells them."""
    f = click.option(
        "-n",
        "--namespace",
        default=None,
        help="Namespace [default: the context's, else default].",
    )(f)
    f = click.option("--context", default=None, help="Kubeconfig context [default: current].")(f)
    f = click.option(
        "--kubeconfig",
        default=None,
        metavar="FILE",
        help="Kubeconfig file [default: $KUBECONFIG (merged, first wins), else ~/.kube/config].",
    )(f)
    return f


def load_api(kubeconfig: str | None, context: str | None, namespace: str | None) -> ApiServer:
    try:
        return load(kubeconfig, context=context, namespace=namespace)
    except KubeconfigError as exc:
        raise click.ClickException(str(exc)) from exc


def _exit_codes_help() -> str:
    return "\n".join(f"  {int(code)}  {text}" for code, text in EXIT_CODE_HELP)


HELP = f"""Forward local ports to a pod, and keep forwarding.

TARGET is pod/NAME or NAME. Port pairs are kubectl's: 8080:80 (local 8080 to remote 80), 80
(the same port), :80 or 0:80 (a random local port); add /udp for UDP (53/udp).

Unlike kubectl, an error on one connection (refused, reset) ends only that connection; a lost
session (gateway restart, network blip) is made again with backoff while the local ports stay
open, and connections arriving meanwhile wait for it (10 s at most); a pod deleted and created
again under the same name is followed.

The session is the WebSocket tunnel, falling back to SPDY when the server refuses it
(kubectl 1.31+'s choice); --transport picks one.

With -f, targets come from a YAML file (TARGET and port pairs on the command line add one more):

\b
  - pod: web
    ports: ["8080:80", ":9090"]
  - namespace: infra
    pod: dns
    ports: ["5353:53/udp"]

Output: a live table on a terminal, one line per event otherwise, or JSON lines with --json
(fields: event, target, local, remote, protocol, bytes_in, bytes_out, connection, error, time;
events: {", ".join(k.value for k in EventKind)}).

\b
Exit codes (several targets: it runs while one is alive, then exits with the worst):
{_exit_codes_help()}
"""


def parse_targets(
    args: tuple[str, ...], targets_file: str | None, namespace: str | None
) -> list[TargetSpec]:
    targets: list[TargetSpec] = []
    if targets_file:
        targets += load_targets_file(targets_file)
    if args:
        if len(args) < 2:
            raise SpecError(f"no port pair given for {args[0]}: TARGET [LOCAL:]REMOTE...")
        targets.append(TargetSpec(parse_target(args[0]), parse_port_specs(args[1:]), namespace))
    if not targets:
        raise SpecError("nothing to forward: give TARGET and port pairs, or -f FILE")
    check_local_ports(targets)
    return targets


@click.command("port-forward", help=HELP, context_settings={"show_default": True})
@click.argument("args", nargs=-1, metavar="[TARGET [LOCAL:]REMOTE[/udp]...]")
@kubeconfig_options
@click.option(
    "--address",
    "addresses",
    multiple=True,
    metavar="IP",
    help="Local address to listen on (repeatable; localhost = 127.0.0.1 and ::1) "
    "[default: 127.0.0.1].",
)
@click.option(
    "-f",
    "--targets-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML list of targets: {namespace?, pod, ports} (see above).",
)
@click.option(
    "--gone-timeout",
    type=click.FloatRange(min=0),
    default=GONE_TIMEOUT_SECONDS,
    help="Seconds a pod may be missing (404) before its forward gives up; 0 = wait forever.",
)
@click.option(
    "--transport",
    type=click.Choice([t.value for t in Transport]),
    default=Transport.AUTO.value,
    help="auto: WebSocket tunnel, SPDY if refused.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging on stderr.")
@click.pass_context
def port_forward(
    ctx: click.Context,
    args: tuple[str, ...],
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    addresses: tuple[str, ...],
    targets_file: str | None,
    gone_timeout: float,
    transport: str,
    as_json: bool,
    verbose: bool,
) -> None:
    try:
        targets = parse_targets(args, targets_file, namespace)
        listen_on = parse_addresses(addresses)
    except SpecError as exc:
        raise click.UsageError(str(exc)) from exc
    api = load_api(kubeconfig, context, namespace)
    setup_logging("text", verbose)
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
        # Failed UDP flows are reported as events already.
        logging.getLogger("podgate.forward.udp").setLevel(logging.ERROR)
    options = EngineOptions(gone_timeout=gone_timeout, transport=Transport(transport))
    mode = "json" if as_json else ("live" if sys.stdout.isatty() else "plain")
    code = run(_forward(api, targets, listen_on, options, mode))
    ctx.exit(int(code))


def merge(targets: list[TargetSpec], api: ApiServer) -> list[TargetSpec]:
    """One target per pod: entries naming the same pod (after namespace defaults) join."""
    by_pod: dict[tuple[str, str], TargetSpec] = {}
    for target in targets:
        key = (target.namespace or api.namespace, target.pod)
        known = by_pod.get(key)
        ports = (known.ports if known else ()) + target.ports
        by_pod[key] = TargetSpec(target.pod, ports, key[0])
    return list(by_pod.values())


async def _forward(
    api: ApiServer,
    targets: list[TargetSpec],
    addresses: tuple[str, ...],
    options: EngineOptions,
    mode: str,
) -> ExitCode:
    status = ForwardStatus()
    console: Console | None = None
    if mode == "json":
        status.subscribe(JsonRenderer(sys.stdout))
    elif mode == "plain":
        status.subscribe(PlainRenderer(sys.stdout, several=len(targets) > 1))
    else:
        console = Console()
        status.subscribe(LiveEvents(console))
    forwards = [TargetForward(api, t, addresses, status, options) for t in merge(targets, api)]
    codes: list[ExitCode] = []
    listening: list[TargetForward] = []
    for forward in forwards:
        try:
            await forward.listen()
        except ListenError:
            codes.append(ExitCode.LISTEN_FAILED)
        else:
            listening.append(forward)
    if not listening:
        return worst(codes)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    display: asyncio.Task[None] | None = None
    live: Live | None = None
    if console is not None:
        live = Live(status_table(status), console=console, auto_refresh=False)
        live.start()
        display = asyncio.create_task(_refresh(live, status), name="live table")
    running: dict[asyncio.Task[ExitCode], TargetForward] = {
        asyncio.create_task(f.run(), name=f"forward {f.name}"): f for f in listening
    }
    stopper = asyncio.create_task(stop.wait(), name="signals")
    interrupted = False
    try:
        while running:
            done, _ = await asyncio.wait({*running, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                interrupted = True
                break
            for task in running.keys() & done:
                running.pop(task)
                codes.append(task.result())
    finally:
        await cancel_and_wait(stopper, *running)
        for forward in running.values():
            forward.report_stopped()
        if display is not None:
            await cancel_and_wait(display)
        if live is not None:
            live.update(status_table(status), refresh=True)
            live.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return ExitCode.INTERRUPTED if interrupted else worst(codes)


async def _refresh(live: Live, status: ForwardStatus) -> None:
    while True:
        live.update(status_table(status), refresh=True)
        await asyncio.sleep(1 / LIVE_REFRESH_PER_SECOND)
