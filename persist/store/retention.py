"""Retention queries: what a budget evicts and which entries a new one replaces.  No mlx.

Run inside the caller's write transaction (``db``), so what they find is
what the same transaction removes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .index import MAX_VARIABLES, Index
from .rows import SnapshotRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["anonymous_ending_at", "lru_victim", "eviction_entries"]


def anonymous_ending_at(
    db: sqlite_utils.Database, namespace: str, identity: str, ends: Sequence[bytes]
) -> list[SnapshotRow]:
    """Anonymous prefix entries whose last chain is one of ``ends`` (bounded queries)."""
    out = []
    for i in range(0, len(ends), MAX_VARIABLES):
        part = list(ends[i : i + MAX_VARIABLES])
        marks = ",".join("?" * len(part))
        out += Index.rows_where(
            db,
            f"last_chain IN ({marks}) AND namespace = ? AND identity = ? "
            "AND name IS NULL AND role = 'prefix'",
            [*part, namespace, identity],
        )
    return out


def lru_victim(
    db: sqlite_utils.Database, namespace: str | None, protect: frozenset[int]
) -> int | None:
    """The least recently used unpinned snapshot (of ``namespace``), not in ``protect``.

    The SQL form of ``policy.plan_eviction``'s order (used, then id).
    """
    where, args = "pinned = 0", list[Any]()
    if namespace is not None:
        where, args = "namespace = ? AND pinned = 0", [namespace]
    if protect:
        where += f" AND id NOT IN ({','.join('?' * len(protect))})"
        args += sorted(protect)
    index = "snapshots_ns_used" if namespace is not None else "snapshots_used"
    row = db.execute(
        f"SELECT id FROM snapshots INDEXED BY {index} WHERE {where} ORDER BY used, id LIMIT 1",
        args,
    ).fetchone()
    return None if row is None else int(row[0])


def eviction_entries(
    db: sqlite_utils.Database,
) -> tuple[list[tuple[int, float, bool, tuple[str, ...]]], dict[str, int]]:
    refs: dict[int, list[str]] = {}
    for sid, f in db.execute("SELECT snapshot, blob FROM snapshot_blocks WHERE blob IS NOT NULL"):
        refs.setdefault(sid, []).append(f)
    entries = [
        (sid, used, bool(pinned), (tail, *refs.get(sid, [])))
        for sid, used, pinned, tail in db.execute("SELECT id, used, pinned, tail FROM snapshots")
    ]
    sizes = {f: s for f, s in db.execute("SELECT file, size FROM blobs WHERE dead = 0")}
    return entries, sizes
