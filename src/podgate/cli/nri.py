"""NRI options shared by `podgate runtime` and `podgate up`."""

from __future__ import annotations

import sys

import click

from podgate.nri.adaptation import NriConfig

# podgate's own plugins, each a separate process speaking NRI like any other plugin.
BUILTIN_PLUGINS = ("cni", "native", "logger")
# Index of the first built-in plugin launched with --nri-plugin; the next ones get +10.
FIRST_BUILTIN_INDEX = 10


def nri_options(f: click.decorators.FC) -> click.decorators.FC:
    defaults = NriConfig()
    for option in reversed(
        [
            click.option(
                "--nri/--no-nri",
                "nri_enabled",
                default=True,
                show_default=True,
                help="Serve NRI plugins (external ones on --nri-socket, pre-installed ones "
                "from --nri-plugin-dir).",
            ),
            click.option(
                "--nri-socket",
                default="",
                help=f"NRI socket for external plugins [default: {defaults.socket_path}; "
                "`podgate up`: STATE_DIR/nri.sock]; its directory is made mode 0700.",
            ),
            click.option(
                "--nri-plugin-dir",
                default=defaults.plugin_path,
                show_default=True,
                help="Pre-installed plugins: executables named NN-name, started with the "
                "connection on fd 3.",
            ),
            click.option(
                "--nri-config-dir",
                default=defaults.plugin_config_path,
                show_default=True,
                help="Plugin configuration: NN-name.conf or name.conf.",
            ),
            click.option(
                "--nri-plugin",
                "nri_plugins",
                multiple=True,
                type=click.Choice(BUILTIN_PLUGINS),
                help="Start one of podgate's plugins as a pre-installed plugin (indexes 10, 20, "
                "... in the order given; configured from --nri-config-dir like any other).",
            ),
            click.option(
                "--nri-request-timeout",
                type=float,
                default=defaults.request_timeout,
                show_default=True,
                help="Seconds a plugin may take per event before it is dropped.",
            ),
            click.option(
                "--cdi-spec-dir",
                "cdi_spec_dirs",
                multiple=True,
                default=defaults.cdi_spec_dirs,
                show_default=True,
                help="CDI device specs for plugins' CDI device adjustments (later ones win).",
            ),
            click.option(
                "--network",
                type=click.Choice(["none", "nri"]),
                default="none",
                show_default=True,
                help="Pod networking: none (loopback only) or NRI plugins (set up at "
                "RunPodSandbox, IPs from their PodSandboxStatus answers).",
            ),
        ]
    ):
        f = option(f)
    return f


def nri_config(
    *,
    nri_enabled: bool,
    nri_socket: str,
    nri_plugin_dir: str,
    nri_config_dir: str,
    nri_plugins: tuple[str, ...],
    nri_request_timeout: float,
    network: str,
    cdi_spec_dirs: tuple[str, ...] = (),
    default_socket: str = "",
) -> NriConfig | None:
    if not nri_enabled:
        if network == "nri":
            raise click.UsageError("--network nri needs NRI (drop --no-nri)")
        return None
    builtin = [
        (
            f"{FIRST_BUILTIN_INDEX + 10 * n:02d}",
            name,
            [sys.executable, "-m", f"podgate.nri.plugins.{name}"],
        )
        for n, name in enumerate(nri_plugins)
    ]
    config = NriConfig(
        plugin_path=nri_plugin_dir,
        plugin_config_path=nri_config_dir,
        request_timeout=nri_request_timeout,
        builtin=builtin,
    )
    if cdi_spec_dirs:
        config.cdi_spec_dirs = list(cdi_spec_dirs)
    if nri_socket or default_socket:
        config.socket_path = nri_socket or default_socket
    return config
