"""The click group, shared options, and the one place errors become exit codes.

Exit codes: 0 success, 1 a PersistError (one clear line on stderr), 2 usage.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import PersistError

__all__ = ["main", "cli", "emit", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def emit(as_json: bool, data: Any, render: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON for scripts, or through ``render`` for people."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        render(data)


class PersistGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PersistError as e:
            click.echo(f"persist: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            click.echo(f"persist: error: {e.strerror or e}: {e.filename or ''}".rstrip(), err=True)
            sys.exit(1)


@click.group(cls=PersistGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-persist", prog_name="persist")
def cli() -> None:
    """Save MLX inference caches, resume them bit-exactly, reuse prefixes.

    \b
    Example:
      persist make-model ./tiny --arch llama
      persist inspect cache.safetensors
    """


def main() -> None:
    from . import files, models  # noqa: F401  (register the commands)

    cli(prog_name="persist")
