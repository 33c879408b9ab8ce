"""`podgate images pull REF`: pull an image into a runtime's image store, with progress.

The pull runs in this process on the store under --state-dir (as `images import` does), so it
can show per-layer bytes: a progress bar on a terminal, plain log lines otherwise. Registries,
mirrors, CAs and credentials come from the runtime's config file (--config); --username and
--password override them for the image's own registry.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from podgate.aio.loop import run
from podgate.cli.logs import setup_logging
from podgate.images.config import ConfigError, Credentials, FileConfig, load_config
from podgate.images.manifests import Descriptor
from podgate.images.pull import Puller
from podgate.images.reference import InvalidReferenceError
from podgate.images.registry import RegistryError
from podgate.images.store import DEFAULT_MAX_LAYER_BYTES, ImageError, ImageStore
from podgate.images.unpack import LayerError
from podgate.runtime.daemon import DEFAULT_STATE_DIR


class BarProgress:
    """One bar per layer (bytes) in a rich Progress; unpacking shown as a last line."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def resolved(self, reference: str, digest: str, layers: Sequence[Descriptor]) -> None:
        self.progress.console.print(f"{reference}: resolved to {digest}")
        for desc in layers:
            if desc.digest not in self.tasks:
                self.tasks[desc.digest] = self.progress.add_task(desc.digest[7:19], total=desc.size)

    def advanced(self, digest: str, nbytes: int) -> None:
        task = self.tasks.get(digest)
        if task is not None:
            self.progress.advance(task, nbytes)

    def layer_done(self, digest: str, cached: bool) -> None:
        task = self.tasks.get(digest)
        if task is not None:
            total = self.progress.tasks[task].total or 0
            label = f"{digest[7:19]} {'present' if cached else 'done'}"
            self.progress.update(task, completed=total, description=label)

    def unpacking(self) -> None:
        self.progress.console.print("unpacking")


async def _pull(
    store: ImageStore,
    file_config: FileConfig,
    reference: str,
    creds: Credentials | None,
    bars: bool,
) -> str:
    puller = Puller(
        store,
        file_config.registries,
        max_concurrent_downloads=file_config.images.max_concurrent_downloads,
    )
    try:
        if bars:
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
            )
            with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
                record = await puller.pull_image(reference, creds, BarProgress(progress))
        else:
            # The puller logs every pull's progress itself (podgate.images.pull).
            record = await puller.pull_image(reference, creds)
    finally:
        await puller.aclose()
    return record.id


@click.command("pull")
@click.argument("reference")
@click.option(
    "--state-dir",
    default=DEFAULT_STATE_DIR,
    show_default=True,
    help="The runtime's state directory (its images live in STATE_DIR/images).",
)
@click.option(
    "--config",
    "config_file",
    default="",
    metavar="FILE",
    help="The runtime's TOML config: registries, mirrors, CA files, credentials.",
)
@click.option("--username", default="", help="Registry user (with --password).")
@click.option("--password", default="", help="Registry password.")
@click.option(
    "--progress",
    "mode",
    type=click.Choice(["auto", "bar", "plain"]),
    default="auto",
    show_default=True,
    help="A progress bar per layer (auto: on a terminal) or plain log lines.",
)
def pull_command(
    reference: str, state_dir: str, config_file: str, username: str, password: str, mode: str
) -> None:
    """Pull REFERENCE from its registry into the image store; prints the image ID."""
    setup_logging("text")
    if bool(username) != bool(password):
        raise click.UsageError("--username and --password go together")
    try:
        file_config = load_config(config_file) if config_file else FileConfig()
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    creds = Credentials(username, password) if username else None
    bars = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
    if bars:
        # The bars say it all; the puller's progress lines would tear the live display.
        logging.getLogger("podgate.images.pull").setLevel(logging.WARNING)
    try:
        store = ImageStore(state_dir, file_config.images.max_layer_bytes or DEFAULT_MAX_LAYER_BYTES)
        image_id = run(_pull(store, file_config, reference, creds, bars))
    except (RegistryError, ImageError, LayerError, InvalidReferenceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(image_id)
