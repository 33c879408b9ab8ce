"""`podgate demo`: the streaming protocols against this host, for kubectl to try."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import click

from podgate.aio.loop import run
from podgate.demo.api import DemoApi, DemoPod
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


@click.command()
@click.option("--port", default=8001, show_default=True, help="Loopback port to listen on.")
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    help="Where to write a kubeconfig for kubectl (default: a temporary file).",
)
@click.option(
    "--attach-command",
    default="cat",
    show_default=True,
    help="The process `kubectl attach` connects to (started per attach).",
)
def demo(port: int, kubeconfig: str | None, attach_command: str) -> None:
    """Serve exec, attach and port-forward for a pod named `demo` that is this host.

    Commands run as local processes and port-forward reaches 127.0.0.1, over every protocol
    generation kubectl 1.27–1.33 and the Python client use. It listens on loopback only and
    without authentication: it is a way to watch the protocols work, not a gateway.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if kubeconfig is None:
        fd, kubeconfig = tempfile.mkstemp(prefix="podgate-demo-", suffix=".kubeconfig")
        os.close(fd)

    async def main() -> None:
        target = LocalTarget(attach_command=attach_command.split())
        api = DemoApi(target, [DemoPod("default", "demo", ports=(8080,))])
        server = await api.serve("127.0.0.1", port)
        bound = server.sockets[0].getsockname()[1]
        assert kubeconfig is not None
        write_kubeconfig(kubeconfig, "127.0.0.1", bound)
        click.echo(f"podgate demo API on http://127.0.0.1:{bound}")
        click.echo(f"kubeconfig: {kubeconfig}\n\nTry:")
        click.echo(f"  export KUBECONFIG={kubeconfig}")
        click.echo("  kubectl get pods")
        click.echo("  kubectl exec demo -- uname -a")
        click.echo("  kubectl exec -it demo -- sh")
        click.echo("  kubectl port-forward pod/demo 9000:8080   # reaches 127.0.0.1:8080 here")
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        run(main())
