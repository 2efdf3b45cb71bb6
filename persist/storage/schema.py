"""The SQLite index: opening it, connection settings, applying migrations.  No mlx here.

The schema itself, version by version, is ``storage.migrations``;
``meta.schema_version`` records where a store is.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptBlobError, InvalidArgumentError, UnsupportedVersionError
from ..format.opening import file_kind
from .full import disk_full_error, full_disk
from .lost import damaged_index, lost_index
from .migrations import BACKFILLS, MIGRATIONS, SCHEMA_VERSION
from .transactions import corruption_is_typed, end_transaction

if TYPE_CHECKING:
    import sqlite_utils
    from sqlite_utils import Database as _DatabaseBase
else:
    _DatabaseBase = object

__all__ = ["SCHEMA_VERSION", "connect", "Database"]

JOURNAL_LIMIT = 4 << 20  # bytes of write-ahead log kept once it is reset


class Database(_DatabaseBase):
    """The part of ``sqlite_utils.Database`` the store uses (``conn``, ``execute``,
    ``table_names``) over a plain connection.

    Importing sqlite_utils costs about 0.25 s (it pulls in numpy), more than
    the rest of ``persist ls``: a store whose schema is current is opened with
    this instead, and sqlite_utils is imported only for schema work
    (creating, migrating).  To the type checker it is a ``sqlite_utils.Database``,
    so the store's functions take either."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Any = None) -> sqlite3.Cursor:
        if parameters is None:
            return self.conn.execute(sql)
        return self.conn.execute(sql, parameters)

    def table_names(self, fts4: bool = False, fts5: bool = False) -> list[str]:
        rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return [r[0] for r in rows]


def connect(path: Path, block_tokens: int, *, adopt: bool = False) -> sqlite_utils.Database:
    """Open (creating and migrating) the index at ``path``.

    A new store records ``block_tokens``; an existing one keeps its own, and
    asking for another is an error unless ``adopt`` (the caller did not ask).
    """
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            mode = p.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):  # a dangling one would make SQLite create its target
            raise CorruptBlobError(str(p), "is a symbolic link; persist never follows links")
        if not stat.S_ISREG(mode):  # SQLite would wait forever reading a FIFO
            raise CorruptBlobError(str(p), f"is {file_kind(mode)}, not the store's index file")
    if not path.exists():  # created private; SQLite gives -wal/-shm the same mode
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, flags, 0o600))
    try:
        conn = sqlite3.connect(str(path), timeout=60, isolation_level=None, check_same_thread=False)
        # A flipped byte in a text column reads as U+FFFD instead of failing the whole
        # query: listings show the row (check's row checksum finds the damage).
        conn.text_factory = lambda b: b.decode("utf-8", "replace")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=60000")
        # a log that grew (a long reader held it) is cut back to this when next reset
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
    except sqlite3.DatabaseError as e:
        if full_disk(e, path.parent):
            raise disk_full_error(path.parent, e) from None
        raise damaged_index(path, f"the index is not a usable SQLite file: {e}") from None

    light = Database(conn)
    try:
        with corruption_is_typed():
            if _ready(light, block_tokens, adopt):  # no schema work: no lock, no sqlite_utils
                return light
            import sqlite_utils  # imported here: it pulls in click, which `import persist` must not

            db = sqlite_utils.Database(conn)
            lost = lost_index(path) if _version(db) == 0 else None
            if lost is None:
                _migrate(db, path)
                _check_block_tokens(db, block_tokens, path, adopt)
    except CorruptBlobError as e:
        conn.close()
        raise damaged_index(path, e.detail) from None
    except BaseException:
        conn.close()
        raise
    if lost is not None:
        conn.close()
        raise lost
    return db


def _ready(db: Database, block_tokens: int, adopt: bool) -> bool:
    """The schema is current and the block size recorded and accepted (read, not locked)."""
    if "meta" not in db.table_names():
        return False
    rows = dict(
        db.execute(
            "SELECT key, value FROM meta WHERE key IN ('schema_version', 'block_tokens')"
        ).fetchall()
    )
    if rows.get("schema_version") != str(SCHEMA_VERSION) or "block_tokens" not in rows:
        return False  # the locked path migrates, or raises UnsupportedVersionError
    size = str(rows["block_tokens"])
    if not size.isdigit() or int(size) <= 0:
        return False  # damaged: the locked path says so (_check_block_tokens)
    return adopt or int(size) == block_tokens


def _version(db: sqlite_utils.Database) -> int:
    if "meta" not in db.table_names():
        return 0
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def _migrate(db: sqlite_utils.Database, path: Path) -> None:
    try:
        db.execute("BEGIN IMMEDIATE")
        version = _version(db)
        if version > SCHEMA_VERSION:
            raise UnsupportedVersionError("store-index", version, SCHEMA_VERSION)
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                db.execute(stmt)
            if v in BACKFILLS and version > 0:  # a new store has nothing to fill
                BACKFILLS[v](db)
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", [str(v)]
            )
        db.execute("COMMIT")
    except BaseException:
        end_transaction(db, "ROLLBACK")
        raise


def _check_block_tokens(
    db: sqlite_utils.Database, block_tokens: int, path: Path, adopt: bool
) -> None:
    try:
        db.execute("BEGIN IMMEDIATE")
        row = db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()
        if row is None:
            db.execute(
                "INSERT INTO meta(key, value) VALUES ('block_tokens', ?)", [str(block_tokens)]
            )
        elif not str(row[0]).isdigit() or int(row[0]) <= 0:  # isdigit: ASCII digits only
            raise CorruptBlobError(
                str(path), f"its block size {str(row[0])[:40]!r} is not a positive number"
            )
        elif int(row[0]) != block_tokens and not adopt:
            raise InvalidArgumentError(
                f"store {path.parent} uses blocks of {row[0]} tokens, not {block_tokens}"
            )
        db.execute("COMMIT")
    except BaseException:
        end_transaction(db, "ROLLBACK")
        raise
