"""`podgate proxy`: podgate between the kubelet and an existing CRI runtime."""

from __future__ import annotations

import click

from podgate.aio.loop import run, wait_for_signal
from podgate.cli.logs import setup_logging
from podgate.proxy.config import (
    ConfigError,
    ProxyConfig,
    load_config,
    upstream_socket,
    with_flags,
)
from podgate.proxy.server import CriProxy
from podgate.streaming.tokenserver import InsecureAddressError, check_address


@click.command("proxy")
@click.option("--listen", default=None, help="Unix socket the kubelet connects to.")
@click.option(
    "--upstream",
    default=None,
    help="The runtime's CRI endpoint [default: unix:///run/containerd/containerd.sock].",
)
@click.option("--config", "config_file", default=None, help="TOML configuration file.")
@click.option("--select-all", is_flag=True, help="Answer PortForward for every pod.")
@click.option(
    "--select-runtime-handler",
    "handlers",
    multiple=True,
    help="Answer PortForward for pods of this runtime handler (repeatable).",
)
@click.option(
    "--select-annotation",
    "annotations",
    multiple=True,
    help="Answer PortForward for pods with this annotation, KEY or KEY=VALUE (repeatable).",
)
@click.option(
    "--exec-via-proxy",
    is_flag=True,
    help="Exec/attach URLs through podgate's streaming server too (audited).",
)
@click.option("--stream-address", default=None, help="Streaming server address [127.0.0.1].")
@click.option("--stream-port", type=int, default=None, help="Streaming server port; 0 = any.")
@click.option("--stream-socket", default=None, help="Streaming server on a unix socket instead.")
@click.option(
    "--agent-socket",
    default=None,
    help="podgate's sandbox agent socket, {sandbox_id} replaced: pods that have one "
    "port-forward through it (TCP and UDP).",
)
@click.option(
    "--agent-dialback",
    default=None,
    help="Unix socket prefix the agents dial back to (their --host hvsock://PREFIX) "
    "[default: /run/podgate/agent-dialback].",
)
@click.option(
    "--data-plane",
    type=click.Choice(["relay", "grpc"]),
    default=None,
    help="relay: HTTP/2 frames passed on, only intercepted answers rewritten [default]; "
    "grpc: every call through a gRPC server and client.",
)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="json")
@click.option("-v", "--verbose", is_flag=True)
def proxy(
    listen: str | None,
    upstream: str | None,
    config_file: str | None,
    select_all: bool,
    handlers: tuple[str, ...],
    annotations: tuple[str, ...],
    exec_via_proxy: bool,
    stream_address: str | None,
    stream_port: int | None,
    stream_socket: str | None,
    agent_socket: str | None,
    agent_dialback: str | None,
    data_plane: str | None,
    log_format: str,
    verbose: bool,
) -> None:
    """Serve CRI on --listen, passing every call through to --upstream, and answer PortForward
    for the selected pods through their sandbox agent or the runtime's Exec (a forwarder in
    the pod)."""
    setup_logging(log_format, verbose)
    try:
        config = load_config(config_file) if config_file else ProxyConfig()
        config = with_flags(
            config,
            listen=listen,
            upstream=upstream,
            select_all=select_all,
            runtime_handlers=handlers,
            annotations=annotations,
            exec_via_proxy=exec_via_proxy,
            stream_address=stream_address,
            stream_port=stream_port,
            stream_socket=stream_socket,
            agent_socket=agent_socket,
            agent_dialback=agent_dialback,
            data_plane=data_plane,
        )
        if not config.listen:
            raise ConfigError("no --listen socket (or `listen` in the config file)")
        upstream_socket(config.upstream)
        if not config.stream_socket:
            check_address(config.stream_address, False)
    except (ConfigError, InsecureAddressError) as exc:
        raise click.ClickException(str(exc)) from exc
    if config.select.empty:
        click.echo("warning: no pods selected; every PortForward passes through", err=True)
    run(_serve(config))


async def _serve(config: ProxyConfig) -> None:
    # Made inside the loop: its gRPC channels belong to the loop that creates them.
    cri_proxy = CriProxy(config)
    try:
        await cri_proxy.start()
    except OSError as exc:
        await cri_proxy.stop()
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"podgate proxy ready listen={cri_proxy.config.listen} "
        f"upstream={cri_proxy.config.upstream} streaming={cri_proxy.streaming.base_url}",
        err=True,
    )
    try:
        await wait_for_signal()
    finally:
        await cri_proxy.stop()
