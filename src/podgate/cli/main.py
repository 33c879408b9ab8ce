"""The `podgate` command."""

from __future__ import annotations

import click

from podgate import __version__
from podgate.cli.agent import agent
from podgate.cli.demo import demo
from podgate.cli.exec import attach_command, exec_command
from podgate.cli.node import node
from podgate.cli.portforward import port_forward
from podgate.cli.proxy import proxy
from podgate.cli.runtime import runtime
from podgate.cli.up import up


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="podgate")
def main() -> None:
    """podgate: Kubernetes exec, attach and port-forward that work for every pod sandbox."""


main.add_command(agent)
main.add_command(attach_command)
main.add_command(demo)
main.add_command(exec_command)
main.add_command(node)
main.add_command(port_forward)
main.add_command(proxy)
main.add_command(runtime)
main.add_command(up)
