"""``persist make-model``: a tiny random-weight model for offline trials."""

from __future__ import annotations

from pathlib import Path

import click

from ..apps.demo import ARCHS, make_model
from ..errors import PersistError, StorageError
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
    try:
        path = make_model(directory, arch, seed=seed)
    except PersistError:
        raise
    except OSError as e:  # a name too long, a read-only folder: the system's refusal, typed
        raise StorageError(f"cannot write a model to {directory}", e) from e
    emit(
        as_json,
        {"directory": str(path), "arch": arch, "seed": seed},
        lambda d: click.echo(f"wrote a tiny {arch} model to {d['directory']}"),
    )
