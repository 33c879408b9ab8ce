"""One podgate API server process for the benchmarks: DemoApi + LocalTarget on loopback.

Run as `python -m bench.server --bulk-port P --echo-port E [--loop L] [--profile FILE]
[--tls-dir DIR]`. The
pod default/bench exposes BULK_REMOTE_PORT and ECHO_REMOTE_PORT, which the LocalTarget maps
to the target process. It prints one JSON line (its port, pid and event loop) and serves until
SIGTERM; with --profile it runs under cProfile and writes the stats on the way out. With
--tls-dir it serves HTTPS with a CA, server and admin certificate made there (as the node
gateway's are), and its JSON line names a kubeconfig for them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import signal
import sys
from pathlib import Path

from bench.common import (
    BULK_REMOTE_PORT,
    ECHO_REMOTE_PORT,
    LOOP_CHOICES,
    POD_NAME,
    POD_NAMESPACE,
    resolve_loop,
    run_on,
)
from podgate.demo.api import DemoApi, DemoPod
from podgate.node.pki import ensure_pki, write_kubeconfig
from podgate.streaming.local import LocalTarget


async def serve(bulk_port: int, echo_port: int, loop_name: str, tls_dir: str = "") -> None:
    target = LocalTarget(port_map={BULK_REMOTE_PORT: bulk_port, ECHO_REMOTE_PORT: echo_port})
    api = DemoApi(
        target, [DemoPod(POD_NAMESPACE, POD_NAME, ports=(BULK_REMOTE_PORT, ECHO_REMOTE_PORT))]
    )
    pki = ensure_pki(tls_dir) if tls_dir else None
    ssl_context = pki.server_ssl_context() if pki is not None else None
    server = await api.serve("127.0.0.1", 0, ssl_context=ssl_context)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    port = server.sockets[0].getsockname()[1]
    ready = {"port": port, "pid": os.getpid(), "loop": loop_name}
    if pki is not None:
        kubeconfig = Path(tls_dir) / "kubeconfig"
        write_kubeconfig(
            kubeconfig,
            f"https://127.0.0.1:{port}",
            pki.ca_cert,
            user="admin",
            client_cert=pki.admin_cert,
            client_key=pki.admin_key,
            namespace=POD_NAMESPACE,
        )
        ready["kubeconfig"] = str(kubeconfig)
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server")
    parser.add_argument("--bulk-port", type=int, required=True)
    parser.add_argument("--echo-port", type=int, required=True)
    parser.add_argument("--loop", choices=LOOP_CHOICES, default="podgate", help="event loop")
    parser.add_argument("--profile", help="write cProfile stats here on exit")
    parser.add_argument("--tls-dir", default="", help="serve HTTPS with certificates made here")
    args = parser.parse_args()
    loop_name = resolve_loop(args.loop)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    try:
        run_on(loop_name, serve(args.bulk_port, args.echo_port, loop_name, args.tls_dir))
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
