"""`podgate agent serve`: the in-sandbox ttrpc agent for port-forwarding into VM-style sandboxes."""

from __future__ import annotations

import click

from podgate.agent.agent import DEFAULT_HOST, DEFAULT_LISTEN, SHUTDOWN_GRACE_SECONDS, serve
from podgate.aio.errors import StreamError
from podgate.aio.loop import run
from podgate.cli.logs import setup_logging
from podgate.linux.vsock import Address, AddressError, Scheme, parse_address


def _address(value: str, schemes: tuple[Scheme, ...], *, with_port: bool) -> Address:
    try:
        address = parse_address(value)
    except AddressError as exc:
        raise click.BadParameter(str(exc)) from exc
    if address.scheme not in schemes:
        raise click.BadParameter(f"{value}: expected one of {', '.join(schemes)}")
    if address.scheme is not Scheme.UNIX and (address.port is not None) != with_port:
        raise click.BadParameter(f"{value}: {'a port is needed' if with_port else 'takes no port'}")
    return address


@click.command("serve")
@click.option(
    "--listen",
    "listen_address",
    default=DEFAULT_LISTEN,
    show_default=True,
    help="Where the ttrpc API listens: vsock://CID:PORT (CID -1: any) or unix://PATH.",
)
@click.option(
    "--host",
    "host_address",
    default=DEFAULT_HOST,
    show_default=True,
    help="Where forwards dial back to: vsock://CID (AF_VSOCK) or hvsock://UDS (UDS_<port>).",
)
@click.option(
    "--shutdown-grace",
    default=SHUTDOWN_GRACE_SECONDS,
    show_default=True,
    help="Seconds forwards in progress may go on after SIGTERM.",
)
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def serve_command(
    listen_address: str, host_address: str, shutdown_grace: float, log_format: str, verbose: bool
) -> None:
    """Serve PortForward and Health over ttrpc until SIGTERM."""
    listen = _address(listen_address, (Scheme.VSOCK, Scheme.UNIX), with_port=True)
    host = _address(host_address, (Scheme.VSOCK, Scheme.HVSOCK), with_port=False)
    setup_logging(log_format, verbose)
    try:
        run(serve(listen, host, shutdown_grace=shutdown_grace))
    except (OSError, StreamError) as exc:
        raise click.ClickException(f"cannot serve on {listen}: {exc}") from exc
