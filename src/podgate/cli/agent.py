"""`podgate agent`: the in-sandbox side of port-forwarding into VM-style sandboxes.

`podgate agent forward` runs once per forwarded connection inside a pod, so this module and
that command import almost nothing; `serve` loads the ttrpc server on first use.
"""

from __future__ import annotations

import sys

import click

from podgate.cli.lazy import LazyGroup

SUBCOMMANDS = {
    "serve": (
        "podgate.cli.agent_serve",
        "serve_command",
        "Serve PortForward and Health over ttrpc until SIGTERM.",
    ),
}


@click.group(
    cls=LazyGroup, lazy=SUBCOMMANDS, context_settings={"help_option_names": ["-h", "--help"]}
)
def agent() -> None:
    """The agent that runs inside a sandbox and forwards ports by dialing back to the host."""


@agent.command("forward")
@click.argument("port", type=click.IntRange(1, 65535))
def forward_command(port: int) -> None:
    """Copy stdin to localhost:PORT and PORT's replies to stdout (one connection)."""
    from podgate.agent.forward import run_forward

    sys.exit(run_forward(port))
