"""A store's own settings (its remembered budget), its files on disk, and compaction.

Settings live in the index's ``meta`` table under ``config.<key>``, so they
travel with the store and change in one transaction.  The default budget is
the smaller of a tenth of the disk and 20 GiB: a cache should not fill a
disk, and a user who wants more says so once (``persist config set``).
No mlx here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError

BUSY_TIMEOUT_MS = 60000  # schema.connect's busy_timeout
CHECKPOINT_WAIT_MS = 200  # how long a truncating checkpoint waits for a reader

if TYPE_CHECKING:
    from .index import Index

__all__ = [
    "SETTINGS",
    "DEFAULT_CAP",
    "get_setting",
    "set_setting",
    "default_budget",
    "budget",
    "remembered_budget",
    "files_bytes",
    "vacuum",
]

SETTINGS = {"max-bytes": "the store's byte budget; evicted down to on every save and by gc"}
DEFAULT_CAP = 20 << 30  # bytes
DISK_SHARE = 10  # the default budget is at most 1/10 of the disk
NO_BUDGET = "none"  # `persist config set max-bytes none`: no budget at all
OTHER_CACHES = ("identity",)  # persist's other caches when PERSIST_HOME is the store; demo-*


def _key(key: str) -> str:
    if key not in SETTINGS:
        raise InvalidArgumentError(f"no setting {key!r}; settings: {', '.join(sorted(SETTINGS))}")
    return f"config.{key}"


def get_setting(index: Index, key: str) -> str | None:
    with index.read() as db:
        row = db.execute("SELECT value FROM meta WHERE key = ?", [_key(key)]).fetchone()
    return None if row is None else str(row[0])


def set_setting(index: Index, key: str, value: str | None) -> None:
    """Remember ``value`` for ``key``; None forgets it (back to the default)."""
    name = _key(key)
    with index.write() as db:
        if value is None:
            db.execute("DELETE FROM meta WHERE key = ?", [name])
        else:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [name, value])


def default_budget(root: Path) -> int:
    """min(a tenth of the disk holding ``root``, 20 GiB)."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    return min(shutil.disk_usage(where).total // DISK_SHARE, DEFAULT_CAP)


def remembered_budget(index: Index) -> int | None:
    """The budget ``persist config set max-bytes`` remembered, None if none or "none"
    (a library ``Store(root)`` then has no budget; the CLI's default is ``budget``)."""
    value = get_setting(index, "max-bytes")
    return None if value is None or value == NO_BUDGET else int(value)


def budget(index: Index | None, root: Path) -> tuple[int | None, str]:
    """(bytes or None for no budget, where it comes from: "config" or "default")."""
    value = None if index is None else get_setting(index, "max-bytes")
    if value is None:
        return default_budget(root), "default"
    return (None if value == NO_BUDGET else int(value)), "config"


def files_bytes(root: Path) -> dict[str, int]:
    """Bytes of every file of the store: the index (with its -wal and -shm), the blobs,
    and the rest (temporary and quarantined files); persist's other caches kept in
    the same folder (the demo model, the identity memo) are not the store's.

    One ``lstat`` a file through ``os.scandir`` (no path objects): 100,000 blobs
    took 3.6 s through pathlib and os.walk, a few tenths of that this way."""
    out = {"index": 0, "blobs": 0, "other": 0}
    try:
        top = list(os.scandir(root))
    except OSError:
        top = []
    for entry in top:
        kind = _is_folder(entry)
        if kind is None:
            continue
        if kind:
            if entry.name in OTHER_CACHES or entry.name.startswith("demo-"):
                continue
            out["blobs" if entry.name == "blobs" else "other"] += _tree_bytes(entry.path)
        else:
            part = "index" if entry.name.startswith("index.sqlite") else "other"
            out[part] += _size(entry)
    out["total"] = sum(out.values())
    out["wal"] = wal_bytes(root)  # a part of "index", shown apart: a long reader grows it
    return out


def _is_folder(entry: os.DirEntry[str]) -> bool | None:
    """True: a folder to count; None: a link to one (not followed, not counted, as
    ``os.walk`` leaves it); False: a file (or a link to one: its own size)."""
    try:
        if not entry.is_dir():
            return False
        return None if entry.is_symlink() else True
    except OSError:  # removed while we looked
        return False


def _size(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:  # removed while we looked
        return 0


def _tree_bytes(path: str) -> int:
    total, todo = 0, [path]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:  # removed, or not ours to read
            continue
        for entry in entries:
            kind = _is_folder(entry)
            if kind:
                todo.append(entry.path)
            elif kind is False:
                total += _size(entry)
    return total


def wal_bytes(root: Path) -> int:
    """The size of the index's write-ahead log (``persist stats``, /health)."""
    try:
        return os.lstat(root / "index.sqlite-wal").st_size
    except OSError:
        return 0


def truncate_wal(index: Index) -> bool:
    """Checkpoint the whole log into the index and truncate it to nothing (after a
    large delete); it needs no new space.  A reader still inside a transaction keeps
    it: the log is then left as it is (the next checkpoint after the reader ends
    resets it, and ``journal_size_limit`` cuts it back).  Whether it was truncated."""
    from .transactions import corruption_is_typed

    with index.lock, corruption_is_typed():
        index.db.execute(f"PRAGMA busy_timeout={CHECKPOINT_WAIT_MS}")  # a reader: give up
        try:
            busy, _, _ = index.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            index.db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return not busy


def vacuum(index: Index, root: Path) -> bool:
    """Give the pages of deleted rows back to the file system (after a large gc), in an
    order that never needs space the disk lacks: the log truncated first (no new
    space), then VACUUM only where the disk has room for a copy of the index and its
    log (else the free pages stay for later rows, and the store keeps working).
    Whether the index was compacted."""
    from .full import RESERVE_BYTES, full_disk
    from .transactions import corruption_is_typed

    truncate_wal(index)
    try:
        size = os.lstat(root / "index.sqlite").st_size
        st = os.statvfs(root)
    except OSError:
        return False
    if st.f_bavail * st.f_frsize < 2 * size + 2 * RESERVE_BYTES:
        return False
    try:
        with index.lock, corruption_is_typed():
            index.db.execute("VACUUM")
    except Exception as e:
        if full_disk(e, root):
            return False  # filled meanwhile: SQLite rolled the VACUUM back
        raise
    truncate_wal(index)
    return True
