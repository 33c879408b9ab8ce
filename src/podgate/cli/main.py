"""The `podgate` command (sub-commands load on first use: see cli/lazy.py)."""

from __future__ import annotations

import click

from podgate import __version__
from podgate.cli.lazy import LazyGroup

# name -> (module, attribute, one-line help shown by `podgate --help`).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("podgate.cli.up", "up", "Run the runtime, the node gateway and the sample pods."),
    "runtime": ("podgate.cli.runtime", "runtime", "Run podgate's CRI runtime."),
    "node": ("podgate.cli.node", "node", "Run the node gateway in front of a CRI runtime."),
    "port-forward": (
        "podgate.cli.portforward",
        "port_forward",
        "Forward local ports to a pod; survives errors.",
    ),
    "exec": ("podgate.cli.exec", "exec_command", "Run a command in a container."),
    "attach": ("podgate.cli.exec", "attach_command", "Attach to a running container."),
    "agent": ("podgate.cli.agent", "agent", "The in-sandbox agent and one-shot forwarder."),
    "demo": ("podgate.cli.demo", "demo", "Serve an in-memory demo pod API (no runtime)."),
    "images": ("podgate.cli.images", "images", "Pull, list, import and remove images."),
    "proxy": ("podgate.cli.proxy", "proxy", "A CRI proxy in front of containerd or CRI-O."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="podgate")
def main() -> None:
    """podgate: Kubernetes exec, attach and port-forward that work for every pod sandbox."""
