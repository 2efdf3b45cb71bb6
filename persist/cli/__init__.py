"""The ``persist`` command line: thin click commands over the library."""

from __future__ import annotations

from .app import main

__all__ = ["main"]
