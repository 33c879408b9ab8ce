"""`podgate demo`: the streaming protocols against this host, for kubectl to try."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from pathlib import Path

import click

from podgate.aio.loop import run, wait_for_signal
from podgate.demo.api import DemoPod, DemoSource
from podgate.files import atomic_write
from podgate.node.gateway import GatewayConfig
from podgate.node.server import running_gateway
from podgate.streaming.local import LocalTarget

KUBECONFIG_TEMPLATE = """apiVersion: v1
kind: Config
clusters:
- name: podgate-demo
  cluster:
    server: http://{host}:{port}
contexts:
- name: podgate-demo
  context:
    cluster: podgate-demo
    user: demo
    namespace: default
current-context: podgate-demo
users:
- name: demo
  user: {{}}
"""


def write_kubeconfig(path: str, host: str, port: int) -> None:
    with open(path, "w") as f:
        f.write(KUBECONFIG_TEMPLATE.format(host=host, port=port))


def _copy(source: str, target: str) -> None:
    atomic_write(target, Path(source).read_bytes())


@click.command()
@click.option("--port", default=8001, show_default=True, help="Loopback port to listen on.")
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    help="Where to write a kubeconfig for kubectl (default: in the state directory).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="The demo's CA, token and audit log (default: a new temporary directory).",
)
@click.option(
    "--attach-command",
    default="cat",
    show_default=True,
    help="The process `kubectl attach` connects to (started per attach).",
)
def demo(port: int, kubeconfig: str | None, state_dir: str | None, attach_command: str) -> None:
    """Serve exec, attach and port-forward for a pod named `demo` that is this host.

    Commands run as local processes and port-forward reaches 127.0.0.1, over every protocol
    generation kubectl 1.27–1.33 and the Python client use. It listens on loopback only, over
    HTTPS with a random bearer token written into the kubeconfig it prints: local commands
    are as powerful as a shell, so no other page or process may drive them.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if state_dir is None:
        state_dir = tempfile.mkdtemp(prefix="podgate-demo-")

    async def main() -> None:
        assert state_dir is not None
        target = LocalTarget(attach_command=attach_command.split())
        source = DemoSource(target, [DemoPod("default", "demo", ports=(8080,))])
        config = GatewayConfig(state_dir=state_dir, cri_socket="", host="127.0.0.1", port=port)
        async with running_gateway(config, source) as gateway:
            path = str(gateway.credentials.kubeconfig_token)
            if kubeconfig is not None:
                await asyncio.to_thread(_copy, path, kubeconfig)
                path = kubeconfig
            click.echo(f"podgate demo API on {gateway.url} (bearer token in the kubeconfig)")
            click.echo(f"kubeconfig: {path}\n\nTry:")
            click.echo(f"  export KUBECONFIG={path}")
            click.echo("  kubectl get pods")
            click.echo("  kubectl exec demo -- uname -a")
            click.echo("  kubectl exec -it demo -- sh")
            click.echo("  kubectl port-forward pod/demo 9000:8080   # reaches 127.0.0.1:8080 here")
            await wait_for_signal()

    with contextlib.suppress(KeyboardInterrupt):
        run(main())
