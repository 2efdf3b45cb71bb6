"""What opening refuses: a damaged index (with the command that saves what SQLite can
still read) and an index that lost its tables beside blob files (never a new store)."""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

from ..errors import CorruptBlobError

__all__ = ["damaged_index", "lost_index"]


def damaged_index(path: Path, detail: str) -> CorruptBlobError:
    """A damaged index, with the command that saves what SQLite can still read of it."""
    if "sqlite3 " in detail:
        return CorruptBlobError(str(path), detail)
    return CorruptBlobError(
        str(path),
        f"{detail}; to save what SQLite can still read of it: "
        f"sqlite3 {shlex.quote(str(path))} .recover > recovered.sql "
        "(then persist check on a copy of the store with the recovered index)",
    )


def lost_index(path: Path) -> CorruptBlobError | None:
    """An index without tables beside blob files: lost or replaced, never a new store."""
    blobs = path.parent / "blobs"
    n = 0
    with contextlib.suppress(OSError):
        for sub in os.scandir(blobs):
            if sub.is_dir(follow_symlinks=False):
                with os.scandir(sub.path) as it:
                    n += sum(1 for e in it if e.name.endswith(".safetensors"))
    if not n:
        return None
    root = shlex.quote(str(path.parent))
    return CorruptBlobError(
        str(path),
        f"the index has no tables (it is empty or was replaced) but {blobs} holds {n} blob "
        "files: persist will not open it as a new store, which would orphan every blob. "
        "Blobs hold tensors without the tokens or model they belong to, so no session can "
        "be rebuilt from them alone: put the store's own index.sqlite back (from a backup), "
        f"or give them up and start afresh by moving the folder away: mv {root} {root}.lost",
    )
