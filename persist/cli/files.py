"""``persist inspect`` and ``persist verify``: look inside a persist file."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # reading files imports mlx: loaded by these commands only
    from ..apps.inspect import FileInfo
from .app import cli, emit, human_bytes, json_option, plain


def _render(info: FileInfo) -> None:
    when = datetime.datetime.fromtimestamp(info.created).isoformat(timespec="seconds")
    click.echo(
        f"{plain(info.path)}: {human_bytes(info.file_bytes)} on disk, "
        f"{human_bytes(info.tensor_bytes)} of tensors, saved {when}"
    )
    click.echo(f"tokens: {'none recorded' if info.tokens is None else info.tokens}")
    if info.identity:
        name, digest = info.identity.get("name"), info.identity.get("digest", "")[:16]
        click.echo(f"model: {plain(name)} ({plain(digest)})")
    for k, v in sorted(info.metadata.items()):
        click.echo(f"meta {plain(k)}: {plain(v)}")
    for layer in info.layers:
        line = f"  layer {layer.index:3d}  {layer.kind:<28} {human_bytes(layer.bytes):>10}"
        if info.verified:
            line += (
                f"  offset {layer.offset}  trimmable {layer.trimmable}"
                f"  min resume {layer.min_resume_offset}"
            )
        click.echo(line)
    if info.verified:
        click.echo(f"verified: every checksum matches ({info.seconds:.3f} s)")


# no click checks: the reader judges the path (a folder, a FIFO, a missing file: typed, exit 1)
_path = click.argument("file", type=click.Path(path_type=Path))
_json = json_option


@cli.command()
@_path
@_json
def inspect(file: Path, as_json: bool) -> None:
    """Show what a persist file holds, reading only its header.

    \b
    Example:
      persist inspect chat.safetensors --json
    """
    from ..apps.inspect import describe_file

    info = describe_file(file)
    emit(as_json, info.to_dict(), lambda _: _render(info))


@cli.command()
@_path
@_json
def verify(file: Path, as_json: bool) -> None:
    """Load a persist file completely, verify every checksum, show resume facts.

    \b
    Example:
      persist verify chat.safetensors
    """
    from ..apps.inspect import verify_file

    info = verify_file(file)
    emit(as_json, info.to_dict(), lambda _: _render(info))
