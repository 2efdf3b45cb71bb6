"""Opening a store's folder: created private, owned by this user, read-only when
it must be, its blob files and its index connected.  No mlx.

``persist.Store`` opens its root through ``open_folder`` alone; a listing
(``cli/app.open_index``) opens the index without the blob layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PersistError, StorageError
from . import access, full
from .blobs import FileBlobs
from .schema import connect

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["DEFAULT_BLOCK", "Opened", "open_folder"]

DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class Opened:
    """A store folder, opened: read-only or not, its blob files, its index."""

    read_only: bool
    blobs: FileBlobs
    db: sqlite_utils.Database


def open_folder(root: Path, block_tokens: int | None) -> Opened:
    """Open (creating, 0700) the store at ``root``; StorageError for an OSError."""
    try:
        if not root.exists():
            access.private_mkdir(root)  # and every folder above it: 0700
        access.check_owner(root)  # another user's store is refused, as ssh does
        read_only = access.read_only(root)
        blobs = FileBlobs(root)
        db = _connect(root, block_tokens, read_only)
    except PersistError:
        raise
    except OSError as e:  # permissions, a missing folder, a file where a folder goes
        raise StorageError(f"cannot open the store at {root}", e) from e
    return Opened(read_only, blobs, db)


def _connect(root: Path, block_tokens: int | None, read_only: bool) -> sqlite_utils.Database:
    if read_only:  # lists, shows, exports and restores; writes are refused
        return access.connect_read_only(root / "index.sqlite")
    # a fresh connection needs room for SQLite's -shm: on a full disk, the reserve's
    db = full.with_room(
        root,
        lambda: connect(
            root / "index.sqlite",
            block_tokens or DEFAULT_BLOCK,
            adopt=block_tokens is None,
        ),
    )
    for suffix in ("", "-wal", "-shm"):
        p = root / f"index.sqlite{suffix}"
        if p.exists() and not p.is_symlink():
            os.chmod(p, 0o600)
    return db
