"""`podgate runtime`."""

from __future__ import annotations

from typing import Any

import click

from podgate.aio.loop import run
from podgate.cli.logs import setup_logging
from podgate.cli.nri import nri_config, nri_options
from podgate.images.config import ConfigError, FileConfig, load_config
from podgate.runtime.daemon import (
    DEFAULT_STATE_DIR,
    RuntimeConfig,
    parse_backend_options,
    run_daemon,
)
from podgate.runtime.streaming import DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS, InsecureAddressError


@click.command()
@click.option(
    "--state-dir",
    default=DEFAULT_STATE_DIR,
    show_default=True,
    help="Where pods, containers, logs and sockets are kept.",
)
@click.option("--cri-socket", default="", help="CRI unix socket [default: STATE_DIR/cri.sock].")
@click.option(
    "--config",
    "config_file",
    default="",
    metavar="FILE",
    help='TOML settings for images and registries ([images], [registries."HOST"]; see the README).',
)
@click.option(
    "--stream-address",
    default="127.0.0.1",
    show_default=True,
    help="Streaming server address; loopback only (no TLS is configured).",
)
@click.option("--stream-port", default=0, show_default=True, help="Streaming port; 0 = any.")
@click.option("--stream-socket", default="", help="Serve streams on this unix socket instead.")
@click.option(
    "--stream-idle-timeout",
    default=DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS,
    show_default=True,
    help="Seconds without traffic before a stream is closed.",
)
@click.option(
    "--backend",
    "backends",
    multiple=True,
    metavar="HANDLER=NAME[,NAME...]",
    help="Port-forward backends for pods of a runtime handler, tried in order (netns, agent, "
    "exec; HANDLER empty = the default). Default: =netns and sandboxed=agent,exec.",
)
@nri_options
@click.option(
    "--oci-runtime",
    default="runc",
    show_default=True,
    help="OCI runtime binary (runc, or crun) for containers with a root.",
)
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def runtime(
    state_dir: str,
    cri_socket: str,
    config_file: str,
    stream_address: str,
    stream_port: int,
    stream_socket: str,
    stream_idle_timeout: float,
    backends: tuple[str, ...],
    oci_runtime: str,
    log_format: str,
    verbose: bool,
    **nri: Any,
) -> None:
    """Run pods in Linux namespaces behind a CRI gRPC service.

    Pods and containers outlive this process: stop it (SIGTERM) and start it again with the
    same --state-dir, and it finds them. Exec, attach and port-forward URLs it hands out point
    at its streaming server on loopback (or a unix socket) with one-time tokens.
    """
    setup_logging(log_format, verbose)
    try:
        chosen = parse_backend_options(backends)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--backend") from exc
    try:
        file_config = load_config(config_file) if config_file else FileConfig()
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    config = RuntimeConfig(
        state_dir=state_dir,
        cri_socket=cri_socket,
        stream_address=stream_address,
        stream_port=stream_port,
        stream_socket=stream_socket,
        stream_idle_timeout=stream_idle_timeout,
        backends=chosen,
        nri=nri_config(**nri),
        nri_network=nri["network"] == "nri",
        file=file_config,
        oci_runtime=oci_runtime,
    )
    try:
        run(run_daemon(config))
    except InsecureAddressError as exc:
        raise click.UsageError(str(exc)) from exc
