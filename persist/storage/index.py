"""SQL over the index: snapshots, their blocks, blob reference counts, counters.

No mlx.  Every mutation runs in one ``BEGIN IMMEDIATE`` transaction; blob
files are unlinked only after the transaction that unreferenced them has
committed (``Index.collect`` hands back the dead files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptBlobError, ReadOnlyStoreError
from .index_statistics import HeldStatistics, IndexStatistics
from .rows import (
    SNAPSHOT_COLS,
    BlockRef,
    NewBlob,
    SnapshotRow,
    blob_value,
    check_name,
    listed_info,
    row_digest,
    row_of,
)
from .transactions import corruption_is_typed, end_transaction

if TYPE_CHECKING:
    import sqlite_utils

    from .types import EntryInfo

__all__ = ["Index", "SnapshotRow", "NewBlob", "BlockRef"]


# Forced plan: walk blocks by chain hash first (SQLite has no statistics to know).
BLOCKS_THEN_SNAPSHOTS = "snapshot_blocks b INDEXED BY snapshot_blocks_chain CROSS JOIN snapshots s"
MAX_VARIABLES = 500  # keys per IN (...) list: far below SQLite's limit


class Index(IndexStatistics):
    """The index of one store; safe to share between threads."""

    def __init__(self, db: sqlite_utils.Database, read_only: Path | None = None) -> None:
        self.db = db
        self.lock = threading.RLock()
        self.read_only = read_only  # the root of a store opened read-only: no write runs
        self.held: HeldStatistics | None = None  # counts and last uses not yet written

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        # Every statement that begins or ends a transaction sits inside the block
        # that ends it: a Ctrl-C is raised as a statement returns or is about to
        # run, and the transaction must never outlive the call.
        if self.read_only is not None:
            raise ReadOnlyStoreError(self.read_only)
        with self.lock, corruption_is_typed():
            self._end("ROLLBACK")  # one left open is never this call's to commit
            try:
                self.db.execute("BEGIN IMMEDIATE")
                yield self.db
                self.db.execute("COMMIT")
            except BaseException:
                self._end("ROLLBACK")
                raise

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite_utils.Database]:
        with self.lock, corruption_is_typed():
            self._end("ROLLBACK")
            try:
                self.db.execute("BEGIN")
                yield self.db
            finally:
                self._end("COMMIT")

    def _end(self, verb: str) -> None:
        with contextlib.suppress(sqlite3.Error):
            end_transaction(self.db, verb)

    # -- namespaces -------------------------------------------------------

    def secret(self, namespace: str, make: Any = None) -> bytes | None:
        """The namespace's secret; created with ``make()`` if given, else None if absent."""
        with self.read() as db:
            row = db.execute("SELECT secret FROM namespaces WHERE name = ?", [namespace]).fetchone()
        if row:
            return Index._secret(row[0], namespace)
        if make is None:
            return None
        with self.write() as db:
            db.execute(
                "INSERT OR IGNORE INTO namespaces(name, secret) VALUES (?, ?)", [namespace, make()]
            )
            row = db.execute("SELECT secret FROM namespaces WHERE name = ?", [namespace]).fetchone()
        return Index._secret(row[0], namespace)

    @staticmethod
    def _secret(value: Any, namespace: str) -> bytes:
        """A namespace secret as stored; a damaged one is refused, never keyed with."""
        if not isinstance(value, bytes) or len(value) < 16:
            raise CorruptBlobError(
                "index.sqlite", f"the secret of namespace {namespace!r} is damaged"
            )
        return value

    # -- saves in flight ------------------------------------------------------

    def begin_pending(self, salt: str) -> None:
        with self.write() as db:
            db.execute(
                "INSERT INTO pending(salt, pid, created) VALUES (?, ?, ?)",
                [salt, os.getpid(), time.time()],
            )

    def end_pending(self, salt: str) -> bool:
        """Forget a save's registration; whether it was there."""
        with self.write() as db:
            return db.execute("DELETE FROM pending WHERE salt = ?", [salt]).rowcount > 0

    def pending(self) -> dict[str, tuple[int, float]]:
        with self.read() as db:
            return {
                r[0]: (r[1], r[2]) for r in db.execute("SELECT salt, pid, created FROM pending")
            }

    # -- blobs --------------------------------------------------------------

    def live_blob(self, key: str) -> tuple[str, int] | None:
        with self.read() as db:
            row = db.execute(
                # the partial key index: unforced, SQLite walks every live blob (dead = 0)
                "SELECT file, size FROM blobs INDEXED BY blobs_key WHERE key = ? AND dead = 0 "
                "LIMIT 1",
                [key],
            ).fetchone()
        return (row[0], row[1]) if row else None

    def blob_facts(self, files: Sequence[str]) -> dict[str, tuple[str, int, bytes]]:
        """file -> (content key, size, header checksum) of live blobs."""
        out: dict[str, tuple[str, int, bytes]] = {}
        with self.read() as db:
            for f in set(files):
                row = db.execute(
                    "SELECT key, size, head_xxh3 FROM blobs WHERE file = ? AND dead = 0", [f]
                ).fetchone()
                if row is not None:
                    out[f] = (row[0], row[1], blob_value(row[2]))
        return out

    def set_secret(self, namespace: str, secret: bytes) -> bytes:
        """Adopt ``secret`` for a namespace this store has not used yet; the one in force."""
        with self.write() as db:
            db.execute(
                "INSERT OR IGNORE INTO namespaces(name, secret) VALUES (?, ?)", [namespace, secret]
            )
            row = db.execute("SELECT secret FROM namespaces WHERE name = ?", [namespace]).fetchone()
        return Index._secret(row[0], namespace)

    def blob_rows_and_pending(
        self,
    ) -> tuple[dict[str, tuple[int, bytes, int, bool]], dict[str, tuple[int, float]]]:
        """Blob rows and saves in flight, as one consistent view."""
        with self.read() as db:
            rows = db.execute("SELECT file, size, head_xxh3, refs, dead FROM blobs").fetchall()
            pending = db.execute("SELECT salt, pid, created FROM pending").fetchall()
        return (
            {r[0]: (r[1], blob_value(r[2]), r[3], bool(r[4])) for r in rows},
            {r[0]: (r[1], r[2]) for r in pending},
        )

    def blob_head(self, file: str) -> tuple[int, bytes] | None:
        with self.read() as db:
            row = db.execute(
                "SELECT size, head_xxh3 FROM blobs WHERE file = ? AND dead = 0", [file]
            ).fetchone()
        return (row[0], blob_value(row[1])) if row else None

    # -- snapshots ----------------------------------------------------------

    def get(self, snapshot_id: int) -> SnapshotRow | None:
        with self.read() as db:
            row = db.execute(
                f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE id = ?", [snapshot_id]
            ).fetchone()
        return row_of(row) if row else None

    def by_name(self, namespace: str, name: str) -> SnapshotRow | None:
        """A session's row; InvalidNameError for a name no row can have (``check_name``)."""
        check_name(namespace, "namespace")
        check_name(name, "session")
        with self.read() as db:
            row = db.execute(
                f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE namespace = ? AND name = ?",
                [namespace, name],
            ).fetchone()
        return row_of(row) if row else None

    @staticmethod
    def damaged_rows(
        db: sqlite_utils.Database, only: int | None = None
    ) -> list[tuple[SnapshotRow, str]]:
        """Rows (all, or snapshot ``only``) that do not match their checksum, in ``db``'s view."""
        where, args = ("id = ?", [only]) if only is not None else ("1=1", [])
        out = []
        for r in Index.rows_where(db, where, args):
            if row_digest(r, Index.blocks_in(db, r.id)) != r.row_xxh3:
                out.append((r, "index row does not match its checksum"))
        return out

    def checked_info(self, row: SnapshotRow) -> EntryInfo:
        """``listed_info``, also marked damaged when the row fails its checksum (a flipped
        token count would otherwise be shown as the session's)."""
        info = listed_info(row)
        if info.damaged is None:
            with self.read() as db:
                bad = Index.damaged_rows(db, row.id)
            if bad:
                info = dataclasses.replace(info, damaged=f"the {bad[0][1]}")
        return info

    @staticmethod
    def blocks_in(db: sqlite_utils.Database, snapshot_id: int) -> list[BlockRef]:
        rows = db.execute(
            "SELECT idx, chain, blob FROM snapshot_blocks WHERE snapshot = ? ORDER BY idx",
            [snapshot_id],
        ).fetchall()
        return [BlockRef(r[0], blob_value(r[1]), r[2]) for r in rows]

    def by_name_with_blocks(
        self, namespace: str, name: str
    ) -> tuple[SnapshotRow, list[BlockRef]] | None:
        """A named snapshot and its blocks, read in one transaction, checksum verified."""
        with self.read() as db:
            rows = Index.rows_where(db, "namespace = ? AND name = ?", [namespace, name])
            if not rows:
                return None
            blocks = Index.blocks_in(db, rows[0].id)
        if row_digest(rows[0], blocks) != rows[0].row_xxh3:
            raise CorruptBlobError(
                f"snapshot {rows[0].id}", "index row does not match its checksum"
            )
        return rows[0], blocks

    def verified_blocks(self, row: SnapshotRow) -> list[BlockRef]:
        """The row's blocks, after checking the row against its checksum."""
        blocks = self.blocks(row.id)
        if row_digest(row, blocks) != row.row_xxh3:
            raise CorruptBlobError(f"snapshot {row.id}", "index row does not match its checksum")
        return blocks

    def block_blobs(self, snapshot_id: int, idxs: list[int]) -> list[str]:
        """The blob files of the row's blocks at ``idxs`` (a sample, not the whole list)."""
        if not idxs:
            return []
        marks = ",".join("?" * len(idxs))
        with self.read() as db:
            got = db.execute(
                f"SELECT blob FROM snapshot_blocks WHERE snapshot = ? AND idx IN ({marks})"
                " ORDER BY idx",
                [snapshot_id, *idxs],
            ).fetchall()
        return [r[0] for r in got if r[0] is not None]

    def blocks(self, snapshot_id: int) -> list[BlockRef]:
        with self.read() as db:
            return Index.blocks_in(db, snapshot_id)

    def snapshots(self, namespace: str | None, named_only: bool) -> list[SnapshotRow]:
        sql = f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE 1=1"
        args: list[Any] = []
        if namespace is not None:
            sql += " AND namespace = ?"
            args.append(namespace)
        if named_only:
            sql += " AND name IS NOT NULL"
        with self.read() as db:
            return [row_of(r) for r in db.execute(sql + " ORDER BY namespace, name, id", args)]

    def tally(self, namespace: str | None = None) -> tuple[int, int, int]:
        """(entries, named sessions, the bytes they reference), of the store or of one
        namespace: counted over the covering index ``snapshots_tally``, no row read."""
        sql = (
            "SELECT COUNT(*), COUNT(name), COALESCE(SUM(bytes), 0) "
            "FROM snapshots INDEXED BY snapshots_tally"
        )
        args: list[Any] = []
        if namespace is not None:
            sql, args = sql + " WHERE namespace = ?", [namespace]
        with self.read() as db:
            entries, sessions, nbytes = db.execute(sql, args).fetchone()
        return int(entries), int(sessions), int(nbytes)

    def seen(self, namespace: str, name: str) -> float | None:
        """The latest version (save time) of a named session this store saw on a tier."""
        with self.read() as db:
            row = db.execute(
                "SELECT created FROM tier_seen WHERE namespace = ? AND name = ?", [namespace, name]
            ).fetchone()
        return float(row[0]) if row else None

    def base(self, namespace: str, name: str) -> float | None:
        """The latest tier version of a named session this store's history of it continues
        (pushed under the name, or pulled); None after a local delete (``forget_base``):
        the tombstone a push may replace without a conflict (a record only by its tokens:
        ``engine.tiers.lineage.continues``)."""
        with self.read() as db:
            row = db.execute(
                "SELECT base FROM tier_seen WHERE namespace = ? AND name = ?", [namespace, name]
            ).fetchone()
        return float(row[0]) if row and row[0] is not None else None

    def has_tier_history(self) -> bool:
        """Has this store ever pushed to or pulled from a tier (a fleet machine's)?"""
        with self.read() as db:
            return db.execute("SELECT 1 FROM tier_seen LIMIT 1").fetchone() is not None

    def saw(self, namespace: str, name: str, created: float, base: bool = True) -> None:
        """A version of ``name`` this store pushed or pulled: the replay floor and the base.
        ``base`` False: the floor only (a tombstone read past a copy this store holds of
        the deleted history: what it saves on that copy does not continue the tombstone)."""
        with self.write() as db:
            db.execute(
                "INSERT INTO tier_seen(namespace, name, created, base) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(namespace, name) DO UPDATE SET created = MAX(created, "
                "excluded.created), base = MAX(COALESCE(base, excluded.base), "
                "COALESCE(excluded.base, base))",  # a NULL in MAX() is NULL: keep the base
                [namespace, name, created, created if base else None],
            )

    def unique_bytes(
        self, db: sqlite_utils.Database | None = None, namespace: str | None = None
    ) -> int:
        """Live bytes on disk, of the store or of one namespace (kept by triggers: no scan).

        Blobs are namespace-salted, so a namespace's bytes are its own: a block
        shared by its sessions counts once, another namespace's never.
        """

        def q(d: sqlite_utils.Database) -> int:
            sql, args = "SELECT COALESCE(SUM(bytes), 0) FROM usage", []
            if namespace is not None:
                sql, args = sql + " WHERE namespace = ?", [namespace]
            return int(d.execute(sql, args).fetchone()[0])

        if db is not None:
            return q(db)
        with self.read() as d:
            return q(d)

    @staticmethod
    def rows_where(db: sqlite_utils.Database, sql: str, args: Sequence[Any]) -> list[SnapshotRow]:
        return [
            row_of(r)
            for r in db.execute(f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE {sql}", list(args))
        ]

    def collect(self) -> list[str]:
        """Dead blob files (unreferenced, committed); the caller unlinks them, then forgets."""
        return [f for f, _ in self.collect_sized()]

    def collect_sized(self) -> list[tuple[str, int]]:
        """``collect``'s files with their bytes: what unlinking them frees."""
        with self.read() as db:
            return [(r[0], r[1]) for r in db.execute("SELECT file, size FROM blobs WHERE dead = 1")]

    def forget(self, files: Sequence[str]) -> None:
        """Drop the rows of dead blobs whose files are gone.

        Without foreign keys: their check scans every snapshot and block for
        each row (no index on those columns), which made every save that
        replaced a tail cost O(sessions); a dead row has no user by its count,
        and its file is already unlinked, so the check could protect nothing.
        """
        with self.lock:
            self.db.execute("PRAGMA foreign_keys=OFF")  # a no-op inside a transaction
            try:
                with self.write() as db:
                    for f in files:
                        db.execute("DELETE FROM blobs WHERE file = ? AND dead = 1", [f])
            finally:
                self.db.execute("PRAGMA foreign_keys=ON")
