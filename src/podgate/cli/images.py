"""`podgate images`: list, import and remove images of a podgate runtime.

`list` and `remove` talk to the runtime's CRI ImageService on its socket, like a kubelet or
crictl would. `import` writes into the image store directly (given by --state-dir): it needs
no running runtime, and a running one sees the imported images at once (the store is shared
safely between processes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import grpc
import grpc.aio
from rich.console import Console
from rich.table import Table

from podgate.aio.loop import run
from podgate.cli.pull import pull_command
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.images.content import ContentError
from podgate.images.importer import import_archive
from podgate.images.store import ImageError, ImageStore
from podgate.images.unpack import LayerError
from podgate.runtime.daemon import DEFAULT_STATE_DIR

# A CRI call from the command line that takes longer than this has hung (seconds).
CALL_TIMEOUT_SECONDS = 60.0

state_dir_option = click.option(
    "--state-dir",
    default=DEFAULT_STATE_DIR,
    show_default=True,
    help="The runtime's state directory (its images live in STATE_DIR/images).",
)
socket_option = click.option(
    "--cri-socket", default="", help="The runtime's CRI socket [default: STATE_DIR/cri.sock]."
)


def _socket(state_dir: str, cri_socket: str) -> str:
    return cri_socket or str(Path(state_dir) / "cri.sock")


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1000
    raise AssertionError("unreachable")


async def _with_images(socket_path: str, call: str, request: object) -> object:
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        stub = pb_grpc.ImageServiceStub(channel)
        try:
            return await getattr(stub, call)(request, timeout=CALL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            raise click.ClickException(
                f"{call} on unix://{socket_path}: {exc.code().name}: {exc.details()}"
            ) from None


@click.group()
def images() -> None:
    """List, import and remove the images of a podgate runtime."""


@images.command("list")
@state_dir_option
@socket_option
@click.option("-q", "--quiet", is_flag=True, help="Image IDs only.")
def list_command(state_dir: str, cri_socket: str, quiet: bool) -> None:
    """The runtime's images (CRI ListImages): one line per name."""
    response = run(
        _with_images(_socket(state_dir, cri_socket), "ListImages", pb.ListImagesRequest())
    )
    assert isinstance(response, pb.ListImagesResponse)
    if quiet:
        for image in response.images:
            click.echo(image.id)
        return
    table = Table(box=None, show_edge=False, pad_edge=False)
    for column in ("IMAGE", "TAG", "IMAGE ID", "SIZE"):
        table.add_column(column)
    for image in response.images:
        names = [*image.repo_tags] or [d.split("@")[0] + ":<none>" for d in image.repo_digests]
        for name in names or ["<none>:<none>"]:
            repo, _, tag = name.rpartition(":")
            short = image.id.removeprefix("sha256:")[:13]
            table.add_row(repo, tag, short, human_size(image.size))
    Console(width=200).print(table)


@images.command("remove")
@state_dir_option
@socket_option
@click.argument("refs", nargs=-1, required=True)
def remove_command(state_dir: str, cri_socket: str, refs: tuple[str, ...]) -> None:
    """Remove images by name, digest or ID (CRI RemoveImage): every name of each goes."""
    socket_path = _socket(state_dir, cri_socket)
    missing = 0
    for ref in refs:
        status = run(
            _with_images(
                socket_path, "ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=ref))
            )
        )
        assert isinstance(status, pb.ImageStatusResponse)
        if not status.HasField("image"):
            click.echo(f"{ref}: no such image", err=True)
            missing += 1
            continue
        run(
            _with_images(
                socket_path, "RemoveImage", pb.RemoveImageRequest(image=pb.ImageSpec(image=ref))
            )
        )
        click.echo(f"Deleted: {status.image.id}")
    if missing:
        sys.exit(1)


@images.command("import")
@state_dir_option
@click.argument("archive", type=click.Path(exists=True, path_type=Path))
def import_command(state_dir: str, archive: Path) -> None:
    """Load an OCI image layout (directory or tar) or a `docker save` archive.

    Writes into STATE_DIR/images directly, verifying every blob's digest and every layer's
    diff ID; works with or without a running runtime on the same --state-dir.
    """
    store = ImageStore(state_dir)
    try:
        records = import_archive(store, archive)
    except (ImageError, ContentError, LayerError, OSError, ValueError) as exc:
        raise click.ClickException(f"import {archive}: {exc}") from None
    for rec in records:
        names = ", ".join(rec.names()) or "<no name>"
        click.echo(f"Loaded {rec.id} ({human_size(rec.size)}): {names}")


images.add_command(pull_command)
