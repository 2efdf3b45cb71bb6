"""``persist make-model``: a tiny random-weight model for offline trials."""

from __future__ import annotations

from pathlib import Path

import click

from ..apps.demo import ARCHS, make_model
from .app import cli, emit


@cli.command("make-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(sorted(ARCHS)), default="llama", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def make_model_cmd(directory: Path, arch: str, seed: int, as_json: bool) -> None:
    """Write a tiny random-weight mlx-lm model with a real tokenizer to DIRECTORY.

    It loads with mlx_lm.load(DIRECTORY) and needs no network.

    \b
    Example:
      persist make-model ./tiny-qwen --arch qwen3_next
    """
    path = make_model(directory, arch, seed=seed)
    emit(
        as_json,
        {"directory": str(path), "arch": arch, "seed": seed},
        lambda d: click.echo(f"wrote a tiny {arch} model to {d['directory']}"),
    )
