"""The ``persist`` command line: thin click commands over the library."""

from __future__ import annotations

from . import files, models, run, serve, sessions, transfer, upkeep  # noqa: F401  (each module registers its commands)
from .app import cli

__all__ = ["cli", "main"]


def main() -> None:
    cli(prog_name="persist")
