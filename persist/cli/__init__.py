"""The ``persist`` command line: thin click commands over the library.

Each module registers its commands on ``app.cli``; a command's module is
imported only when that command runs (``app.PersistGroup`` reads
``COMMANDS``), so ``persist ls`` loads the store commands and nothing else.
"""

from __future__ import annotations

from .app import COMMANDS, cli

__all__ = ["cli", "main", "COMMANDS"]


def main() -> None:
    from .interrupts import PROGRAM

    PROGRAM["on"] = True  # this process is persist's: how it exits is persist's to say
    cli(prog_name="persist")
