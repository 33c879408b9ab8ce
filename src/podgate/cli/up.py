"""`podgate up`: the runtime, the sample pods and a local Kubernetes API, in one go."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import click

import podgate
from podgate.aio.loop import run, wait_for_signal
from podgate.cli.errors import listen_failure
from podgate.cli.logs import setup_logging
from podgate.cli.node import max_streams_per_user_per_pod_option, stream_idle_timeout_option
from podgate.cli.nri import nri_config, nri_options
from podgate.demo.sample_images import SampleImageError, ensure_sample_images
from podgate.demo.samples import ensure_example, load_example
from podgate.node.cri_client import CriClient, CriPodSource
from podgate.node.gateway import DEFAULT_MAX_FORWARDS_PER_SESSION, GatewayConfig, Limits
from podgate.node.server import running_gateway
from podgate.runtime.api import NotFoundError
from podgate.runtime.daemon import RuntimeConfig, running_runtime
from podgate.runtime.store import state_socket
from podgate.runtime.target import InProcessTarget

log = logging.getLogger(__name__)


def default_examples() -> str:
    # The repository's examples/ beside src/ (an editable install, as `make run` makes).
    path = Path(podgate.__file__).resolve().parents[2] / "examples"
    return str(path) if path.is_dir() else ""


@click.command()
@click.option(
    "--state-dir",
    default="/var/lib/podgate",
    show_default=True,
    help="Where pods, containers, logs, sockets and the kubeconfig are kept.",
)
@click.option("--port", default=6443, show_default=True, help="Loopback port of the API; 0 = any.")
@click.option(
    "--plain-http",
    is_flag=True,
    help="Serve the API over plain HTTP on loopback, still requiring the bearer token of "
    "STATE_DIR/node/kubeconfig-token (the Python client sends it over HTTP; kubectl does not).",
)
@click.option(
    "--examples",
    default=default_examples,
    show_default="the repository's examples/",
    help="Directory of sample pods (*.json) to run; empty for none.",
)
@click.option("--keep-pods", is_flag=True, help="Leave the sample pods running on exit.")
@max_streams_per_user_per_pod_option
@stream_idle_timeout_option
@click.option(
    "--max-forwards-per-session",
    default=DEFAULT_MAX_FORWARDS_PER_SESSION,
    show_default=True,
    type=click.IntRange(min=1),
    help="Connections one port-forward session may carry at once.",
)
@nri_options
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def up(
    state_dir: str,
    port: int,
    plain_http: bool,
    examples: str,
    keep_pods: bool,
    max_streams_per_user_per_pod: int,
    stream_idle_timeout: float,
    max_forwards_per_session: int,
    log_format: str,
    verbose: bool,
    **nri: Any,
) -> None:
    """Start podgate on this machine: the pod runtime with sample pods, and the node gateway
    (HTTPS, client certificates and tokens, policy, audit) for kubectl on loopback.

    Prints `podgate ready ...` once everything serves, then commands to try. Admin
    kubeconfigs are written to STATE_DIR/node/kubeconfig (certificate) and kubeconfig-token.
    SIGTERM or Ctrl-C stops it and removes the sample pods (unless --keep-pods).
    """
    setup_logging(log_format, verbose)
    if os.geteuid() != 0:
        raise click.ClickException("podgate up runs pods in Linux namespaces: run it as root")
    samples = []
    if examples:
        for path in sorted(Path(examples).glob("*.json")):
            try:
                samples.append(load_example(path))
            except ValueError as exc:
                raise click.ClickException(str(exc)) from exc
    config = RuntimeConfig(
        state_dir=state_dir,
        nri=nri_config(**nri, default_socket=state_socket(state_dir, "nri.sock")),
        nri_network=nri["network"] == "nri",
    )
    try:
        limits = Limits(
            max_streams_per_user_per_pod=max_streams_per_user_per_pod,
            max_forwards_per_session=max_forwards_per_session,
        )
        run(_up(config, port, plain_http, samples, keep_pods, limits, stream_idle_timeout))
    except OSError as exc:
        failure = listen_failure(exc, "127.0.0.1", port)
        if failure is None:
            raise
        raise failure from None


async def _up(
    config: RuntimeConfig,
    port: int,
    plain_http: bool,
    samples: list[dict[str, object]],
    keep: bool,
    limits: Limits,
    idle_timeout: float,
) -> None:
    state_dir = config.state_dir
    pod_ids: list[str] = []
    async with running_runtime(config) as running:
        client = CriClient(running.cri_socket)
        # The gateway lists pods and reads logs through CRI, as it would from any runtime,
        # but hands each stream to the runtime here: no loopback SPDY session per stream.
        target = InProcessTarget(running.runtime, running.target)
        source = CriPodSource(client, target, node=os.uname().nodename)
        node_dir = str(Path(state_dir) / "node")
        gateway_config = GatewayConfig(
            state_dir=node_dir,
            cri_socket=running.cri_socket,
            port=port,
            plain_http=plain_http,
            limits=limits,
            idle_timeout=idle_timeout,
        )
        try:
            # The gateway binds first: a busy port fails before any pod starts.
            async with running_gateway(gateway_config, source) as gateway:
                if samples:
                    # The sample pods' images, built from the node's busybox-static: no registry.
                    try:
                        records = await asyncio.to_thread(ensure_sample_images, running.images)
                    except SampleImageError as exc:
                        log.warning("sample images not available: %s", exc)
                    else:
                        names = ", ".join(n for r in records for n in r.repo_tags)
                        log.info("sample images: %s", names)
                for sample in samples:
                    try:
                        pod_ids.append(await ensure_example(running.runtime, sample))
                    except NotFoundError as exc:  # its image could not be built
                        name = sample["pod"]["metadata"]["name"]  # type: ignore[index]
                        log.warning("sample pod %s not started: %s", name, exc)
                credentials = gateway.credentials
                kubeconfig = str(
                    credentials.kubeconfig_token if plain_http else credentials.kubeconfig
                )
                print(
                    f"podgate ready api={gateway.url} kubeconfig={kubeconfig} "
                    f"cri=unix://{running.cri_socket}",
                    flush=True,
                )
                print(
                    "\nTry:\n"
                    f"  export KUBECONFIG={kubeconfig}\n"
                    "  kubectl get pods -o wide\n"
                    "  kubectl exec hello -- hostname\n"
                    "  kubectl logs -f hello\n"
                    "  kubectl port-forward pod/hello 8080:8080 &  curl -s 127.0.0.1:8080\n"
                    "  kubectl attach -it shell   (exit ends the shell; to leave it running,\n"
                    "                              stop kubectl from another terminal)\n",
                    flush=True,
                )
                sig = await wait_for_signal()
                _progress(f"signal {sig}: stopping the gateway")
        finally:
            await target.aclose()
            await client.close()
            if pod_ids and not keep:
                _progress(f"removing {len(pod_ids)} sample pods")
                for pod_id in pod_ids:
                    await asyncio.shield(running.runtime.remove_pod(pod_id))
        _progress("stopping the runtime")
    _progress("stopped")


def _progress(line: str) -> None:
    print(f"podgate: {line}", flush=True)
