"""Statements that change the index, run inside the caller's ``Index.write()`` transaction.

No mlx.  A save commits through ``add_blobs``, ``insert`` and ``add_heads``;
``remove`` marks blobs dead when their last user goes (files are unlinked
after the commit, by ``retention.collect``).  Each statement touches the
rows of the snapshot at hand, never a scan of the store: a save costs the
same in a store of a thousand sessions and of a hundred thousand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import policy
from ..errors import SaveLostError
from ..format.tokens import unpack_tokens
from . import keys
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
    "session_pinned",
    "demote",
    "blob_sizes",
    "finish_pending",
    "session_rows",
    "version_after",
    "forget_base",
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
    """The lookup keys of a committed snapshot (``keys``): its tail under its last
    chain and, if it is trimmable, its full blocks (``chains`` h_-1 first)."""
    trimmable, floor = db.execute(
        "SELECT trimmable, min_resume FROM snapshots WHERE id = ?", [snapshot_id]
    ).fetchone()
    keys.add(
        db,
        snapshot_id,
        chains=chains,
        tokens=tokens,
        block=block,
        trimmable=bool(trimmable),
        min_resume=int(floor),
    )


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
    keys.remove(db, snapshot_id)
    db.execute("DELETE FROM retention_hints WHERE snapshot = ?", [snapshot_id])
    db.execute("DELETE FROM snapshot_blocks WHERE snapshot = ?", [snapshot_id])
    db.execute("DELETE FROM snapshots WHERE id = ?", [snapshot_id])
    for f in files:
        db.execute("UPDATE blobs SET refs = refs - 1 WHERE file = ?", [f])
        # only this snapshot's blobs can have lost their last user here
        db.execute("UPDATE blobs SET dead = 1 WHERE file = ? AND refs <= 0", [f])


def set_pinned(db: sqlite_utils.Database, namespace: str, name: str, pinned: bool) -> bool:
    """Pin a session and its checkpoints (``pinned`` is not in the row checksum)."""
    ids = _session_ids(db, namespace, name)
    if not ids:
        return False
    for sid in ids:
        db.execute("UPDATE snapshots SET pinned = ? WHERE id = ?", [int(pinned), sid])
    return True


def session_pinned(db: sqlite_utils.Database, namespace: str, name: str) -> bool:
    """Is session ``name`` (its named snapshot) pinned?  False where there is none."""
    got = db.execute(
        "SELECT pinned FROM snapshots WHERE namespace = ? AND name = ?", [namespace, name]
    ).fetchone()
    return bool(got is not None and got[0])


def set_hints(db: sqlite_utils.Database, ids: Sequence[int], ttl: float, priority: int) -> None:
    """Retention hints of snapshots ``ids`` (``policy.eviction_key``); none for (0, 0).
    Not in the row checksum: they order eviction, they never change what a row holds."""
    for sid in ids:
        if ttl <= 0 and priority == 0:
            db.execute("DELETE FROM retention_hints WHERE snapshot = ?", [sid])
        else:
            db.execute(
                "INSERT OR REPLACE INTO retention_hints(snapshot, ttl, priority) VALUES (?, ?, ?)",
                [sid, float(ttl), int(priority)],
            )


def hints_of(db: sqlite_utils.Database, snapshot_id: int) -> tuple[float, int] | None:
    """The retention hints of one snapshot (None: none)."""
    got = db.execute(
        "SELECT ttl, priority FROM retention_hints WHERE snapshot = ?", [snapshot_id]
    ).fetchone()
    return None if got is None else (float(got[0]), int(got[1]))


def session_hints(db: sqlite_utils.Database, namespace: str, name: str) -> tuple[float, int] | None:
    """The retention hints of a session's named snapshot (None: none)."""
    got = db.execute(
        "SELECT ttl, priority FROM retention_hints JOIN snapshots ON id = snapshot"
        " WHERE namespace = ? AND name = ?",
        [namespace, name],
    ).fetchone()
    return None if got is None else (float(got[0]), int(got[1]))


def set_session_hints(
    db: sqlite_utils.Database, namespace: str, name: str, ttl: float, priority: int
) -> bool:
    """Hints for a session and its checkpoints (as ``set_pinned``); False: no session."""
    ids = _session_ids(db, namespace, name)
    set_hints(db, ids, ttl, priority)
    return bool(ids)


def _session_ids(db: sqlite_utils.Database, namespace: str, name: str) -> list[int]:
    """Ids of a session's named snapshot, then of the checkpoints it owns; [] if it
    has no named snapshot.  Two index seeks (an OR of both would scan the namespace)."""
    named = db.execute(
        "SELECT id FROM snapshots WHERE namespace = ? AND name = ?", [namespace, name]
    ).fetchone()
    if named is None:
        return []
    return [named[0], *_owned_ids(db, namespace, name)]


def _owned_ids(db: sqlite_utils.Database, namespace: str, name: str) -> list[int]:
    return [
        r[0]
        for r in db.execute(
            "SELECT id FROM snapshots INDEXED BY snapshots_owner "
            "WHERE namespace = ? AND owner = ? AND name IS NULL",
            [namespace, name],
        )
    ]


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


def finish_pending(
    db: sqlite_utils.Database, salt: str, files: Sequence[str], present: Callable[[str], bool]
) -> None:
    """The save registered under ``salt`` commits in this transaction, if its pending row
    and every blob file it wrote (``files``) are still there: a check that could not see
    its lease (another kernel, an older persist) may have removed them, and committing
    would list a session whose blobs are gone.  Otherwise SaveLostError, nothing changed."""
    if db.execute("SELECT 1 FROM pending WHERE salt = ?", [salt]).fetchone() is None:
        raise SaveLostError("its registration in the index was removed")
    missing = [f for f in files if not present(f)]
    if missing:
        raise SaveLostError(f"{len(missing)} of its blob files were removed ({missing[0]})")
    db.execute("DELETE FROM pending WHERE salt = ?", [salt])


def session_rows(db: sqlite_utils.Database, namespace: str, name: str) -> list[SnapshotRow]:
    """A session's named snapshot and the checkpoints it owns (also those an
    interrupted prime left without a named snapshot)."""
    named = Index.rows_where(db, "namespace = ? AND name = ?", [namespace, name])
    owned = _owned_ids(db, namespace, name)
    return named + [r for sid in owned for r in Index.rows_where(db, "id = ?", [sid])]


def forget_base(db: sqlite_utils.Database, namespace: str, name: str) -> None:
    """A session deleted here: no history of it here continues the fleet's any more
    (``Index.base``), while the versions seen stay the replay floor (``Index.seen``)."""
    db.execute(
        "UPDATE tier_seen SET base = NULL WHERE namespace = ? AND name = ?", [namespace, name]
    )


def version_after(db: sqlite_utils.Database, namespace: str, name: str, now: float) -> float:
    """A session's new save time (its version on the tiers): ``now``, or just after the
    latest one of it this store knows (its saved row, the latest a tier showed) if that
    is later, so a session's versions stay ordered however the fleet's clocks disagree."""
    (latest,) = db.execute(
        "SELECT MAX(created) FROM (SELECT created FROM snapshots WHERE namespace = ? AND "
        "name = ? UNION ALL SELECT created FROM tier_seen WHERE namespace = ? AND name = ?)",
        [namespace, name, namespace, name],
    ).fetchone()
    return now if latest is None or latest < now else float(latest) + 1e-3


def retire_session(
    db: Any,
    namespace: str,
    name: str,
    *,
    digest: str,
    trimmable: bool,
    floor: int,
    toks: list[int],
) -> None:
    """Before a new version of session ``name`` (``toks``) is committed: each of its
    snapshots dropped, demoted to a checkpoint or kept (``policy.retire``), as a save
    or a pull that replaces a past version does."""
    for old in session_rows(db, namespace, name):
        old_toks = unpack_tokens(old.tokens)
        action = policy.retire(
            len(toks),
            trimmable,
            floor,
            old_len=old.n_tokens,
            old_is_prefix=old.identity == digest and toks[: len(old_toks)] == old_toks,
            old_is_checkpoint=old.name is None,
        )
        if action == "drop":
            remove(db, old.id)
        elif action == "demote":
            demote(db, old.id)
