"""Statements that change the index, run inside the caller's ``Index.write()`` transaction.

No mlx.  A save commits through ``add_blobs``, ``insert`` and ``add_heads``;
``remove`` marks blobs dead when their last user goes (files are unlinked
after the commit, by ``retention.collect``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .chains import boundary_heads
from .index import MAX_VARIABLES, Index
from .rows import BlockRef, NewBlob, SnapshotRow, row_digest

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "blobs_alive",
    "add_blobs",
    "insert",
    "add_heads",
    "remove",
    "set_pinned",
    "demote",
    "blob_sizes",
    "finish_pending",
    "session_rows",
]


def blobs_alive(db: sqlite_utils.Database, files: Sequence[str]) -> bool:
    for f in set(files):
        row = db.execute("SELECT dead FROM blobs WHERE file = ?", [f]).fetchone()
        if row is None or row[0]:
            return False
    return True


def add_blobs(db: sqlite_utils.Database, namespace: str, blobs: Sequence[NewBlob]) -> None:
    now = time.time()
    for b in blobs:
        db.execute(
            "INSERT INTO blobs(file, key, namespace, size, head_xxh3, refs, dead, created) "
            "VALUES (?, ?, ?, ?, ?, 0, 0, ?)",
            [b.file, b.key, namespace, b.size, b.head_xxh3, now],
        )


def insert(db: sqlite_utils.Database, row: dict[str, Any], blocks: Sequence[BlockRef]) -> int:
    # ids are never reused: a check that read an old row must not act on a new one
    last = db.execute("SELECT value FROM meta WHERE key = 'last_snapshot_id'").fetchone()
    top = db.execute("SELECT COALESCE(MAX(id), 0) FROM snapshots").fetchone()[0]
    sid = max(int(last[0]) if last else 0, int(top)) + 1
    db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('last_snapshot_id', ?)", [str(sid)])
    row = {**row, "id": sid, "row_xxh3": row_digest(row, blocks)}
    db.execute(
        f"INSERT INTO snapshots({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
        list(row.values()),
    )
    for b in blocks:
        db.execute(
            "INSERT INTO snapshot_blocks(snapshot, idx, chain, blob, more) VALUES (?, ?, ?, ?, ?)",
            [sid, b.idx, b.chain, b.blob, int(b.idx < len(blocks) - 1)],
        )
    for f in [row["tail"], *(b.blob for b in blocks if b.blob)]:
        # dead=0: a blob the same transaction unreferenced is still on disk
        db.execute("UPDATE blobs SET refs = refs + 1, dead = 0 WHERE file = ?", [f])
    return sid


def add_heads(
    db: sqlite_utils.Database,
    snapshot_id: int,
    chains: Sequence[bytes],
    tokens: Sequence[int],
    block: int,
) -> None:
    """Head keys of a snapshot at each block boundary that HEAD_TOKENS tokens follow."""
    for b, key in enumerate(boundary_heads(chains, tokens, block)):
        db.execute("INSERT INTO heads(snapshot, pos, key) VALUES (?, ?, ?)", [snapshot_id, b, key])


def remove(db: sqlite_utils.Database, snapshot_id: int) -> None:
    """Delete a snapshot; blobs it was the last user of become dead."""
    row = db.execute("SELECT tail FROM snapshots WHERE id = ?", [snapshot_id]).fetchone()
    if row is None:
        return
    files = [row[0]] + [
        r[0]
        for r in db.execute(
            "SELECT blob FROM snapshot_blocks WHERE snapshot = ? AND blob IS NOT NULL",
            [snapshot_id],
        )
    ]
    db.execute("DELETE FROM snapshot_blocks WHERE snapshot = ?", [snapshot_id])
    db.execute("DELETE FROM heads WHERE snapshot = ?", [snapshot_id])
    db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
    for f in files:
        db.execute("UPDATE blobs SET refs = refs - 1 WHERE file = ?", [f])
    db.execute("UPDATE blobs SET dead = 1 WHERE refs <= 0")


def set_pinned(db: sqlite_utils.Database, namespace: str, name: str, pinned: bool) -> bool:
    """Pin a session and its checkpoints (``pinned`` is not in the row checksum)."""
    if (
        db.execute(
            "SELECT 1 FROM snapshots WHERE namespace = ? AND name = ?", [namespace, name]
        ).fetchone()
        is None
    ):
        return False
    db.execute(
        "UPDATE snapshots SET pinned = ? WHERE namespace = ? AND "
        "(name = ? OR (name IS NULL AND owner = ?))",
        [int(pinned), namespace, name, name],
    )
    return True


def demote(db: sqlite_utils.Database, snapshot_id: int) -> None:
    """A session's old snapshot becomes an anonymous checkpoint of it (``policy.retire``)."""
    db.execute("UPDATE snapshots SET name = NULL, role = 'checkpoint' WHERE id = ?", [snapshot_id])


def blob_sizes(db: sqlite_utils.Database, files: Sequence[str]) -> dict[str, int]:
    """Sizes of the named blobs (at most ``MAX_VARIABLES`` per query)."""
    out: dict[str, int] = {}
    names = sorted(set(files))
    for i in range(0, len(names), MAX_VARIABLES):
        part = names[i : i + MAX_VARIABLES]
        marks = ",".join("?" * len(part))
        out.update(db.execute(f"SELECT file, size FROM blobs WHERE file IN ({marks})", part))
    return out


def finish_pending(db: sqlite_utils.Database, salt: str) -> None:
    """The save registered under ``salt`` commits in this transaction."""
    db.execute("DELETE FROM pending WHERE salt = ?", [salt])


def session_rows(db: sqlite_utils.Database, namespace: str, name: str) -> list[SnapshotRow]:
    """A session's named snapshot and the checkpoints it owns."""
    return Index.rows_where(
        db,
        "namespace = ? AND (name = ? OR (name IS NULL AND owner = ?))",
        [namespace, name, name],
    )
